"""Tasks: importing this package registers them with fairseq."""

from . import acl_sentence_prediction  # noqa: F401
