"""ACL-Grad's flags: the criterion flags (:class:`AclGradConfig`), the task's angle-log flags
(:class:`AclGradLogConfig`), the ``--acl-grad`` / ``--no-acl-grad`` switch, and what the
training step takes of them (:class:`AclGradSettings`)."""

import argparse
from dataclasses import dataclass, field
from typing import Any, Optional

from fairseq.dataclass import FairseqDataclass

from .scope import parse_scope

__all__ = [
    "AclGradConfig",
    "AclGradLogConfig",
    "AclGradSettings",
    "acl_grad_switch",
    "add_acl_grad_switch",
]

_SWITCH_HELP = (
    "ACL-Grad on (--acl-grad) or off (--no-acl-grad; in a hydra config acl_grad: false): "
    "drop the contrastive term of an update whose gradient conflicts with the CE gradient"
)


def acl_grad_switch(default: bool) -> Any:
    """The dataclass field of the ACL-Grad on/off switch, with ``default``."""
    return field(default=default, metadata={"help": _SWITCH_HELP})


@dataclass
class AclGradConfig(FairseqDataclass):
    """ACL-Grad's criterion flags, mixed into each criterion's config. ``acl_grad``: on by
    default here (:func:`acl_grad_switch` sets another default)."""

    acl_grad: bool = acl_grad_switch(default=True)
    acl_grad_threshold: float = field(
        default=90.0,
        metadata={
            "help": "ACL-Grad: drop the contrastive term(s) of an update when the angle between "
            "the (total) CE gradient and the (total) contrastive gradient exceeds this many "
            "degrees (0..180)"
        },
    )
    acl_grad_scope: str = field(
        default="all",
        metadata={
            "help": "parameters the ACL-Grad angle is measured on. 'all': every trainable "
            "parameter, decided once per update on the exact gradients (a second backward "
            "pass per micro-batch); 'head': only the classification heads' parameters, "
            "decided per micro-batch before its single backward pass (an approximation, "
            "without the second pass through the encoder); 'top:K': the heads plus the top K "
            "encoder layers, likewise per micro-batch (top:0 is head; cost grows with K). "
            "Costs and agreement: docs/results.md"
        },
    )


@dataclass
class AclGradLogConfig(FairseqDataclass):
    """ACL-Grad's task flag: the angle log is written by the task, for any criterion."""

    acl_grad_log: Optional[str] = field(
        default=None,
        metadata={
            "help": "append one line per ACL-Grad decision (update, angle in degrees, kept 0/1, "
            "angle on the classification heads alone) to this TSV file (rank 0 only), e.g. for "
            "the angle histogram; a '{rank}' in the path writes one file per data-parallel worker"
        },
    )
    acl_grad_log_top_k: Optional[str] = field(
        default=None,
        metadata={
            "help": "with --acl-grad-scope all and --acl-grad-log: also log, per K of this comma "
            "list (e.g. 1,2,3), the angle of the same update on the classification heads plus "
            "the top K encoder layers (what --acl-grad-scope top:K would measure)"
        },
    )


def add_acl_grad_switch(parser: argparse.ArgumentParser, default: bool) -> None:
    """Registers ``--acl-grad`` / ``--no-acl-grad`` (one bool, ``acl_grad``). fairseq would
    register a bool as one flag that flips its default; registered first, fairseq skips it."""
    parser.add_argument(
        "--acl-grad", action=argparse.BooleanOptionalAction, default=default, help=_SWITCH_HELP
    )


@dataclass(frozen=True)
class AclGradSettings:
    """What the training step needs of a criterion's ACL-Grad flags (checked beforehand by
    the criterion's validator, ``criterions.base.validate_criterion_config``)."""

    threshold: float  # degrees
    scope: str  # "all", "head" or "top:K"

    @property
    def top_k(self) -> int | None:
        """K of ``top:K`` (0 for ``head``); None for the exact scope ``all``."""
        return parse_scope(self.scope)

    @classmethod
    def from_config(cls, cfg: Any) -> "AclGradSettings | None":
        """The settings of an :class:`AclGradConfig` (or its hydra node); None when off.
        Raises ValueError naming ``--acl-grad-scope`` for a value of the wrong form."""
        parse_scope(str(cfg.acl_grad_scope))  # the form, at set-up (even when off)
        if not cfg.acl_grad:
            return None
        return cls(threshold=float(cfg.acl_grad_threshold), scope=str(cfg.acl_grad_scope))
