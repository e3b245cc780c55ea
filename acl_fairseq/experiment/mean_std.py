"""Mean and sample standard deviation over seeds or draws: the numbers, the half-height of an
error bar, and the one text form of a table cell (``82.00 ± 2.00``), shared by the compare
report, the few-shot table, the plots and the study."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["error_bar", "fmt", "fmt_mean_std", "summarize"]


def summarize(values: Sequence[float]) -> tuple[float, float, int]:
    """``(mean, sample std, n)``; the std is nan for fewer than two values, both for none."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else math.nan
    return mean, std, n


def error_bar(std: float) -> float:
    """The half-height of an error bar: ``std``, or 0 where it is nan (a single value)."""
    return 0.0 if math.isnan(std) else std


def fmt(value: float | None, digits: int = 2) -> str:
    """``value`` with ``digits`` decimals; ``-`` for None or nan."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def fmt_mean_std(values: Sequence[float], digits: int = 2) -> str:
    """``mean ± std`` of ``values`` with ``digits`` decimals; the value alone for one, ``-``
    for none."""
    mean, std, n = summarize(values)
    if n == 0:
        return "-"
    return fmt(mean, digits) if n == 1 else f"{fmt(mean, digits)} ± {fmt(std, digits)}"
