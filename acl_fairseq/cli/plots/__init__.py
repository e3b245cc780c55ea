"""``acl-fairseq-plots``: pictures of an ``acl-fairseq-compare`` results folder."""

from .cli import main

__all__ = ["main"]
