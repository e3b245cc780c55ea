"""One training per ``--save-dir``: ``SAVE_DIR/training.lock``, held for the life of the run.

Two trainings in one folder would silently replace each other's checkpoints. :func:`acquire`
takes the file with ``flock`` (released by the kernel however the process ends) and writes
its holder into it; a second training stops naming the first, and a killed holder's file is
taken over with a warning. Rank 0 alone takes it.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass

from ..errors import AclRuntimeError

__all__ = ["LOCK_FILE", "Holder", "SaveDirInUse", "SaveDirLock", "acquire"]

logger = logging.getLogger(__name__)

LOCK_FILE = "training.lock"


class SaveDirInUse(AclRuntimeError):
    """Another training holds the ``--save-dir``."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a save folder's lock."""

    pid: int
    host: str
    started: str  # local time, ISO 8601
    command: str

    @classmethod
    def this_process(cls) -> Holder:
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        return cls(os.getpid(), socket.gethostname(), started, shlex.join(sys.argv))

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}: {self.command}"


def _read_holder(fd: int) -> Holder | None:
    """The holder recorded in the open lock file ``fd`` (None: empty or unreadable)."""
    try:
        data = os.pread(fd, 1 << 16, 0)
        fields = json.loads(data.decode("utf-8"))
        return Holder(int(fields["pid"]), str(fields["host"]), str(fields["started"]),
                      str(fields["command"]))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _same_file(fd: int, path: str) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


class SaveDirLock:
    """The lock on one save folder, held by this process until :meth:`release`."""

    def __init__(self, save_dir: str, fd: int, taken_over: Holder | None) -> None:
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.taken_over = taken_over  # the holder of a stale lock this one replaced
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Removes the lock file, then unlocks (idempotent)."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                os.remove(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        _HELD.pop(_key(self.save_dir), None)


_HELD: dict[str, SaveDirLock] = {}  # the locks this process holds, by folder


def _key(save_dir: str) -> str:
    return os.path.realpath(save_dir)


def _in_use(save_dir: str, path: str, holder: Holder | None) -> SaveDirInUse:
    who = (
        holder.describe()
        if holder is not None
        else f"its details are not written yet; the lock file is {path}"
    )
    return SaveDirInUse(
        f"--save-dir {save_dir} is in use by another training ({who}). Two trainings in one "
        "--save-dir overwrite each other's checkpoints: wait for that one to end, or pass "
        "another --save-dir"
    )


def acquire(save_dir: str) -> SaveDirLock | None:
    """Takes ``save_dir``'s lock for this process (:class:`SaveDirInUse` when another live
    process holds it); None, logged, where the file system cannot lock."""
    if _key(save_dir) in _HELD:
        return _HELD[_key(save_dir)]
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK_FILE)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise _in_use(save_dir, path, holder) from None
            logger.warning(
                f"cannot lock {path} ({e.strerror}) on this file system: a second training "
                f"started in --save-dir {save_dir} would not be noticed"
            )
            return None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed the file as we opened it: lock the new one
    stale = _read_holder(fd)
    record = json.dumps(asdict(Holder.this_process())).encode("utf-8") + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.fsync(fd)
    lock = SaveDirLock(save_dir, fd, stale)
    _HELD[_key(save_dir)] = lock
    atexit.register(lock.release)
    if stale is not None:
        logger.warning(
            f"{path}: the training that held --save-dir {save_dir} ({stale.describe()}) ended "
            "without releasing it (killed?); this run takes the folder over"
        )
    return lock
