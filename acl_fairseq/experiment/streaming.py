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
    """Runs ``cmd`` (``PYTHONUNBUFFERED=1``), each output line written to ``log_file`` and
    passed to ``on_line``; its exit status. The child is killed if the caller is interrupted."""
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
