"""Wall and CPU time of the demo's steps, the commands they run included, so that a run says
where its time went (CPU time stays comparable on a machine shared with other work)."""

from __future__ import annotations

import resource
import time

__all__ = ["Clock", "cpu_seconds"]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of the commands it ran and waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    commands = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + commands.ru_utime + commands.ru_stime


class Clock:
    """Laps of (label, wall seconds, CPU seconds), each since the previous lap."""

    def __init__(self) -> None:
        self.start = self.mark = (time.time(), cpu_seconds())
        self.laps: list[tuple[str, float, float]] = []

    @staticmethod
    def since(mark: tuple[float, float]) -> tuple[float, float]:
        """(wall, CPU) seconds since ``mark``, a ``(time.time(), cpu_seconds())`` pair."""
        return time.time() - mark[0], cpu_seconds() - mark[1]

    def lap(self, label: str) -> tuple[float, float]:
        """Records and returns the (wall, CPU) seconds since the previous lap."""
        wall, cpu = self.since(self.mark)
        self.mark = (time.time(), cpu_seconds())
        self.laps.append((label, wall, cpu))
        return wall, cpu

    def total(self) -> tuple[float, float]:
        """(wall, CPU) seconds since the clock started."""
        return self.since(self.start)

    def summary(self) -> str:
        """``time per step, wall / CPU seconds: 1 fetch 9 / 4, 2 convert 2 / 2, ...``."""
        laps = ", ".join(f"{label} {wall:.0f} / {cpu:.0f}" for label, wall, cpu in self.laps)
        return f"time per step, wall / CPU seconds (its commands included): {laps}"
