"""Criterions: importing this package registers them with fairseq."""

from . import acl_embed, ce_scl  # noqa: F401
