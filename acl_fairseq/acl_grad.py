"""ACL-Grad as one unit (being assembled): the angle log's format, its writer and its reader.

The angle log (``--acl-grad-log FILE``) has one line per decision, tab-separated:
``update``, ``angle`` (degrees, between the CE and contrastive gradients), ``kept`` (0/1) and
``head_angle`` (degrees, the same angle on the classification heads' parameters alone).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

__all__ = ["AngleRecord", "append_angle_record", "read_angle_log"]


class AngleRecord(NamedTuple):
    """One ACL-Grad decision, as one line of the angle log."""

    update: int
    angle: float
    kept: bool
    head_angle: float

    def to_line(self) -> str:
        return f"{self.update}\t{self.angle:.4f}\t{int(self.kept)}\t{self.head_angle:.4f}\n"

    @classmethod
    def from_line(cls, line: str) -> AngleRecord:
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 3:
            raise ValueError(f"not an ACL-Grad angle-log line: {line!r}")
        head = float(parts[3]) if len(parts) > 3 else float("nan")
        return cls(int(parts[0]), float(parts[1]), bool(int(parts[2])), head)


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
