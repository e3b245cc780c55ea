"""The table of a few-shot study: per size, each method's mean test accuracy; per pair of
methods the per-draw differences, the t-test over draws, McNemar and a paired bootstrap over
examples, Holm-corrected over every row, and a verdict only when both corrected p-values are
below ``ALPHA`` (``experiment.paired_tests``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .fewshot import METHODS, NAMES, DrawResult
from .mean_std import fmt_mean_std
from .paired_tests import (
    ALPHA,
    NO_VERDICT,
    holm,
    mcnemar,
    paired_bootstrap,
    seed_t_test,
    verdict,
)

__all__ = ["comparison_rows", "report"]


def _pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """(method, baseline): every method against the first, the later ones pairwise too."""
    pairs = [(m, methods[0]) for m in methods[1:]]
    pairs += [(a, b) for i, b in enumerate(methods[1:], 1) for a in methods[i + 1 :]]
    return pairs


def _methods(results: Sequence[DrawResult]) -> list[str]:
    present = {r.method for r in results}
    return [m for m in METHODS if m in present] + sorted(present - set(METHODS))


def _nan_to_none(value: float) -> float | None:
    return None if math.isnan(value) else value


def comparison_rows(results: Sequence[DrawResult]) -> list[dict[str, Any]]:
    """One row per size and pair of methods with draws in common (see the module doc); NaN
    (a test that could not be made) as None, so the rows are plain JSON."""
    by = {(r.per_class, r.draw, r.method): r for r in results}
    methods = _methods(results)
    rows: list[dict[str, Any]] = []
    for k in sorted({r.per_class for r in results}):
        draws = sorted({r.draw for r in results if r.per_class == k})
        for ours, theirs in _pairs(methods):
            paired = [d for d in draws if (k, d, ours) in by and (k, d, theirs) in by]
            if not paired:
                continue
            diffs = [by[k, d, ours].test - by[k, d, theirs].test for d in paired]
            row: dict[str, Any] = {
                "per_class": k, "method": ours, "baseline": theirs, "draws": paired,
                "per_draw_difference": diffs, "mean_difference": statistics.fmean(diffs),
                "std": statistics.stdev(diffs) if len(diffs) > 1 else math.nan,
                "paired_t_p": seed_t_test(diffs),
            }  # fmt: skip
            a = [by[k, d, ours].test_correct for d in paired]
            b = [by[k, d, theirs].test_correct for d in paired]
            examples = [(x, y) for x, y in zip(a, b) if x and y and len(x) == len(y)]
            row.update(example_draws=len(examples), ours_only=None, theirs_only=None)
            row.update(mcnemar_p=math.nan, bootstrap_low=None, bootstrap_high=None)
            row["bootstrap_p"] = math.nan
            if examples:
                test = mcnemar([x for x, _ in examples], [y for _, y in examples])
                boot = paired_bootstrap([x for x, _ in examples], [y for _, y in examples])
                row.update(ours_only=test.ours_only, theirs_only=test.theirs_only)
                row.update(mcnemar_p=test.p_value, bootstrap_p=boot.p_value)
                row.update(bootstrap_low=boot.low, bootstrap_high=boot.high)
            rows.append(row)
    for test in ("paired_t", "mcnemar"):
        for row, p in zip(rows, holm([r[f"{test}_p"] for r in rows])):
            row[f"{test}_holm"] = p
    for row in rows:  # both tests, corrected: a missing one (NaN) gives no verdict
        corrected = [row["paired_t_holm"], row["mcnemar_holm"]]
        row["verdict"] = verdict(row["mean_difference"], corrected)
    return [{key: _nan_to_none(v) if isinstance(v, float) else v for key, v in row.items()}
            for row in rows]  # fmt: skip


def _p(value: float | None) -> str:
    """Three decimals; under 0.001 two significant digits (1.7e-08, not 0.000)."""
    if value is None:
        return "n/a"
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}"


def _name(method: str) -> str:
    return NAMES.get(method, method)


def report(results: Sequence[DrawResult], test_size: int | None = None) -> str:
    """The Markdown tables of a few-shot study (see the module doc)."""
    methods = _methods(results)
    by = {(r.per_class, r.draw, r.method): r for r in results}
    rows = comparison_rows(results)
    lines = []
    for k in sorted({r.per_class for r in results}):
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
            lines.append(f"| {_name(m)} | {fmt_mean_std([r.test for r in mine], 1)} | {shown} |")
        lines += [
            "",
            "| difference (points) | mean | per draw | p (paired t over draws) | p (Holm) "
            "| right only: ours / theirs | p (McNemar) | p (Holm) | 95% interval (bootstrap) "
            "| verdict |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in (r for r in rows if r["per_class"] == k):
            per_draw = ", ".join(
                f"d{d} {x:+.1f}" for d, x in zip(row["draws"], row["per_draw_difference"])
            )
            examples = interval = "n/a"
            if row["example_draws"]:
                examples = f"{row['ours_only']} / {row['theirs_only']}"
                interval = f"{row['bootstrap_low']:+.1f} to {row['bootstrap_high']:+.1f}"
            lines.append(
                f"| {_name(row['method'])} − {_name(row['baseline'])} | "
                f"{row['mean_difference']:+.1f} | {per_draw} | {_p(row['paired_t_p'])} | "
                f"{_p(row['paired_t_holm'])} | {examples} | {_p(row['mcnemar_p'])} | "
                f"{_p(row['mcnemar_holm'])} | {interval} | {row['verdict']} |"
            )
        lines.append("")
    lines.append(
        "Learning rate chosen per method and draw on the draw's dev split; accuracy in percent "
        "on the test split. Per difference: the paired t-test over draws (n/a below 2 draws or "
        "without spread); the exact McNemar test over the test examples pooled over the draws "
        "(the runs at the chosen learning rates; the examples one gets right and the other "
        "wrong) and a paired bootstrap over the examples (95% interval of the mean difference; "
        "n/a without per-example predictions). Each test is Holm-corrected over every row of "
        f"the tables (one family); a difference is a verdict (better / worse) only when both "
        f"corrected p-values are below {ALPHA:g}, otherwise {NO_VERDICT}, which is not a finding "
        "of no difference: the interval and the p-values say what is and is not ruled out."
    )
    return "\n".join(lines) + "\n"
