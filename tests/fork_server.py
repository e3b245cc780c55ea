"""A process that imports fairseq once and forks a child per ``fairseq-train`` or
``fairseq-validate`` command of the tests (``ForkServer``: ``fairseq_helpers.run`` and the
tools' ``stream_to_log``, see conftest.py).

Each command still runs in its own process, with its own argv, environment, working folder,
exit code and output; only the import of torch and fairseq (most of a tiny run's CPU time) is
shared. The plugin is imported by the child, from its ``--user-dir``, as the console command
would. What a fresh process would read from the environment at import time (torch's and
fairseq's own settings) comes from the server's start instead; ``OMP_NUM_THREADS`` is applied.
Off with ``ACL_TEST_FORK_SERVER=0``: every command a fresh process.

Protocol: one JSON request per line on stdin (``{"argv": [...], "output": PATH, "env": {...},
"cwd": DIR}``); the server answers ``{"pid": N}`` when the child starts and ``{"rc": N}`` when
it ends. EOF on stdin stops it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# validate first: it imports fairseq before its logging set-up, train after (see ``main``)
ENTRY_POINTS = {"fairseq-validate": "fairseq_cli.validate", "fairseq-train": "fairseq_cli.train"}
LOGGING: dict[str, tuple[int, list[logging.Handler]]] = {}


def run_child(argv: list[str], output: str, env: dict[str, str], cwd: str) -> int:
    """In the forked child: ``argv`` as its console command would run it, in ``env`` and
    ``cwd``; returns the exit code (an uncaught exception goes to ``sys.excepthook`` and
    gives 1, as Python does)."""
    import importlib

    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    logging.root.level, logging.root.handlers = LOGGING[Path(argv[0]).name]
    sys.argv = list(argv)
    module = importlib.import_module(ENTRY_POINTS[Path(argv[0]).name])
    try:
        module.cli_main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the plugin's hook prints its errors as one line
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def main() -> None:
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    for name, module in ENTRY_POINTS.items():  # each with the root logger its import sets up
        logging.root.handlers = []
        logging.root.setLevel(logging.WARNING)
        __import__(module)
        LOGGING[name] = (logging.root.level, list(logging.root.handlers))
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            code = 1
            try:
                code = run_child(request["argv"], request["output"], request["env"], request["cwd"])
            finally:
                os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


class ForkServer:
    """The client: this process's server, started on first use, stopped at exit."""

    _proc: subprocess.Popen | None = None

    @staticmethod
    def serves(cmd: Sequence[str]) -> bool:
        """Whether ``cmd`` is this environment's fairseq-train or fairseq-validate (and the
        server is not turned off)."""
        return (
            os.environ.get("ACL_TEST_FORK_SERVER", "1") != "0"
            and Path(cmd[0]).parent == Path(sys.executable).parent
            and Path(cmd[0]).name in ENTRY_POINTS
        )

    @classmethod
    def start(cls, cmd: Sequence[str], env: Mapping[str, str], cwd: Path, output: str) -> int:
        """Starts ``cmd`` with its output to the file (or FIFO) ``output``; its pid."""
        if cls._proc is None or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen(
                [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(cwd),
            )  # fmt: skip
            atexit.register(cls.stop)
        request = {"argv": [str(a) for a in cmd], "output": output, "env": dict(env),
                   "cwd": str(cwd)}  # fmt: skip
        cls._proc.stdin.write(json.dumps(request) + "\n")
        cls._proc.stdin.flush()
        return json.loads(cls._proc.stdout.readline())["pid"]

    @classmethod
    def wait(cls, pid: int, timeout: float | None = None) -> int:
        """The exit code of the command started as ``pid``; killed after ``timeout``
        seconds (then ``subprocess.TimeoutExpired``)."""
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            os.kill(pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill) if timeout else None
        if timer is not None:
            timer.start()
        try:
            code = json.loads(cls._proc.stdout.readline())["rc"]
        finally:
            if timer is not None:
                timer.cancel()
        if fired.is_set():
            raise subprocess.TimeoutExpired(str(pid), timeout)
        return code

    @classmethod
    def run(
        cls, cmd: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float
    ) -> tuple[int, str]:
        """``cmd`` to the end: its exit code and output."""
        with tempfile.NamedTemporaryFile("r", suffix=".log") as output:
            pid = cls.start(cmd, env, cwd, output.name)
            return cls.wait(pid, timeout), output.read()

    @classmethod
    def stream(
        cls, cmd: Sequence[str], env: Mapping[str, str], on_line: Callable[[str], None]
    ) -> int:
        """``cmd`` in this working folder, each output line to ``on_line`` as it comes; its
        exit code (the command is killed if the caller is interrupted)."""
        with tempfile.TemporaryDirectory() as folder:
            fifo = os.path.join(folder, "output")
            os.mkfifo(fifo)
            pid = cls.start(cmd, env, Path.cwd(), fifo)
            try:
                with open(fifo, encoding="utf-8", errors="replace") as lines:
                    for line in lines:
                        on_line(line)
            except BaseException:
                os.kill(pid, signal.SIGKILL)
                cls.wait(pid)
                raise
            return cls.wait(pid)

    @classmethod
    def stop(cls) -> None:
        if cls._proc is not None and cls._proc.poll() is None:
            cls._proc.stdin.close()
            cls._proc.wait()


def served_stream_to_log(
    cmd: Sequence[str],
    log_file: str | Path,
    on_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """``acl_fairseq.experiment.streaming.stream_to_log`` with fairseq-train and
    fairseq-validate served by the ``ForkServer``: the same log file, lines and exit code."""
    from acl_fairseq.experiment import streaming

    if not ForkServer.serves(cmd):
        return streaming.stream_to_log(cmd, log_file, on_line, env)
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    with open(log_file, "w", encoding="utf-8") as log:

        def write(line: str) -> None:
            log.write(line)
            log.flush()
            if on_line is not None:
                on_line(line)

        return ForkServer.stream(cmd, env, write)


IN_PROCESS = {"acl_fairseq.cli.compare": "acl_fairseq.cli.compare.cli",
              "acl_fairseq.cli.sweep": "acl_fairseq.cli.sweep.cli"}  # fmt: skip


def run_in_process(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` for the tools that run ``python -m acl_fairseq.cli.compare`` (or
    ``.sweep``): that command's ``main(argv)`` in this process, whose training commands the
    ``ForkServer`` serves; any other command as a subprocess."""
    import importlib

    cmd = [str(c) for c in cmd]
    if cmd[:2] != [sys.executable, "-m"] or cmd[2] not in IN_PROCESS or set(kwargs) - {"check"}:
        return subprocess.run(cmd, **kwargs)
    try:
        code = importlib.import_module(IN_PROCESS[cmd[2]]).main(cmd[3:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else 1
    code = code or 0
    if code and kwargs.get("check"):
        raise subprocess.CalledProcessError(code, cmd)
    return subprocess.CompletedProcess(cmd, code)


def serve_tools(monkeypatch) -> None:
    """Routes the tools' training commands (``stream_to_log`` in acl-fairseq-compare and
    acl-fairseq-demo) through the ``ForkServer``, and runs the compare and sweep commands of
    acl-fairseq-fewshot and the studies in this process (``run_in_process``)."""
    import types

    import studies.phases
    import studies.round2
    from acl_fairseq.cli.compare import run
    from acl_fairseq.cli.demo import cli
    from acl_fairseq.cli.fewshot import cli as fewshot

    for module in (run, cli):
        monkeypatch.setattr(module, "stream_to_log", served_stream_to_log)
    served = types.SimpleNamespace(run=run_in_process)
    for module in (fewshot, studies.phases, studies.round2):
        monkeypatch.setattr(module, "subprocess", served)


if __name__ == "__main__":
    main()
