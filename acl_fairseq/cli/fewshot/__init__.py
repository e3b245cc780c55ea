"""``acl-fairseq-fewshot``: the few-shot protocol on a labelled TSV (draws, dev, learning rates)."""

from .cli import main

__all__ = ["main"]
