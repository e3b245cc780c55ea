"""The tokenizer of prepared data, one module per concern: ``kinds`` (GPT-2 BPE, BERT WordPiece,
SentencePiece, built from the ``TokenizerConfig`` that ``prepare_glue.json`` records),
``files`` (its files copied into the data folder and found again), ``flags`` (the command-line
flags of the tools that prepare data) and ``parallel`` (a task's texts tokenized in parallel;
SentencePiece training)."""
