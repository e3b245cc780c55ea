"""Accuracy and wall-clock speed of early exit over policies, measured in one process.

``sweep`` gives, for a list of policies on the same batches, the accuracy, the agreement with
the full model, the mean exit layer, the layer-count speed-up ``num_layers / mean exit layer``
(the ideal), the measured wall-clock speed-up (time of the full-depth forward / time of
``early_exit`` over the same batches) and the fraction of the ideal that the measurement
achieves, as rows of the sweep table (``early_exit.table``).

Accuracy, agreement and exit layers come from ONE ``exit_outputs`` pass over the batches
(``thresholds.collect_exits``, or the pass given), simulated per policy
(``thresholds.simulate_exits``: the loop's decisions, checked equal to ``early_exit`` by the
tests): no policy runs for its statistics. Only the timing runs the loop.

Timing (``repeats >= 1``): the ``exit_outputs`` pass has run every batch shape through the
encoder; then one untimed warm-up call per configuration on the first batch (the loop's own
first-call costs), then ``repeats`` rounds; each round times the full forward and every policy
over all batches, in alternating order, so machine noise hits them alike. Times and
throughput exclude the warm-up. The wall-clock speed-up is the median over rounds of the
per-round ratio. ``repeats=0``: no timing (those columns are empty). ``torch.set_num_threads``
is left as it is. ``time_together`` times several models (precisions, backends) in the same
rounds, so that their times compare with each other too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..early_exit.policies import ExitPolicy
from ..early_exit.thresholds import ExitLogits, collect_exits, simulate_exits

__all__ = ["Batch", "Run", "policy_rows", "sweep", "time_together"]

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


def _row(**values: Any) -> dict[str, Any]:
    row = dict.fromkeys(("full_ms", "early_ms", "wall_speedup", "fraction_of_ideal"))
    row.update(values)
    return row


def policy_rows(
    exit_logits: ExitLogits,
    targets: Tensor,
    policies: Sequence[ExitPolicy],
    batch_size: int,
    dtype: str = "fp32",
) -> list[dict[str, Any]]:
    """Sweep-table rows without timing, from one pass: the full model (``policy="none"``)
    first, then one per policy (``threshold``: its ``value``)."""
    num_layers = exit_logits[-1][0]
    final = exit_logits[-1][1].argmax(dim=-1)
    examples = int(targets.numel())

    def share(layers: Tensor) -> dict[int, float]:
        return {
            int(k): float(n) / examples for k, n in zip(*torch.unique(layers, return_counts=True))
        }

    common = {"batch_size": batch_size, "dtype": dtype, "examples": examples}
    rows = [
        _row(
            **common, policy="none", threshold=None,
            accuracy=100.0 * float(final.eq(targets).double().mean()), agreement=100.0,
            mean_exit_layer=float(num_layers), layer_speedup=1.0,
            exit_share={num_layers: 1.0},
        )
    ]  # fmt: skip
    for policy in policies:
        layers, preds = simulate_exits(exit_logits, policy)
        mean_layer = float(layers.double().mean())
        rows.append(
            _row(
                **common, policy=policy.kind, threshold=policy.value,
                accuracy=100.0 * float(preds.eq(targets).double().mean()),
                agreement=100.0 * float(preds.eq(final).double().mean()),
                mean_exit_layer=mean_layer, layer_speedup=num_layers / mean_layer,
                exit_share=share(layers),
            )
        )  # fmt: skip
    return rows


def sweep(
    model: Any,
    batches: Sequence[Batch],
    policies: Sequence[ExitPolicy],
    head: str = "sentence_classification_head",  # fairseq's default head name
    repeats: int = 3,
    batch_size: int | None = None,
    progress: Callable[[str], None] | None = None,
    exits: tuple[ExitLogits, Tensor] | None = None,
    dtype: str = "fp32",
) -> list[dict[str, Any]]:
    """Accuracy, exit layers and speed of ``early_exit`` for every policy, on ``batches``.

    Args:
        model: a ``MultiExitRobertaModel`` (or anything with ``num_layers``, ``early_exit``,
            ``exit_outputs`` and ``__call__(tokens, classification_head_name=...)``), in eval
            mode, at precision ``dtype`` (the rows' label).
        batches: ``(src_tokens, target)`` pairs on the model's device.
        policies: one table row each.
        repeats: timed rounds (0: no timing).
        batch_size: label of the rows (default: the size of the first batch).
        progress: called with one line per timed round.
        exits: ``collect_exits(model, batches, head)`` when already computed.
    Returns:
        one dict per row (keys ``table.COLUMNS``): the full model (``policy="none"``), then one
        per policy in the given order. ``accuracy`` and ``agreement`` in percent, ``full_ms``
        / ``early_ms`` median milliseconds per example (None without timing).
    """
    if repeats < 0:
        raise ValueError(f"--repeats must be >= 0, got {repeats}")
    batch_size = batch_size or int(batches[0][0].size(0))
    start = time.perf_counter()
    exit_logits, targets = exits if exits is not None else collect_exits(model, batches, head)
    rows = policy_rows(exit_logits, targets, policies, batch_size, dtype)
    if repeats == 0:
        return rows

    time_together(
        [(model, policies, rows)],
        batches,
        head,
        repeats,
        progress,
        label=f"{dtype}, batch {batch_size}",
        start=start,
    )
    return rows


Run = tuple[Any, Sequence[ExitPolicy], list[dict[str, Any]]]
"""``(model, policies, rows)``: a model, its policies, and its ``policy_rows`` on the batches
(the full model's row first, then one per policy) whose timing columns are filled."""


def time_together(
    runs: Sequence[Run],
    batches: Sequence[Batch],
    head: str = "sentence_classification_head",
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    label: str = "",
    start: float | None = None,
) -> None:
    """Times every run's full forward and each of its policies on ``batches`` in the same
    rounds, alternating their order, and fills the rows' ``full_ms``, ``early_ms``,
    ``wall_speedup`` and ``fraction_of_ideal``: so that runs at several precisions or on
    several backends compare with each other, not only with their own full depth."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 to time, got {repeats}")
    start = time.perf_counter() if start is None else start
    device = batches[0][0].device
    examples = sum(int(t.size(0)) for t, _ in batches)

    def full(model: Any, part: Sequence[Batch]) -> Callable[[], Any]:
        return lambda: [model(t, classification_head_name=head)[0].argmax(-1) for t, _ in part]

    def early(model: Any, policy: ExitPolicy, part: Sequence[Batch]) -> Callable[[], Any]:
        return lambda: [model.early_exit(t, policy, classification_head_name=head) for t, _ in part]

    def jobs(part: Sequence[Batch]) -> list[Callable[[], Any]]:
        return [
            job
            for model, policies, _ in runs
            for job in [full(model, part)] + [early(model, p, part) for p in policies]
        ]

    with torch.no_grad():
        for job in jobs(batches[:1]):
            job()  # warm-up, not timed
        timed = jobs(batches)
        times: list[list[float]] = [[] for _ in timed]
        for round_idx in range(repeats):
            order = range(len(timed)) if round_idx % 2 == 0 else reversed(range(len(timed)))
            for j in order:
                times[j].append(_timed(timed[j], device))
            if progress is not None:
                progress(
                    f"{label}: timed round {round_idx + 1}/{repeats} "
                    f"[{time.perf_counter() - start:.0f} s]"
                )

    def per_example_ms(seconds: list[float]) -> float:
        return 1000.0 * statistics.median(seconds) / examples

    per_job = iter(times)  # the jobs' order: each run's full forward, then its policies
    for _, policies, rows in runs:
        own = [next(per_job) for _ in range(1 + len(policies))]
        full_ms = per_example_ms(own[0])
        rows[0].update(full_ms=full_ms, early_ms=full_ms, wall_speedup=1.0, fraction_of_ideal=1.0)
        for row, t in zip(rows[1:], own[1:]):
            wall = statistics.median(f / e for f, e in zip(own[0], t))
            row.update(
                full_ms=full_ms,
                early_ms=per_example_ms(t),
                wall_speedup=wall,
                fraction_of_ideal=wall / row["layer_speedup"],
            )
