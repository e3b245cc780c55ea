"""``acl-fairseq-predict``: raw text classified with a fine-tuned checkpoint, with early exit."""

from .cli import main

__all__ = ["main"]
