"""``acl-fairseq-export-hf``: a fine-tuned checkpoint as a Hugging Face ``transformers`` folder."""

from .cli import main

__all__ = ["main"]
