"""``acl-fairseq-compare``: fine-tuning methods compared over seeds (plan, run, report)."""

from .cli import main

__all__ = ["main"]
