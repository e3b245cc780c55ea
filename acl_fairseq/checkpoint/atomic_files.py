"""Checkpoint files that appear whole: fairseq's checkpoint writes and copies, made atomic.

fairseq's ``torch.save`` and ``PathManager.copy`` write in place, so a kill mid-write leaves a
truncated ``checkpoint_last.pt`` that cannot be resumed. Where the guard rails act
(``acl_fairseq.fairseq_patches``), :func:`install_persistent_save` and :func:`install_copy`
route local files through ``acl_fairseq.atomic_write`` (``NAME.tmp``, flushed, ``os.replace``);
the next training removes a leftover ``NAME.tmp`` (:func:`remove_leftovers`). A save that the
file system refuses (a full disk: torch's "unexpected pos") stops the run with one line naming
the disk and the checkpoint left intact. Remote paths, ``--write-checkpoints-asynchronously``
and stock runs keep fairseq's code.
"""

from __future__ import annotations

import functools
import io
import os
import shutil
from collections.abc import Callable

import torch
from fairseq import checkpoint_utils
from fairseq.file_io import PathManager

from ..atomic_write import TMP_SUFFIX, replace_atomically, write_with

#: Whether the guard rails act on this run (set by ``acl_fairseq.fairseq_patches``).
_acts: Callable[[], bool] = bool

__all__ = [
    "TMP_SUFFIX",
    "install_copy",
    "install_persistent_save",
    "leftovers",
    "remove_leftovers",
    "replace_atomically",
]


class _Recording(io.RawIOBase):
    """A binary file that keeps the first ``OSError`` of its writes: ``torch.save`` reports a
    failed write as a ``RuntimeError`` ("unexpected pos"), this names its cause."""

    def __init__(self, f: io.BufferedWriter) -> None:
        super().__init__()
        self.f, self.error = f, None

    @property
    def name(self) -> str:
        """The file's name, as ``open`` gives it (what a caller of ``torch.save`` may read)."""
        return self.f.name

    def fileno(self) -> int:
        return self.f.fileno()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise


def _torch_save_to(obj: object) -> Callable[[str], None]:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            recording = _Recording(f)
            try:
                torch.save(obj, recording)
                recording.flush()
            except RuntimeError:
                if recording.error is not None:
                    raise recording.error from None
                raise

    return write


def _previous(filename: str) -> str:
    """What a failed save of ``filename`` leaves to resume from: its folder's
    ``checkpoint_last.pt``, when there is one."""
    last = os.path.join(os.path.dirname(filename), "checkpoint_last.pt")
    if os.path.basename(filename) != "checkpoint_last.pt" and os.path.isfile(last):
        return f"{last} is intact: the same command resumes from it"
    return ""


def _save(filename: str, write: Callable[[str], None]) -> None:
    """``write_with`` for a checkpoint: a file system error is one line naming the disk and
    the checkpoint that is left intact."""
    write_with(filename, write, intact=_previous(filename))


def _is_local(path: str) -> bool:
    return not PathManager.path_requires_pathmanager(str(path))


def _atomic_persistent_save(original: Callable) -> Callable:
    @functools.wraps(original)
    def torch_persistent_save(obj, filename, async_write: bool = False):
        if async_write or not _is_local(filename) or not _acts():
            return original(obj, filename, async_write)
        _save(str(filename), _torch_save_to(obj))

    torch_persistent_save._acl_fairseq_atomic = True  # type: ignore[attr-defined]
    return torch_persistent_save


def _atomic_copy(original: Callable) -> Callable:
    @functools.wraps(original)
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if not (_is_local(src_path) and _is_local(dst_path)) or not _acts():
            return original(src_path, dst_path, overwrite)
        _save(str(dst_path), functools.partial(shutil.copyfile, str(src_path)))
        return True

    copy._acl_fairseq_atomic = True  # type: ignore[attr-defined]
    return copy


def install_persistent_save(acts: Callable[[], bool]) -> None:
    """Idempotent: fairseq's ``checkpoint_utils.torch_persistent_save`` (every checkpoint the
    trainer writes) replaces its file atomically where ``acts()``."""
    global _acts
    _acts = acts
    current = checkpoint_utils.torch_persistent_save
    if not getattr(current, "_acl_fairseq_atomic", False):
        checkpoint_utils.torch_persistent_save = _atomic_persistent_save(current)


def install_copy(acts: Callable[[], bool]) -> None:
    """Idempotent: fairseq's ``PathManager.copy`` (the trainer's copies to
    ``checkpoint_best.pt`` / ``checkpoint_last.pt``) replaces its file atomically where
    ``acts()``."""
    global _acts
    _acts = acts
    current = PathManager.copy
    if not getattr(current, "_acl_fairseq_atomic", False):
        PathManager.copy = staticmethod(_atomic_copy(current))


def leftovers(save_dir: str) -> list[str]:
    """The incomplete checkpoint files (``*.pt.tmp``) an interrupted save left in
    ``save_dir``, sorted."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    suffix = ".pt" + TMP_SUFFIX
    return sorted(os.path.join(save_dir, n) for n in names if n.endswith(suffix))


def remove_leftovers(save_dir: str) -> list[str]:
    """Removes :func:`leftovers` (call it only while holding the folder's lock: a running
    save's temporary file is a leftover too); returns what was removed."""
    removed = []
    for path in leftovers(save_dir):
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed
