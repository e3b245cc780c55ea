"""``acl-fairseq-convert-bert``: a Hugging Face BERT folder as a fairseq RoBERTa checkpoint."""

from .cli import main

__all__ = ["main"]
