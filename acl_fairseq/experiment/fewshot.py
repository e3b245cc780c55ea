"""The few-shot protocol of the study (docs/results.md, second round: few-shot with a dev split
of its own), as functions of the library: ``acl-fairseq-fewshot`` runs it on any labelled TSV,
``python -m studies`` on the movie sentences.

For each size k (examples per class) and draw d: k examples per class drawn from the pool for
training and k per class from the rest of the pool for dev (``data.splits.fewshot_train_dev``,
seeded by d); every method (CE, CE+SCL, ACL) trains the same number of updates (``UPDATES``),
validated every ``VALIDATE_EVERY`` updates, with the draw's number as its seed, once per
learning rate of the grid (``LEARNING_RATES``); per method and draw the learning rate with the
best dev accuracy is chosen (:func:`choose_lr`) and its checkpoint (best on dev) is reported on
the test split. :func:`report` makes the table: the mean test accuracy per method, the
per-draw differences to the baseline and between the contrastive methods, and the paired
t-test over draws of each difference, Holm-corrected over the table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .mean_std import fmt_mean_std
from .paired_tests import holm, seed_t_test

__all__ = [
    "LEARNING_RATES",
    "METHODS",
    "DrawResult",
    "choose_lr",
    "compare_args",
    "draw_name",
    "report",
]

METHODS = ("ce", "ce_scl", "acl")
NAMES = {"ce": "CE", "ce_scl": "CE+SCL", "acl": "ACL"}
LEARNING_RATES = (1e-4, 2e-4, 5e-4)
UPDATES = 60
VALIDATE_EVERY = 5
CONTRASTIVE_LAMBDA = 0.5
TEMPERATURE = 0.3
BATCH_SIZE = 32
# batches of similar length (the study's batching), and no validation (so no checkpoint) at
# epoch ends: only every VALIDATE_EVERY updates
PROTOCOL_EXTRA = "--group-by-length --validate-interval 1000 --save-interval 1000"


def draw_name(per_class: int, draw: int) -> str:
    """The name of a draw's data folder and runs (``k16-d3``)."""
    return f"k{per_class}-d{draw}"


def compare_args(
    data: str | Path,
    out: str | Path,
    draw: int,
    lr: float,
    methods: Sequence[str] = METHODS,
    updates: int = UPDATES,
    validate_every: int = VALIDATE_EVERY,
    batch_size: int = BATCH_SIZE,
    lam: float = CONTRASTIVE_LAMBDA,
    temperature: float = TEMPERATURE,
    model: Sequence[str] = (),
    extra: str = "",
) -> list[str]:
    """The ``acl-fairseq-compare`` arguments of one learning rate of one draw: every method,
    the draw's number as seed, ``updates`` updates (as many epochs as that takes), validation
    and the best checkpoint every ``validate_every`` updates, CE+SCL without the angle
    measurement, batches of similar length. ``model``: the model flags (``--restore-file``,
    ``--arch-args-file`` ...); ``extra``: more fairseq-train flags."""
    return [
        str(data), "--out", str(out), "--methods", ",".join(methods), "--seeds", str(draw),
        "--lr", f"{lr:g}", "--max-update", str(updates),
        "--validate-interval-updates", str(validate_every), "--batch-size", str(batch_size),
        "--contrastive-lambda", f"{lam:g}", "--temperature", f"{temperature:g}",
        "--ce-scl-plain", "--extra", f"{PROTOCOL_EXTRA} {extra}".strip(), *model,
    ]  # fmt: skip


def choose_lr(dev_by_lr: dict[float, float]) -> float:
    """The learning rate with the best dev accuracy; among ties the first in grid order."""
    rates = list(dev_by_lr)
    return max(rates, key=lambda lr: (dev_by_lr[lr], -rates.index(lr)))


@dataclass(frozen=True)
class DrawResult:
    """One method on one draw, at the learning rate chosen on dev."""

    per_class: int
    draw: int
    method: str
    dev_by_lr: dict[float, float] = field(compare=False)  # dev accuracy at each rate
    test_by_lr: dict[float, float] = field(compare=False)  # test accuracy at each rate

    @property
    def lr(self) -> float:
        return choose_lr(self.dev_by_lr)

    @property
    def dev(self) -> float:
        return self.dev_by_lr[self.lr]

    @property
    def test(self) -> float:
        return self.test_by_lr[self.lr]


def _comparisons(methods: Sequence[str]) -> list[tuple[str, str]]:
    """(method, baseline): every method against the first, the later ones pairwise too."""
    pairs = [(m, methods[0]) for m in methods[1:]]
    pairs += [(a, b) for i, b in enumerate(methods[1:], 1) for a in methods[i + 1 :]]
    return pairs


def _p(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def report(results: Sequence[DrawResult], test_size: int | None = None) -> str:
    """The Markdown table of a few-shot study: per size, the mean test accuracy of each
    method and its chosen learning rates, then each difference per draw with its paired
    t-test over draws (p-values Holm-corrected over every difference of every size)."""
    sizes = sorted({r.per_class for r in results})
    present = {r.method for r in results}
    methods = [m for m in METHODS if m in present] + sorted(present - set(METHODS))
    by = {(r.per_class, r.draw, r.method): r for r in results}
    rows, p_values = [], []
    for k in sizes:
        draws = sorted({r.draw for r in results if r.per_class == k})
        for ours, theirs in _comparisons(methods):
            paired = [d for d in draws if (k, d, ours) in by and (k, d, theirs) in by]
            diffs = [by[k, d, ours].test - by[k, d, theirs].test for d in paired]
            if diffs:
                rows.append((k, ours, theirs, paired, diffs))
                p_values.append(seed_t_test(diffs))
    adjusted = holm(p_values)
    lines = []
    for k in sizes:
        draws = sorted({r.draw for r in results if r.per_class == k})
        held = f", test {test_size}" if test_size else ""
        lines += [
            f"### {k} examples per class ({len(draws)} draws; dev of the same size{held})",
            "",
            "| method | test accuracy (mean ± std over draws) | per draw: test (lr on dev) |",
            "|---|---|---|",
        ]
        for m in methods:
            mine = [by[k, d, m] for d in draws if (k, d, m) in by]
            if not mine:
                continue
            shown = ", ".join(f"d{r.draw} {r.test:.1f} ({r.lr:g})" for r in mine)
            mean = fmt_mean_std([r.test for r in mine], 1)
            lines.append(f"| {NAMES.get(m, m)} | {mean} | {shown} |")
        lines += [
            "",
            "| difference (points) | mean | per draw | p (paired t over draws) | p (Holm) |",
            "|---|---|---|---|---|",
        ]
        for (size, ours, theirs, paired, diffs), p, p_holm in zip(rows, p_values, adjusted):
            if size != k:
                continue
            per_draw = ", ".join(f"d{d} {x:+.1f}" for d, x in zip(paired, diffs))
            lines.append(
                f"| {NAMES.get(ours, ours)} − {NAMES.get(theirs, theirs)} | "
                f"{statistics.fmean(diffs):+.1f} | {per_draw} | {_p(p)} | {_p(p_holm)} |"
            )
        lines.append("")
    lines.append(
        "Learning rate chosen per method and draw on the draw's dev split; accuracy in percent "
        "on the test split. Paired t-tests over draws (n/a below 2 draws or without spread), "
        "Holm-corrected over every row of the tables."
    )
    return "\n".join(lines) + "\n"
