"""Paired tests of two methods (no fairseq import): over seeds, over examples, and a
correction for the number of tests.

:func:`seed_t_test` (over seeds: the spread between trainings), :func:`mcnemar` and
:func:`paired_bootstrap` (over examples, pooled over seeds), :func:`holm`, and
:func:`verdict`: better / worse only when every corrected test is below ``ALPHA``, else "no
verdict" (not "no difference": a test that does not survive rules nothing out by itself).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "ALPHA",
    "NO_VERDICT",
    "BootstrapResult",
    "McNemarResult",
    "holm",
    "mcnemar",
    "paired_bootstrap",
    "seed_t_test",
    "verdict",
]

ALPHA = 0.05  # the level a corrected p-value must be below for a verdict
NO_VERDICT = "no verdict"  # the label of a difference that is not a verdict


def seed_t_test(differences: Sequence[float]) -> float:
    """Two-sided p-value of the paired t-test (a one-sample test of ``differences`` against
    0); NaN for fewer than two values or no spread (undefined)."""
    if len(differences) < 2 or statistics.stdev(differences) == 0:
        return math.nan
    from scipy import stats

    return float(stats.ttest_1samp(list(differences), 0.0).pvalue)


class McNemarResult(NamedTuple):
    ours_only: int  # examples (pooled over seeds) ours gets right and the baseline wrong
    theirs_only: int  # the reverse
    p_value: float  # exact two-sided binomial test of ours_only vs theirs_only (1.0 if none)


def mcnemar(ours: Sequence[Sequence[bool]], theirs: Sequence[Sequence[bool]]) -> McNemarResult:
    """Exact McNemar test over examples, discordant pairs pooled over seeds; ``ours``,
    ``theirs``: S x N, whether each prediction is right (seed s paired with seed s)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} seeds against {len(theirs)}")
    b = c = 0
    for mine, other in zip(ours, theirs):
        if len(mine) != len(other):
            raise ValueError(f"{len(mine)} examples against {len(other)}")
        b += sum(m and not o for m, o in zip(mine, other))
        c += sum(o and not m for m, o in zip(mine, other))
    if b + c == 0:
        return McNemarResult(0, 0, 1.0)
    from scipy import stats

    p = stats.binomtest(b, b + c, 0.5, alternative="two-sided").pvalue
    return McNemarResult(b, c, float(min(1.0, p)))


class BootstrapResult(NamedTuple):
    difference: float  # mean over seeds of ours' accuracy minus theirs' (points)
    low: float  # 95% percentile interval of the difference
    high: float
    p_value: float  # two-sided, from the resamples shifted to a null difference of 0


def paired_bootstrap(
    ours: Sequence[Sequence[bool]],
    theirs: Sequence[Sequence[bool]],
    resamples: int = 10000,
    seed: int = 0,
) -> BootstrapResult:
    """Paired bootstrap over examples (one resample for every seed) of the seed-mean accuracy
    difference; p: the two-sided shifted-null percentile test. ``seed`` fixes the draws."""
    a = np.asarray(ours, dtype=np.float64)
    b = np.asarray(theirs, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"expected two S x N arrays of the same shape, got {a.shape}, {b.shape}")
    per_example = (a - b).mean(axis=0)  # N: mean over seeds of (right - right)
    n = per_example.size
    observed = 100.0 * float(per_example.mean())
    rng = np.random.default_rng(seed)
    draws = np.empty(resamples)
    for start in range(0, resamples, 1000):  # chunks keep the index matrix small
        count = min(1000, resamples - start)
        idx = rng.integers(0, n, size=(count, n))
        draws[start : start + count] = 100.0 * per_example[idx].mean(axis=1)
    low, high = np.percentile(draws, [2.5, 97.5])
    centred = draws - observed
    p = float(np.mean(np.abs(centred) >= abs(observed) - 1e-12))
    return BootstrapResult(observed, float(low), float(high), min(1.0, p))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values of one family, in the input order; NaN entries stay NaN and do
    not count as tests."""
    order = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    m = len(order)
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def verdict(mean_difference: float, corrected: Sequence[float], alpha: float = ALPHA) -> str:
    """``better`` / ``worse`` (the sign of ``mean_difference``) when every p-value of
    ``corrected`` is below ``alpha`` (NaN is not; none gives no verdict), else ``NO_VERDICT``:
    the data did not decide, which is not a finding of no difference."""
    significant = bool(corrected) and all(p < alpha for p in corrected)
    if not significant or mean_difference == 0:
        return NO_VERDICT
    return "better" if mean_difference > 0 else "worse"
