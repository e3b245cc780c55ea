"""The parts of ``acl-fairseq-sweep`` that work from one pass over every exit: the exits'
logits on the split, the ``--thresholds quantiles:N`` grid, the oracle rows and the
``--max-accuracy-drop`` / ``--target-speedup`` choice written next to the checkpoint."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from acl_fairseq.early_exit.policies import EntropyPolicy, ExitPolicy, MaxProbPolicy, PatiencePolicy
from acl_fairseq.early_exit.saved_policy import write_policy
from acl_fairseq.early_exit.thresholds import choose_row, oracle_exits, quantile_thresholds

DEFAULT_QUANTILES = 10
POLICY_KINDS = ("entropy", "maxprob", "patience")


def make_policy(kind: str, threshold: float) -> ExitPolicy:
    """The ``ExitPolicy`` of ``kind`` at ``threshold`` (patience: an integer)."""
    if kind == "entropy":
        return EntropyPolicy(float(threshold))
    if kind == "maxprob":
        return MaxProbPolicy(float(threshold))
    if kind == "patience":
        if float(threshold) != int(threshold):
            raise ValueError(f"patience must be an integer, got {threshold}")
        return PatiencePolicy(int(threshold))
    raise ValueError(f"unknown policy kind {kind!r}: expected one of {POLICY_KINDS}")


def default_thresholds(kind: str, num_classes: int, num_shallow_exits: int) -> list[float]:
    """A grid from 'never exits early' to '(almost) always exits at the first exit'.

    entropy: 0 .. ln(K) in 10 steps; maxprob: 1.0 .. 1/K in 10 steps (for K = 2: 1.0 .. 0.5);
    patience: E .. 0 for E shallow exits (patience E never exits early).
    """
    if kind == "entropy":
        top = math.log(num_classes)
        return [round(top * i / 10, 4) for i in range(11)]
    if kind == "maxprob":
        low = 1.0 / num_classes
        return [round(1.0 - (1.0 - low) * i / 10, 4) for i in range(11)]
    if kind == "patience":
        return [float(p) for p in range(num_shallow_exits, -1, -1)]
    raise ValueError(f"unknown policy kind {kind!r}: expected one of {POLICY_KINDS}")


class Quantiles(NamedTuple):
    """``--thresholds quantiles[:N]``: N thresholds from the exits' confidences."""

    count: int


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


def collect_exits(
    model: Any, batches: Sequence[tuple[Tensor, Tensor]], head: str
) -> tuple[list[tuple[int, Tensor]], Tensor]:
    """``([(layer, N x K float logits)], target N)`` over all batches, one ``exit_outputs``
    pass, on the CPU."""
    per_layer: dict[int, list[Tensor]] = {}
    with torch.no_grad():
        for tokens, _ in batches:
            for out in model.exit_outputs(tokens, classification_head_name=head):
                per_layer.setdefault(out.layer, []).append(out.logits.float().cpu())
    targets = torch.cat([t.view(-1).cpu() for _, t in batches])
    return [(layer, torch.cat(chunks)) for layer, chunks in sorted(per_layer.items())], targets


def exit_accuracies(exit_logits: Sequence[tuple[int, Tensor]], targets: Tensor) -> dict[int, float]:
    """Accuracy (%) of every exit, ``{layer: accuracy}``."""
    return {
        layer: 100.0 * float(logits.argmax(dim=-1).eq(targets).double().mean())
        for layer, logits in exit_logits
    }


def sweep_thresholds(
    spec: list[float] | Quantiles | None,
    kind: str,
    exit_logits: Sequence[tuple[int, Tensor]],
    default: list[float],
) -> list[float]:
    """The thresholds to sweep: the list given, the quantile grid, or ``default``.

    Patience thresholds are integers: ``quantiles`` gives every patience (``default``).
    """
    if spec is None:
        return default
    if isinstance(spec, Quantiles):
        if kind == "patience":
            return default
        return quantile_thresholds(exit_logits, kind, spec.count)
    return spec


def oracle_rows(
    exit_logits: Sequence[tuple[int, Tensor]], targets: Tensor, batch_size: int
) -> list[dict[str, Any]]:
    """Table rows ``oracle-final`` (earliest exit agreeing with the final exit: the full
    model's accuracy) and ``oracle-gold`` (earliest exit that is right: an upper bound on the
    accuracy at that depth); layer-count speed-up only, no timing."""
    num_layers = exit_logits[-1][0]
    rows = []
    for name, gold in (("oracle-final", None), ("oracle-gold", targets)):
        layers, preds = oracle_exits(exit_logits, gold)
        mean_layer = float(layers.double().mean())
        counts = torch.unique(layers, return_counts=True)
        rows.append(
            {
                "batch_size": batch_size,
                "policy": name,
                "threshold": None,
                "examples": int(targets.numel()),
                "accuracy": 100.0 * float(preds.eq(targets).double().mean()),
                "mean_exit_layer": mean_layer,
                "layer_speedup": num_layers / mean_layer,
                "full_ms": None,
                "early_ms": None,
                "wall_speedup": None,
                "fraction_of_ideal": None,
                "exit_share": {int(k): float(n) / targets.numel() for k, n in zip(*counts)},
            }
        )
    return rows


def policy_string(kind: str, threshold: float) -> str:
    """``parse_policy`` string of a swept row (full precision)."""
    if kind == "patience":
        return f"patience:{int(threshold)}"
    return f"{kind}:{'inf' if math.isinf(threshold) else repr(float(threshold))}"


def choose_and_save(
    rows: Sequence[dict[str, Any]],
    checkpoint: str | Path,
    split: str,
    max_accuracy_drop: float | None,
    target_speedup: float | None,
) -> tuple[Path, dict[str, Any]]:
    """Choose the row for the target among ``rows`` (one batch size) and write its policy
    next to ``checkpoint``. Returns ``(path written, chosen row)``."""
    row = choose_row(rows, max_accuracy_drop, target_speedup)
    full = next(r for r in rows if r["policy"] == "none")
    target = (
        {"max_accuracy_drop": max_accuracy_drop}
        if max_accuracy_drop is not None
        else {"target_speedup": target_speedup}
    )
    path = write_policy(
        checkpoint,
        policy_string(row["policy"], row["threshold"]),
        target=target,
        split=split,
        examples=row["examples"],
        accuracy=round(row["accuracy"], 4),
        full_accuracy=round(full["accuracy"], 4),
        mean_exit_layer=round(row["mean_exit_layer"], 4),
        layer_speedup=round(row["layer_speedup"], 4),
    )
    return path, row
