"""The flags of ``acl-fairseq-sweep`` checked before any model or data is loaded."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from acl_fairseq.early_exit.policies import make_policy, policy_kind
from acl_fairseq.early_exit.thresholds import Quantiles

DEFAULT_QUANTILES = 10


def check_thresholds(kind: str, thresholds: Sequence[float]) -> None:
    """Raise ``ValueError`` (naming ``--thresholds``) for a value the ``kind`` does not accept
    (the range of the policy itself)."""
    for t in thresholds:
        try:
            make_policy(kind, t)
        except ValueError:
            raise ValueError(
                f"--thresholds: {t:g} is not a valid {kind} threshold: each must be "
                f"{policy_kind(kind).value_range} (--policy {kind})"
            ) from None


def threshold_spec(text: str) -> list[float] | Quantiles:
    """``--thresholds``: ``0,0.1,inf`` or ``quantiles`` / ``quantiles:N``."""
    name, sep, value = text.strip().partition(":")
    if name.lower() == "quantiles":
        try:
            count = int(value) if sep else DEFAULT_QUANTILES
        except ValueError:
            count = 0
        if count < 1:
            raise argparse.ArgumentTypeError(
                f"expected quantiles or quantiles:N with an integer N >= 1, got {text!r}"
            )
        return Quantiles(count)
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers like 0,0.1,inf or quantiles[:N], got {text!r}"
        ) from None


def int_list(text: str) -> list[int]:
    """``--batch-sizes``: positive integers like ``1,32``."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,32, got {text!r}")
    return values
