"""The ACL-Grad angle log (``--acl-grad-log FILE``): its one reader and writer.

One line per decision, tab-separated: ``update``, ``angle`` (degrees, between the CE and
contrastive gradients), ``kept`` (0/1), ``head_angle`` (degrees, the same angle on the
classification heads' parameters alone), then, with ``--acl-grad-log-top-k``, one ``K:angle``
column per K (the same angle on the heads plus the top K encoder layers). Files of older
versions (3 or 4 columns) still read: a missing ``head_angle`` is nan, missing ``K:angle``
columns an empty ``top_angles``.
"""

from pathlib import Path
from typing import NamedTuple

__all__ = ["AngleRecord", "append_angle_record", "read_angle_log"]


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
            raise ValueError(f"not an ACL-Grad angle-log line: {line!r}")
        head = float(parts[3]) if len(parts) > 3 else float("nan")
        top = []
        for part in parts[4:]:
            k, sep, angle = part.partition(":")
            if not sep or not k.isdigit():
                raise ValueError(f"not a 'K:angle' column of an ACL-Grad angle log: {line!r}")
            top.append((int(k), float(angle)))
        return cls(int(parts[0]), float(parts[1]), bool(int(parts[2])), head, tuple(top))


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
