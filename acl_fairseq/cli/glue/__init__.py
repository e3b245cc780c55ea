"""``scripts/glue/train.sh``: one GLUE task, one method, fairseq's RoBERTa GLUE recipe."""

from .cli import main

__all__ = ["main"]
