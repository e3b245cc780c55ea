"""A child command's output (stdout and stderr together) streamed line by line into its log
file, each line handed on as it comes: how the tools show fairseq's progress while it runs."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["stream_to_log"]


def stream_to_log(
    cmd: Sequence[str],
    log_file: str | Path,
    on_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Runs ``cmd``, writing its output to ``log_file`` line by line (flushed) and passing each
    line to ``on_line``; returns its exit status. ``env`` (default: this process's) gets
    ``PYTHONUNBUFFERED=1``, so a Python child's lines arrive as it writes them. The child is
    killed when the caller is interrupted (or ``on_line`` raises)."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    with open(log_file, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            list(cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if on_line is not None:
                    on_line(line)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return proc.wait()
