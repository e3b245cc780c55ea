"""Criterions: importing this package registers them with fairseq."""

from . import acl_cross_layer, acl_embed, ce_scl, multi_exit_ce  # noqa: F401
