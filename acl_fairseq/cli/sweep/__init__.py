"""``acl-fairseq-sweep``: accuracy and speed of early exit over a threshold grid."""

from .cli import main

__all__ = ["main"]
