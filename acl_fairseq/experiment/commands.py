"""The one way the tools and the studies start a child command (fairseq-train, a tool, a
sweep): ``run`` (as ``subprocess.run``) and ``stream_to_log`` (its output streamed line by line
into a log file, each line handed on as it comes: how the tools show fairseq's progress).

Both pass the command line through ``launcher`` first: None (the default) runs it as given.
The tests point it at their fork server (``tests/fork_server.py``, one ``set_launcher`` call),
which runs the same command in its own process without importing torch and fairseq again.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Launcher", "command", "run", "set_launcher", "stream_to_log"]

Launcher = Callable[[Sequence[str]], list[str]]
"""A command line -> the command line to start (e.g. the same command, served)."""

_launcher: Launcher | None = None


def set_launcher(launcher: Launcher | None) -> Launcher | None:
    """Starts every later child command through ``launcher`` (None: as given); returns the
    previous one."""
    global _launcher
    previous, _launcher = _launcher, launcher
    return previous


def command(cmd: Sequence[str]) -> list[str]:
    """The command line that starts ``cmd``: through the launcher, if one is set."""
    return list(_launcher(cmd)) if _launcher is not None else list(cmd)


def run(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` of ``cmd`` (through the launcher), with ``subprocess.run``'s
    keyword arguments."""
    return subprocess.run(command(cmd), **kwargs)


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
            command(cmd),
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
