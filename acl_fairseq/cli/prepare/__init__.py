"""``acl-fairseq-prepare``: GLUE / TSV data binarized for fairseq (``acl_fairseq.data``)."""

from .cli import main

__all__ = ["main"]
