"""``acl-fairseq-study``: the converged study (its data, phases and report)."""

from .cli import main

__all__ = ["main"]
