"""Data: GLUE / TSV preparation into fairseq's binarized layout (``tasks``, ``binarize``), the
tokenizer and its files recorded with the data (``tokenizer/``), the one text encoder of new
text (``text_encoder``), raw input lines (``input_lines``) and the binarized splits
(``splits``)."""
