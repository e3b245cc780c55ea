"""The one seam the tools start child commands through (``experiment.commands``): a child's
output streamed into its log line by line, the launcher, and the progress lines of
fairseq-train the tools show from it (``fairseq_log.progress_kind``)."""

from __future__ import annotations

import os
import sys

import pytest

from acl_fairseq.experiment import commands
from acl_fairseq.experiment.commands import stream_to_log
from acl_fairseq.experiment.fairseq_log import progress_kind

CHILD = """
import os, sys, time
print("first")  # no flush: it arrives as written only when the child is unbuffered
for _ in range(300):
    if os.path.exists(sys.argv[1]):
        break
    time.sleep(0.1)
print("acked" if os.path.exists(sys.argv[1]) else "not acked")
print("to stderr", file=sys.stderr)
print("X =", os.environ.get("X"))
sys.exit(3)
"""


def test_lines_arrive_as_written_into_the_log_and_the_callback(tmp_path):
    ack, log = tmp_path / "ack", tmp_path / "child.log"
    seen = []

    def on_line(line: str) -> None:
        seen.append(line)
        if line == "first\n":
            ack.touch()  # the child waits for this before it writes on

    code = stream_to_log([sys.executable, "-c", CHILD, str(ack)], log, on_line, env={"X": "1"})
    assert code == 3
    assert seen == ["first\n", "acked\n", "to stderr\n", "X = 1\n"]
    assert log.read_text(encoding="utf-8") == "".join(seen)


def test_the_child_is_killed_when_the_caller_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(commands, "_launcher", None)  # the child itself, not a served one
    child = "import os, time\nprint(os.getpid())\ntime.sleep(600)"
    pids = []

    def on_line(line: str) -> None:
        pids.append(int(line))
        raise KeyboardInterrupt  # Ctrl-C while the child runs

    with pytest.raises(KeyboardInterrupt):
        stream_to_log([sys.executable, "-c", child], tmp_path / "log", on_line)
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pids[0], 0)
    assert (tmp_path / "log").read_text() == f"{pids[0]}\n"


def test_the_launcher_rewrites_every_command_and_is_restored(tmp_path, monkeypatch):
    monkeypatch.setattr(commands, "_launcher", None)
    seen = []

    def launcher(cmd):
        seen.append(list(cmd))
        return [sys.executable, "-c", "print('launched')"]

    previous = commands.set_launcher(launcher)
    try:
        out = commands.run(["no-such-program", "x"], capture_output=True, text=True).stdout
        assert out == "launched\n"
        assert stream_to_log(["no-such-program", "y"], tmp_path / "log") == 0
        assert (tmp_path / "log").read_text() == "launched\n"
    finally:
        assert commands.set_launcher(previous) is launcher
    assert seen == [["no-such-program", "x"], ["no-such-program", "y"]]
    assert commands.command(["a", "b"]) == ["a", "b"]  # none set: as given


def test_progress_kind():
    line = '2024-01-01 | INFO | train_inner | {"epoch": 1, "loss": "0.69"}'
    assert progress_kind(line) == "train_inner"
    assert progress_kind('x | INFO | valid | {"valid_accuracy": "50"}') == "valid"
    assert progress_kind("x | INFO | fairseq_cli.train | done training") is None
