"""The flags of ``acl-fairseq-sweep`` checked before any model or data is loaded."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from acl_fairseq.early_exit.policies import make_policy, policy_kind
from acl_fairseq.early_exit.thresholds import Quantiles
from acl_fairseq.inference.deploy import DeployTarget, HeadCosts, head_costs
from acl_fairseq.runtime.onnx_runtime import BACKENDS
from acl_fairseq.runtime.precision import check_precision

DEFAULT_QUANTILES = 10
DEFAULT_DROPS = (0.0, 0.5, 1.0, 2.0, 5.0)


def check_thresholds(kind: str, thresholds: Sequence[float]) -> None:
    """Raise ``ValueError`` (naming ``--thresholds``) for a value the ``kind`` does not accept
    (the range of the policy itself)."""
    if policy_kind(kind).calibrated:
        raise ValueError(
            f"--thresholds: --policy {kind} is calibrated on the split, not swept: its rows are "
            "the policies found at each --drops target (and --max-accuracy-drop)"
        )
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
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,32, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """``--drops``: numbers >= 0 like ``0,0.5,1``."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0 like 0,0.5,1, got {text!r}")
    return values


def dtype_list(text: str) -> list[str]:
    """``--dtypes``: ``fp32``, ``bf16``, ``int8``, comma-separated, no repeats."""
    try:
        values = [check_precision(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--dtype ", "")) from None
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"expected distinct precisions like fp32,int8, got {text!r}"
        )
    return values


def backend_list(text: str) -> list[str]:
    """``--backend``: ``fairseq``, ``onnxruntime`` or both, comma-separated, no repeats."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in BACKENDS]
    if not values or bad or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"expected distinct backends among {', '.join(BACKENDS)}, got {text!r}"
        )
    return values


def head_cost_spec(text: str) -> HeadCosts:
    """``--head-cost``: ``C[,NAME=C]`` (``deploy.head_costs``)."""
    try:
        return head_costs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--head-cost: ", "")) from None


def check_flags(args: argparse.Namespace, use_cuda: bool) -> DeployTarget | None:
    """The deploy target of the flags (None without one); ``ValueError`` naming the flag of a
    combination that cannot work."""
    calibrated = policy_kind(args.policy).calibrated
    if args.max_examples is not None and args.max_examples < 1:
        raise ValueError(
            f"--max-examples must be >= 1 (the first N examples of --split), got "
            f"{args.max_examples}; leave it out to use the whole split"
        )
    if args.thresholds is not None and not isinstance(args.thresholds, Quantiles):
        check_thresholds(args.policy, args.thresholds)
    if args.thresholds is not None and calibrated:
        check_thresholds(args.policy, [])
    if args.drops is not None and not calibrated:
        raise ValueError(
            f"--drops: the rows of a calibrated policy (per_exit_*); --policy {args.policy} "
            "sweeps --thresholds"
        )
    if args.patience is not None and not args.policy.startswith("per_exit_"):
        raise ValueError(
            "--patience: beside a per-exit policy's thresholds (--policy per_exit_entropy); "
            "--policy patience sweeps patience itself"
        )
    if use_cuda and "int8" in args.dtypes:
        raise ValueError(
            "--dtypes int8 runs on the CPU only (torch's dynamic quantization): add --cpu"
        )
    if len(args.backend) > 1 and args.max_accuracy_drop is not None and args.repeats == 0:
        raise ValueError(
            f"--backend {','.join(args.backend)}: the backend of each precision is the one "
            "whose chosen policy runs faster, which needs timing: give --repeats 1 or more, "
            "or one --backend"
        )
    if len(args.backend) > 1 and args.target_speedup is not None:
        raise ValueError(
            "--target-speedup picks a swept row by its layer count, not by time: give one "
            "--backend with it"
        )
    if args.max_accuracy_drop is None and args.target_speedup is None:
        if args.risk_control is not None:
            raise ValueError("--risk-control needs --max-accuracy-drop D (what it certifies)")
        return None
    target = DeployTarget(
        max_accuracy_drop=args.max_accuracy_drop,
        target_speedup=args.target_speedup,
        constraint=args.constraint,
        risk_control=args.risk_control,
        head_cost=args.head_cost.default,
        patience=args.patience,
    )
    target.check()
    return target
