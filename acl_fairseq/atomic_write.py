"""Files that appear whole: every file the tools write is written beside and renamed.

A file written in place is a fragment when the write fails: a full disk, a file-size limit
(``ulimit -f``) or a ``kill -9`` mid-write leaves the first bytes of the new file where the old
one was (a policy file cut at 1,024 bytes is not valid JSON). Here ``NAME`` is written as
``NAME.tmp``, flushed to disk and renamed onto ``NAME`` (one ``os.replace``): at every moment
``NAME`` is the old file, intact, or the new one, whole. A ``kill -9`` may leave ``NAME.tmp``
behind (the next write replaces it); any other failure removes it.

* :func:`replace_atomically`: the mechanism; the writer's own exceptions pass through
  (fairseq's checkpoints: ``acl_fairseq.checkpoint.atomic_files``).
* :func:`write_with`, :func:`write_text`, :func:`write_json`, :func:`open_atomic`: what the
  tools use. A file system error (no space left, a file-size limit, a read-only or
  unwritable folder) becomes one line (:class:`AclOSError`) naming the file, the disk and
  its free space, and whether the previous file is intact.

No torch, no fairseq: every layer may use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from .errors import AclOSError

__all__ = [
    "TMP_SUFFIX",
    "check_writable",
    "describe_failure",
    "failure_reason",
    "file_system_error",
    "open_atomic",
    "replace_atomically",
    "write_json",
    "write_text",
    "write_with",
]

#: What a file being written is called until it is complete: ``NAME`` + this.
TMP_SUFFIX = ".tmp"

#: The errors of a file system that cannot take the file (not of the writer's data).
_DISK = {
    errno.ENOSPC: "no space left on the disk",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file-size limit of this process is reached (ulimit -f)",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a file is in the way of its folder",
    errno.ENOENT: "its folder does not exist",
    errno.EISDIR: "it is a folder",
}


def _fsync_dir(folder: str) -> None:
    """Makes a rename in ``folder`` durable (where the file system allows it)."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_atomically(path: str | Path, write: Callable[[str], None]) -> None:
    """Runs ``write(tmp)`` to create ``tmp = path + TMP_SUFFIX`` in full, flushes it to disk
    and renames it onto ``path`` (one ``os.replace``). On an exception the temporary file is
    removed and ``path`` is left as it was; the exception passes through."""
    path = str(path)
    tmp = path + TMP_SUFFIX
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            if os.path.lexists(tmp):
                os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _mount_point(folder: Path) -> Path:
    """The mount point of the file system that holds ``folder`` (or its nearest existing
    parent)."""
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    while not os.path.ismount(folder) and folder != folder.parent:
        folder = folder.parent
    return folder


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def failure_reason(error: OSError) -> str:
    """Why the file system refused a write, in a few words (``no space left on the disk``)."""
    return _DISK.get(error.errno or 0, error.strerror or str(error))


def check_writable(path: str | Path, what: str, fix: str) -> None:
    """Before the work that ends by writing ``path``: a file can be made in its folder, or in
    the nearest existing folder above it (a probe, removed at once); else one ``AclOSError``
    line, ``WHAT PATH: cannot write there (why): FIX``. Read-only mounts and full disks are
    found as they are (root ignores modes)."""
    folder = Path(path).absolute().parent
    while not folder.exists() and folder != folder.parent:  # folders the writer will make
        folder = folder.parent
    probe = folder / f".{Path(path).name}.probe-{os.getpid()}{TMP_SUFFIX}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0")
        probe.unlink()
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink()
        why = failure_reason(e)
        raise AclOSError(f"{what} {path}: cannot write there ({why}): {fix}") from None


def describe_failure(path: str | Path, error: OSError, existed: bool, intact: str = "") -> str:
    """One line: ``path`` could not be written because of ``error`` (a file system error), on
    which disk, and what is left: the previous file (``existed``) intact, or no file;
    ``intact``: a note on another file that is intact (a checkpoint's previous one)."""
    path = Path(path)
    reason = failure_reason(error)
    where = ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        mount = _mount_point(path.parent)
        try:
            free = _size(shutil.disk_usage(mount).free)
            where = f" ({mount}: {free} free)"
        except OSError:
            where = f" ({mount})"
    left = (
        f"{path} is as it was (the previous file, intact)"
        if existed
        else f"no file was written (no {path.name} in {path.parent})"
    )
    permissions = f"write to a folder you may write to, or fix the permissions of {path.parent}"
    fix = {
        errno.ENOSPC: "free space on that disk, or write elsewhere, and run again",
        errno.EDQUOT: "free space on that disk, or write elsewhere, and run again",
        errno.EFBIG: "raise the limit (ulimit -f unlimited) and run again",
        errno.EROFS: "write to a writable folder",
        errno.EACCES: permissions,
        errno.EPERM: permissions,
        errno.ENOENT: f"create {path.parent} first, or write elsewhere",
        errno.ENOTDIR: "choose a folder that is not under a file",
        errno.EISDIR: "give a file name, not a folder",
    }.get(error.errno or 0, "check the disk and run again")
    also = f"; {intact}" if intact else ""
    return f"cannot write {path}: {reason}{where}; {left}{also}: {fix}"


def write_with(path: str | Path, write: Callable[[str], None], intact: str = "") -> Path:
    """``replace_atomically(path, write)``; a file system error becomes :class:`AclOSError`
    (:func:`describe_failure`). Returns ``path``."""
    path = Path(path)
    existed = path.is_file()
    try:
        replace_atomically(path, write)
    except AclOSError:
        raise
    except Exception as e:
        cause = file_system_error(e)
        if cause is None:
            raise
        raise AclOSError(describe_failure(path, cause, existed, intact)) from e
    return path


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # a Rust io::Error (safetensors, tokenizers)


def file_system_error(error: BaseException) -> OSError | None:
    """The file system error behind ``error``: itself, one it was raised from, or the
    ``os error N`` a library's message names (safetensors, tokenizers); else None."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        match = _OS_ERROR.search(str(seen))
        if match:
            number = int(match.group(1))
            return OSError(number, os.strerror(number))
        seen = seen.__cause__ or seen.__context__
    return None


def write_text(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) into ``path``, whole or not at all (:func:`write_with`)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)

    return write_with(path, write)


def write_json(path: str | Path, value: Any, indent: int | None = 1) -> Path:
    """``value`` as JSON (and a final newline) into ``path`` (:func:`write_text`)."""
    return write_text(path, json.dumps(value, indent=indent) + "\n")


@contextlib.contextmanager
def open_atomic(path: str | Path, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """``open(path + TMP_SUFFIX, mode, **kwargs)`` for the block (text mode: UTF-8 unless
    ``encoding`` is given), flushed and renamed onto ``path`` when the block ends; on an
    exception the temporary file is removed and ``path`` is left as it was (a file system
    error: :class:`AclOSError`, as :func:`write_with`). Keep the block to writing the file."""
    if "b" not in mode:
        kwargs.setdefault("encoding", "utf-8")
    path = Path(path)
    existed = path.is_file()
    tmp = str(path) + TMP_SUFFIX
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
        replace_atomically(path, lambda _: None)  # tmp is complete: flush and rename
    except BaseException as e:
        with contextlib.suppress(OSError):
            if os.path.lexists(tmp):
                os.remove(tmp)
        if isinstance(e, OSError) and not isinstance(e, AclOSError):
            raise AclOSError(describe_failure(path, e, existed)) from e
        raise
