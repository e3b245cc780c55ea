"""Data: GLUE / TSV preparation into fairseq's binarized layout (``tasks``, ``binarize``), the
tokenizers and their files recorded with the data (``tokenizers``, ``tokenizer_files``), the one
text encoder of new text (``text_encoder``) and the binarized splits (``splits``)."""
