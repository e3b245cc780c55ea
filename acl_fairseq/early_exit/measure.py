"""Accuracy and wall-clock speed of early exit over thresholds, measured in one process.

``sweep`` gives, for one policy kind and every threshold, the accuracy, the mean exit layer,
the layer-count speed-up ``num_layers / mean exit layer`` (the ideal), the measured wall-clock
speed-up (time of the full-depth forward / time of ``early_exit`` over the same batches) and
the fraction of the ideal that the measurement achieves, as rows of the sweep table
(``early_exit.table``).

Timing: one untimed warm-up pass per configuration (it also yields the accuracy and exit
layers), then ``repeats`` rounds; each round times the full forward and every threshold over
all batches, in alternating order, so machine noise hits them alike. The wall-clock speed-up is
the median over rounds of the per-round ratio. ``torch.set_num_threads`` is left as it is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..models.heads import DEFAULT_HEAD
from .policies import ExitPolicy, make_policy

__all__ = ["Batch", "sweep"]

Batch = tuple[Tensor, Tensor]
"""``(src_tokens B x T, target B)`` on the model's device."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _full_pass(model: Any, batches: Sequence[Batch], head: str) -> list[Tensor]:
    """Predictions of the final exit (plain full-depth forward) for every batch."""
    return [model(tokens, classification_head_name=head)[0].argmax(dim=-1) for tokens, _ in batches]


def _early_pass(model: Any, batches: Sequence[Batch], policy: ExitPolicy, head: str) -> list:
    return [
        model.early_exit(tokens, policy, classification_head_name=head) for tokens, _ in batches
    ]


def sweep(
    model: Any,
    batches: Sequence[Batch],
    policy_kind: str,
    thresholds: Sequence[float],
    head: str = DEFAULT_HEAD,
    repeats: int = 3,
    batch_size: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Accuracy, exit layers and speed of ``early_exit`` at every threshold, on ``batches``.

    Args:
        model: a ``MultiExitRobertaModel`` (or anything with ``num_layers``, ``early_exit``
            and ``__call__(tokens, classification_head_name=...)``), in eval mode.
        batches: ``(src_tokens, target)`` pairs on the model's device.
        policy_kind: ``entropy``, ``maxprob`` or ``patience``.
        thresholds: one table row each.
        repeats: timed rounds (after one untimed warm-up pass per configuration).
        batch_size: label of the rows (default: the size of the first batch).
        progress: called with one line per configuration and per timed round.
    Returns:
        one dict per row (keys ``COLUMNS``): first the full model (``policy="none"``), then one
        per threshold in the given order. ``accuracy`` is in percent, ``full_ms`` / ``early_ms``
        are median milliseconds per example.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    policies = [make_policy(policy_kind, t) for t in thresholds]
    num_layers = int(model.num_layers)
    device = batches[0][0].device
    examples = sum(int(target.numel()) for _, target in batches)
    batch_size = batch_size or int(batches[0][0].size(0))
    targets = [target for _, target in batches]
    start = time.perf_counter()

    def report(message: str) -> None:
        if progress is not None:
            progress(f"batch {batch_size}: {message} [{time.perf_counter() - start:.0f} s]")

    def full() -> Any:
        return _full_pass(model, batches, head)

    def runner(policy: ExitPolicy) -> Callable[[], Any]:
        return lambda: _early_pass(model, batches, policy, head)

    with torch.no_grad():
        # warm-up: also the statistics (predictions do not depend on timing)
        full_correct = sum(int(p.eq(t).sum()) for p, t in zip(full(), targets))
        report(f"full depth: accuracy {100.0 * full_correct / examples:.1f}%")
        stats = []
        for number, (threshold, policy) in enumerate(zip(thresholds, policies), start=1):
            results = runner(policy)()
            correct = sum(int(r.predictions.eq(t).sum()) for r, t in zip(results, targets))
            layers = torch.cat([r.exit_layers for r in results]).cpu()
            share = {
                int(layer): float(n) / examples
                for layer, n in zip(*torch.unique(layers, return_counts=True))
            }
            stats.append((correct, float(layers.float().mean()), share))
            report(
                f"{policy_kind} {threshold:g} ({number}/{len(policies)}): accuracy "
                f"{100.0 * correct / examples:.1f}%, mean exit layer {stats[-1][1]:.2f}"
            )

        # timed rounds, full forward and thresholds interleaved, order alternating
        jobs = [full] + [runner(p) for p in policies]
        times: list[list[float]] = [[] for _ in jobs]
        for round_idx in range(repeats):
            order = range(len(jobs)) if round_idx % 2 == 0 else reversed(range(len(jobs)))
            for j in order:
                times[j].append(_timed(jobs[j], device))
            report(f"timed round {round_idx + 1}/{repeats}")

    def per_example_ms(seconds: list[float]) -> float:
        return 1000.0 * statistics.median(seconds) / examples

    full_ms = per_example_ms(times[0])
    rows = [
        {
            "batch_size": batch_size,
            "policy": "none",
            "threshold": None,
            "examples": examples,
            "accuracy": 100.0 * full_correct / examples,
            "mean_exit_layer": float(num_layers),
            "layer_speedup": 1.0,
            "full_ms": full_ms,
            "early_ms": full_ms,
            "wall_speedup": 1.0,
            "fraction_of_ideal": 1.0,
            "exit_share": {num_layers: 1.0},
        }
    ]
    for threshold, (correct, mean_layer, share), t in zip(thresholds, stats, times[1:]):
        layer_speedup = num_layers / mean_layer
        wall = statistics.median(f / e for f, e in zip(times[0], t))
        rows.append(
            {
                "batch_size": batch_size,
                "policy": policy_kind,
                "threshold": threshold,
                "examples": examples,
                "accuracy": 100.0 * correct / examples,
                "mean_exit_layer": mean_layer,
                "layer_speedup": layer_speedup,
                "full_ms": full_ms,
                "early_ms": per_example_ms(t),
                "wall_speedup": wall,
                "fraction_of_ideal": wall / layer_speedup,
                "exit_share": share,
            }
        )
    return rows
