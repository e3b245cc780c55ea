"""A process that imports torch and fairseq once and forks a child per Python command the tests
run (``ForkServer``), reached through stand-in executables (``shim_client.py``).

``ForkServer.shim()`` is a folder of stand-ins, ``python``, ``fairseq-train``,
``fairseq-validate`` and ``acl-fairseq-NAME``: each is a small client (no torch import) that
sends its arguments, environment, working folder and standard streams to the server, which
forks the command from its warm state; the client forwards SIGINT / SIGTERM / SIGHUP, and ends
with the command's exit code or dies by the signal that killed it. So a command still runs in
its own process, with its own argv, environment, working folder, streams and exit code; only the
import of torch and fairseq (most of a tiny command's CPU time) is shared. ``ForkServer.served``
rewrites a command line to the stand-ins; inside a served command ``sys.executable`` is the
stand-in ``python``, so the commands it starts (``python -m ...``, ``BIN/fairseq-train``) are
served too. What a fresh process would read from the environment at import time (torch's and
fairseq's own settings) comes from the server's start instead; ``OMP_NUM_THREADS``,
``PYTHONPATH``, ``PYTHONUNBUFFERED`` and the client's file-size limit (``ulimit -f``) are
applied. Off with ``ACL_TEST_FORK_SERVER=0``: every command a fresh process.

Protocol (a Unix socket ``server.sock`` in the shim folder): the client sends an 8-byte length
with its fds 0, 1, 2, then a JSON request ``{"name", "args", "env", "cwd", "fsize"}``; the
server forks a handler, which forks the command and answers ``{"pid": N}``, then ``{"rc": N}``
when it ends (negative: the signal that killed it). The handler kills the command if the client
goes away.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
ENTRY_POINTS = {"fairseq-validate": "fairseq_cli.validate", "fairseq-train": "fairseq_cli.train"}
TOOLS = sorted(
    f"acl-fairseq-{p.stem.replace('_', '-')}"
    for p in (HERE.parent / "acl_fairseq" / "cli").iterdir()
    if (p.suffix == ".py" and not p.name.startswith("_")) or (p / "cli.py").is_file()
)
SHIMS = ("python", *ENTRY_POINTS, *TOOLS)
SOCKET = "server.sock"
SYS_PATH: list[str] = []  # the server's sys.path after its script folder


# --------------------------------------------------------------------------- the command


def _python_argv(args: list[str]) -> tuple[str, str, list[str]]:
    """``(mode, target, argv)`` of a ``python ARGS`` command line: mode ``-m``, ``-c`` or
    ``script``; the options before it that do not change what runs (``-u``, ``-B``, ``-E``,
    ``-s``, ``-S``) are dropped."""
    args = list(args)
    while args and args[0] in ("-u", "-B", "-E", "-s", "-S"):
        args.pop(0)
    if not args:
        raise SystemExit("fork server: an interactive python is not served")
    if args[0] in ("-m", "-c"):
        return args[0], args[1], args[2:]
    if args[0].startswith("-"):
        raise SystemExit(f"fork server: python option {args[0]} is not served")
    return "script", args[0], args[1:]


def _run(name: str, args: list[str], env: dict[str, str], cwd: str, shim: str) -> None:
    """In the forked command process: the command as its executable would run it."""
    import importlib
    import runpy

    import torch

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    sys.executable = os.path.join(shim, "python")  # the commands it starts are served
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = ""
    # fairseq's entry points set up logging when imported: imported again, as in a new process
    logging.root.setLevel(logging.WARNING)
    logging.root.handlers = []
    for module in ENTRY_POINTS.values():
        sys.modules.pop(module, None)
        package, _, attr = module.rpartition(".")
        if hasattr(sys.modules[package], attr):
            delattr(sys.modules[package], attr)
    if name in ENTRY_POINTS:
        sys.argv = [os.path.join(shim, name), *args]
        sys.path[:] = [str(BIN), *extra, *SYS_PATH]
        importlib.import_module(ENTRY_POINTS[name]).cli_main()
        return
    if name.startswith("acl-fairseq-"):
        sys.argv = [os.path.join(shim, name), *args]
        sys.path[:] = [str(BIN), *extra, *SYS_PATH]
        module = importlib.import_module(f"acl_fairseq.cli.{name[12:].replace('-', '_')}")
        sys.exit(module.main())
    mode, target, argv = _python_argv(args)
    if mode == "-m":
        first = os.getcwd()
    elif mode == "script":
        first = os.path.dirname(os.path.abspath(target))
    sys.path[:] = [first, *extra, *SYS_PATH]
    if mode == "-c":
        sys.argv = ["-c", *argv]
        code = compile(target, "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    elif mode == "-m":
        sys.argv = [target, *argv]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *argv]
        runpy.run_path(target, run_name="__main__")


def run_command(name: str, args: list[str], env: dict[str, str], cwd: str, shim: str) -> int:
    """``_run`` with Python's ending: the exit code (``SystemExit`` as the interpreter reads
    it; an uncaught exception to ``sys.excepthook``, code 1), then the non-daemon threads,
    ``atexit`` and the streams, as at interpreter exit."""
    import threading

    code = 0
    try:
        _run(name, args, env, cwd, shim)
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
        threading._shutdown()  # type: ignore[attr-defined]  (the interpreter's own step)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


# --------------------------------------------------------------------------- the server


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 8, 3)
    (size,) = struct.unpack("!Q", header)
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("client went away")
        data += chunk
    return json.loads(data), fds


def _handle(conn: socket.socket, shim: str) -> None:
    """In a handler process: one client's command, forked; its pid and exit code to the
    client; the command killed if the client goes away first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = _receive(conn)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the command
        code = 1
        try:
            conn.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts
            if "fsize" in request:  # the client's ulimit -f (a full disk's stand-in)
                resource.setrlimit(resource.RLIMIT_FSIZE, tuple(request["fsize"]))
            code = run_command(request["name"], request["args"], request["env"],
                               request["cwd"], shim)  # fmt: skip
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    try:
        done: list[int] = [os.pidfd_open(pid)]  # readable when the command ends
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): look every 20 ms
        done = []
    while True:
        ready, _, _ = select.select([conn, *done], [], [], None if done else 0.02)
        ended, status = os.waitpid(pid, 0 if set(done) & set(ready) else os.WNOHANG)
        if ended:
            conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            return
        if conn in ready and not conn.recv(1):  # the client is gone: so is its command
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return


def serve(shim: str) -> None:
    """The server: imports torch (with ``torch._dynamo``, which an optimizer's construction
    imports) and fairseq's entry points, then forks a handler per client of
    ``shim/server.sock`` until stdin closes."""
    devnull = os.open(os.devnull, os.O_RDWR)
    stop = os.dup(0)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    SYS_PATH[:] = sys.path[1:]
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first optimizer: seconds)

    for module in ENTRY_POINTS.values():  # what they import (themselves again in each command)
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(shim, SOCKET))
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    while True:
        ready, _, _ = select.select([listener, stop], [], [])
        if stop in ready:
            return
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            code = 1
            try:
                listener.close()
                os.close(stop)
                _handle(conn, shim)
                code = 0
            finally:
                os._exit(code)
        conn.close()


# --------------------------------------------------------------------------- the tests' side


class ForkServer:
    """This test process's server, started on first use, stopped at exit."""

    _proc: subprocess.Popen | None = None
    _shim: Path | None = None

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("ACL_TEST_FORK_SERVER", "1") != "0"

    @classmethod
    def shim(cls) -> Path:
        """The folder of stand-ins (the server started if it is not running)."""
        if cls._proc is None or cls._proc.poll() is not None:
            folder = Path(tempfile.mkdtemp(prefix="acl-fork-"))
            client = folder / "client"
            text = (HERE / "shim_client.py").read_text(encoding="utf-8")
            client.write_text(f"#!{sys.executable} -SE\n{text}", encoding="utf-8")
            client.chmod(0o755)
            for name in SHIMS:
                (folder / name).symlink_to("client")
            cls._proc = subprocess.Popen(
                [sys.executable, __file__, str(folder)], stdin=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(HERE.parent),
            )  # fmt: skip
            deadline = time.monotonic() + 300
            while not (folder / SOCKET).exists():
                if cls._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the fork server did not start")
                time.sleep(0.05)
            cls._shim = folder
            atexit.register(cls.stop)
        assert cls._shim is not None
        return cls._shim

    @classmethod
    def served(cls, cmd: Sequence[str | os.PathLike]) -> list[str]:
        """``cmd`` with this environment's python, fairseq-train, fairseq-validate and
        acl-fairseq-NAME (as a whole argument: also after ``bash LAUNCHER ... --``) replaced
        by their stand-ins; ``cmd`` as it is when the server is off."""
        cmd = [os.fspath(c) for c in cmd]
        if not cls.enabled():
            return cmd
        names = {sys.executable: "python", **{str(BIN / n): n for n in SHIMS if n != "python"}}
        if not any(c in names for c in cmd):
            return cmd
        shim = cls.shim()
        return [str(shim / names[c]) if c in names else c for c in cmd]

    @classmethod
    def served_env(cls, env: Mapping[str, str] | None) -> dict[str, str] | None:
        """``env`` with each value that names a served command (``PYTHON``,
        ``FAIRSEQ_TRAIN``) replaced by its stand-in."""
        if env is None:
            return None
        return {k: cls.served([v])[0] if v else v for k, v in env.items()}

    @classmethod
    def stop(cls) -> None:
        if cls._proc is not None and cls._proc.poll() is None:
            cls._proc.stdin.close()
            cls._proc.wait()
        if cls._shim is not None:
            shutil.rmtree(cls._shim, ignore_errors=True)
            cls._shim = None


def serve_tools(monkeypatch) -> None:
    """Serves the commands the tools and the studies start in the test process: the seam
    ``acl_fairseq.experiment.commands`` pointed at ``ForkServer.served`` (which leaves every
    command as it is with ``ACL_TEST_FORK_SERVER=0``); nothing else is patched."""
    from acl_fairseq.experiment import commands

    monkeypatch.setattr(commands, "_launcher", ForkServer.served)


if __name__ == "__main__":
    serve(sys.argv[1])
