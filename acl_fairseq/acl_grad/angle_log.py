"""The ACL-Grad angle log (``--acl-grad-log FILE``): its one reader and writer.

One line per decision, tab-separated: ``update``, ``angle`` (degrees), ``kept`` (0/1),
``head_angle`` (the heads' parameters alone), then one ``K:angle`` column per K of
``--acl-grad-log-top-k``. Older files (3 or 4 columns) still read. :func:`scope_agreement`:
how often the cheap scopes' angles of the same updates decide alike.
"""

import math
import os
import statistics
from pathlib import Path
from typing import NamedTuple

from ..errors import AclFileNotFoundError, AclIsADirectoryError, AclValueError

__all__ = [
    "AngleRecord",
    "ScopeAgreement",
    "append_angle_record",
    "check_log_path",
    "read_angle_log",
    "scope_agreement",
    "scope_angles",
]


class AngleRecord(NamedTuple):
    """One ACL-Grad decision, as one line of the angle log."""

    update: int
    angle: float
    kept: bool
    head_angle: float
    top_angles: tuple[tuple[int, float], ...] = ()  # (K, angle on heads + top K layers)

    def to_line(self) -> str:
        line = f"{self.update}\t{self.angle:.4f}\t{int(self.kept)}\t{self.head_angle:.4f}"
        return line + "".join(f"\t{k}:{a:.4f}" for k, a in self.top_angles) + "\n"

    @classmethod
    def from_line(cls, line: str) -> "AngleRecord":
        """Reads lines of 3 columns (no heads-only angle: nan), 4, or 4 + ``K:angle``."""
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 3:
            raise AclValueError(f"not an ACL-Grad angle-log line: {line!r}")
        head = float(parts[3]) if len(parts) > 3 else float("nan")
        top = []
        for part in parts[4:]:
            k, sep, angle = part.partition(":")
            if not sep or not k.isdigit():
                raise AclValueError(f"not a 'K:angle' column of an ACL-Grad angle log: {line!r}")
            top.append((int(k), float(angle)))
        return cls(int(parts[0]), float(parts[1]), bool(int(parts[2])), head, tuple(top))


def check_log_path(path: str, given: str | None = None, flag: str = "--acl-grad-log") -> None:
    """At set-up, not at the first update: refuses a ``path`` that cannot be appended to,
    naming ``flag`` and ``given`` (the value as passed)."""
    given = given or path
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise AclIsADirectoryError(
            f"{flag} {given} is a folder: give a file for the angle log, e.g. "
            f"{os.path.join(given, 'angles.tsv')}"
        )
    if not os.path.isdir(folder):
        raise AclFileNotFoundError(
            f"{flag} {given}: the folder {folder} does not exist; create it first (mkdir -p "
            f"{folder}) or give a file in an existing folder"
        )
    target = path if os.path.exists(path) else folder
    if not os.access(target, os.W_OK):
        raise AclValueError(
            f"{flag} {given}: {target} is not writable; give a file in a folder you can write to"
        )


def append_angle_record(path: str | Path, record: AngleRecord) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(record.to_line())


def read_angle_log(path: str | Path) -> list[AngleRecord]:
    """Every record of an angle log; an absent file has none."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [AngleRecord.from_line(line) for line in lines if line.strip()]


class ScopeAgreement(NamedTuple):
    """How a cheap scope's decision compares with the exact one at one threshold, over the
    records of one exact-scope log."""

    scope: str  # "head" or "top:K"
    threshold: float  # degrees
    updates: int
    mean_exact: float
    mean_scope: float
    pearson_r: float  # of the exact and the scope angle (nan: < 3 updates or a constant one)
    exact_drops: int
    scope_drops: int
    agree: float  # fraction of updates on which both decide the same


def scope_angles(records: list[AngleRecord]) -> dict[str, list[tuple[float, float]]]:
    """Per cheap scope (``head``, ``top:K``), (exact angle, scope angle) of every record of an
    exact-scope log; a scope is left out when a record lacks its column."""
    if not records or any(math.isnan(r.head_angle) for r in records):
        return {}
    scopes = {"head": [(r.angle, r.head_angle) for r in records]}
    common = set.intersection(*(set(dict(r.top_angles)) for r in records))
    for k in sorted(common):
        scopes[f"top:{k}"] = [(r.angle, dict(r.top_angles)[k]) for r in records]
    return scopes


def scope_agreement(
    records: list[AngleRecord], thresholds: tuple[float, ...] = (60.0, 75.0, 90.0)
) -> list[ScopeAgreement]:
    """One :class:`ScopeAgreement` per scope of :func:`scope_angles` and threshold (a term is
    dropped when its angle exceeds the threshold)."""
    rows = []
    for scope, pairs in scope_angles(records).items():
        exact = [e for e, _ in pairs]
        approx = [a for _, a in pairs]
        r = _pearson(exact, approx)
        for t in thresholds:
            agree = sum((e > t) == (a > t) for e, a in pairs) / len(pairs)
            rows.append(
                ScopeAgreement(
                    scope, t, len(pairs), statistics.fmean(exact), statistics.fmean(approx), r,
                    sum(e > t for e in exact), sum(a > t for a in approx), agree,
                )
            )  # fmt: skip
    return rows


def _pearson(x: list[float], y: list[float]) -> float:
    try:
        return statistics.correlation(x, y) if len(x) > 2 else math.nan
    except statistics.StatisticsError:  # a constant series
        return math.nan
