"""What ``acl-fairseq-sweep`` does at one precision (and backend): ``calibrate`` (the exits'
pass, the policies, the untimed rows and the choice by accuracy), ``time_all`` (every
precision's full depth and policies in the same interleaved rounds, so that their times
compare) and ``finish`` (the choice by speed-up, the chosen policy's times checked, its saved
entry)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from acl_fairseq.cli.sweep.checks import DEFAULT_DROPS
from acl_fairseq.early_exit.calibrate import calibrated_family
from acl_fairseq.early_exit.evidence import check_split
from acl_fairseq.early_exit.policies import make_policy, policy_kind
from acl_fairseq.early_exit.table import format_layer_scores
from acl_fairseq.early_exit.thresholds import (
    collect_exits,
    exit_accuracies,
    oracle_rows,
    sweep_thresholds,
)
from acl_fairseq.inference import deploy
from acl_fairseq.inference.measure import policy_rows, time_together
from acl_fairseq.runtime.onnx_runtime import BACKENDS

__all__ = ["Precision", "calibrate", "fastest", "finish", "time_all"]


class Precision:
    """What the sweep found at one precision: table rows, oracle rows, notes, the choice."""

    def __init__(self, dtype: str, backend: str = BACKENDS[0]) -> None:
        self.dtype = dtype
        self.backend = backend
        self.rows: list[dict[str, Any]] = []
        self.oracles: list[dict[str, Any]] = []
        self.note = ""
        self.choice: deploy.Choice | None = None
        self.entry: dict[str, Any] | None = None
        self.model: Any = None  # what runs it, until timed
        self.policies: list = []
        self.exits: Any = None  # the first batch size's exit pass
        self.target: deploy.DeployTarget | None = None
        self.extra: dict[str, Any] = {}


def split_name(args: argparse.Namespace) -> str:
    """``--split NAME`` (and ``--max-examples N`` when it cuts it), as the messages name it."""
    cut = f" (--max-examples {args.max_examples})" if args.max_examples else ""
    return f"--split {args.split}{cut}"


def _policies(args: argparse.Namespace, exits: Any, thresholds: Any, head_cost: float) -> list:
    """The rows' policies at one precision: the kind's thresholds (from the first precision's
    pass, so that rows line up) or, for a calibrated kind, its policies at each target."""
    exit_logits, targets = exits
    if policy_kind(args.policy).calibrated:
        drops = sorted({*(args.drops or DEFAULT_DROPS), args.max_accuracy_drop or 0.0})
        return calibrated_family(
            args.policy, exit_logits, targets, drops, args.constraint, head_cost, args.patience,
            split_name(args),
        )  # fmt: skip
    return [make_policy(args.policy, t) for t in thresholds]


def calibrate(
    args: argparse.Namespace,
    model: Any,
    dtype: str,
    backend: str,
    batches: dict[int, list],
    head: str,
    num_classes: int,
    target: deploy.DeployTarget | None,
    reference: torch.Tensor | None,
    thresholds: list | None,
) -> tuple[Precision, list | None]:
    """Every batch size at ``dtype`` (one ``exit_outputs`` pass each), untimed rows; the curve,
    the bounds and the choice from the first batch size's pass. Raises ``TargetError``."""
    out = Precision(dtype, backend)
    out.model, out.target = model, target
    label = dtype if len(args.backend) == 1 else f"{dtype} on {backend}"
    head_cost = args.head_cost.at(dtype, backend)  # NAME=COST: its own
    if target is not None:
        out.target = dataclasses.replace(target, head_cost=head_cost)
    first = args.batch_sizes[0]
    out.exits = exit_logits, targets = exits = collect_exits(model, batches[first], head)
    scores = exit_accuracies(exit_logits, targets)
    out.note = f"{label}:\n\n{format_layer_scores(scores, model.num_layers)}\n"
    if thresholds is None and not policy_kind(args.policy).calibrated:
        thresholds = sweep_thresholds(args.thresholds, args.policy, exit_logits, num_classes)
    if target is not None or policy_kind(args.policy).calibrated:  # before any fitting
        check_split(exit_logits, targets, args.policy, split_name(args))
    out.policies = _policies(args, exits, thresholds, head_cost)
    out.oracles = oracle_rows(exit_logits, targets, first, label)
    if out.target is not None and out.target.max_accuracy_drop is not None:
        out.choice = deploy.choose(
            args.policy, exit_logits, targets, out.target, split=split_name(args)
        )
        if out.choice.policy not in out.policies:
            out.policies.append(out.choice.policy)
    for size in args.batch_sizes:
        pass_ = exits if size == first else collect_exits(model, batches[size], head)
        out.rows += policy_rows(*pass_, out.policies, size, label)
    out.extra = {"batch_size": first, "backend": backend}
    if reference is not None:
        final = exit_logits[-1][1].argmax(-1).cpu()
        agree = 100.0 * float(final.eq(reference).double().mean())
        out.extra["full_agreement_with_fp32"] = round(agree, 4)
        out.note += (
            f"full depth at {label}: accuracy {out.rows[0]['accuracy']:.2f}%, agreement with "
            f"fp32 {agree:.2f}%\n"
        )
    return out, thresholds


def time_all(
    found: list[Precision],
    batches: dict[int, list],
    head: str,
    args: argparse.Namespace,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Times every precision's full depth and policies at each batch size, all precisions in
    the same interleaved rounds (``measure.time_together``), so that they compare."""
    for size in args.batch_sizes:
        runs = [
            (p.model, p.policies, [r for r in p.rows if r["batch_size"] == size]) for p in found
        ]
        time_together(runs, batches[size], head, args.repeats, progress, f"batch {size}")


def finish(args: argparse.Namespace, out: Precision) -> None:
    """The choice by speed-up (``--target-speedup``), the chosen policy's times checked and
    its saved entry. Raises ``TargetError``."""
    exit_logits, targets = out.exits
    part = [r for r in out.rows if r["batch_size"] == args.batch_sizes[0]]
    target = out.target
    if target is not None and target.target_speedup is not None:
        out.choice = deploy.choose(
            args.policy, exit_logits, targets, target, part, split_name(args)
        )
    if out.choice is None:
        return
    assert target is not None  # a choice comes from a target
    extra = dict(out.extra)
    timed = next(r for r in part[1:] if r["threshold"] == out.choice.policy.value)
    if timed["early_ms"] is not None:
        deploy.check_measured(
            out.choice.policy, timed["early_ms"], timed["full_ms"], part[0]["batch_size"],
            args.split,
        )  # fmt: skip
        extra["ms_per_example"] = round(timed["early_ms"], 4)
        extra["full_ms_per_example"] = round(timed["full_ms"], 4)
    out.entry = deploy.entry(out.choice, exit_logits, targets, target.head_cost, **extra)
    if args.head_cost.own:  # NAME=COST given: the cost this entry was chosen at
        out.entry["head_cost"] = target.head_cost


def fastest(tried: list[Precision]) -> Precision:
    """The one of a precision's backends whose chosen policy ran fastest per row at the first
    batch size (the only one when one was tried or nothing was chosen); its entry records
    every backend's time."""
    timed = [p for p in tried if p.entry is not None and "ms_per_example" in p.entry]
    if len(tried) == 1 or len(timed) < len(tried):
        return tried[0]
    best = min(timed, key=lambda p: p.entry["ms_per_example"])  # type: ignore[index]
    best.entry["timed_backends"] = {p.backend: p.entry["ms_per_example"] for p in timed}
    return best
