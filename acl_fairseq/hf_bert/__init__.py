"""Hugging Face BERT <-> fairseq RoBERTa: the state-dict mapping both ways (``state``), the
vocabulary both ways (``vocab``), a BERT folder as a fairseq checkpoint folder (``convert``), and
a fine-tuned checkpoint as a ``transformers`` folder (``export``, its tokenizer: ``tokenizer``)."""
