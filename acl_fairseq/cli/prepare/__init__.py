"""``acl-fairseq-prepare``: GLUE / TSV data binarized for fairseq (tasks, tokenizers, binarize)."""
