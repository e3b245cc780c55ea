"""``acl-fairseq-demo``: the README's demo: a real BERT, real sentences, ACL and ACL-CL on CPU."""

from .cli import main

__all__ = ["main"]
