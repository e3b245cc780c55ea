"""Part 3 of ``inference_speed.py``: what the early-exit loop costs, at batch 1 and at batch B.

* Full-depth overhead: the time of ``early_exit`` over the plain full-depth forward when no row
  leaves, for ``entropy:0`` (a policy that can never exit: the loop runs the plain forward) and
  ``entropy:1e-30`` (evaluated at every exit, but no row leaves: the loop's own cost, exit
  heads and policy included). Goal: at most 3% more than the plain forward.
* Fraction of the layer-count ideal at the thresholds of part 2 (goals: >= 0.95 at batch B,
  >= 0.9 at batch 1).

Medians over ``rounds`` interleaved rounds (``acl_fairseq.cli.sweep.sweep``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from acl_fairseq.cli import sweep as ees

GOAL_OVERHEAD = 0.03
GOAL_FRACTION = {1: 0.9}  # per batch size; others: GOAL_FRACTION_BATCHED
GOAL_FRACTION_BATCHED = 0.95
NEVER, NOBODY_LEAVES = 0.0, 1e-30


def single_rows(batches: Sequence[ees.Batch], pad: int, limit: int) -> list[ees.Batch]:
    """Up to ``limit`` batches of one row each, trailing padding removed."""
    out: list[ees.Batch] = []
    for tokens, target in batches:
        for row, label in zip(tokens, target):
            width = int(row.ne(pad).sum())
            out.append((row[:width].unsqueeze(0), label.view(1)))
            if len(out) == limit:
                return out
    return out


def loop_cost(
    model: Any,
    batches_by_size: dict[int, Sequence[ees.Batch]],
    thresholds: Sequence[float],
    head: str,
    rounds: int,
) -> list[str]:
    """Markdown lines: full-depth overhead and fraction of ideal per batch size."""
    lines = [
        "| batch | policy | mean exit layer | layer-count speed-up | wall-clock speed-up | "
        "overhead / fraction of ideal | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    grid = [NEVER, NOBODY_LEAVES, *thresholds]
    for size, batches in batches_by_size.items():
        with torch.inference_mode():
            rows = ees.sweep(model, batches, "entropy", grid, head, rounds, batch_size=size)
        for row in rows[1:]:
            t = row["threshold"]
            if t in (NEVER, NOBODY_LEAVES):
                overhead = 1.0 / row["wall_speedup"] - 1.0
                verdict = "met" if overhead <= GOAL_OVERHEAD else "NOT met"
                name = "entropy:0 (never exits)" if t == NEVER else "entropy:1e-30 (nobody leaves)"
                value = f"overhead {100 * overhead:+.1f}%"
                goal = f"<= {100 * GOAL_OVERHEAD:.0f}%: {verdict}"
            else:
                goal_fraction = GOAL_FRACTION.get(size, GOAL_FRACTION_BATCHED)
                fraction = row["fraction_of_ideal"]
                verdict = "met" if fraction >= goal_fraction else "NOT met"
                name, value = f"entropy:{t:.4g}", f"{100 * fraction:.0f}% of ideal"
                goal = f">= {100 * goal_fraction:.0f}%: {verdict}"
            lines.append(
                f"| {size} | {name} | {row['mean_exit_layer']:.2f} | {row['layer_speedup']:.2f} "
                f"| {row['wall_speedup']:.3f} | {value} | {goal} |"
            )
    return lines
