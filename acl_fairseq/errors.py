"""The plugin's own errors, and how fairseq's commands print them.

An :class:`AclFairseqError` is raised by one of the plugin's checks; its message names the
flag or file and the fix. It is printed as one line, ``PROG: error: MESSAGE``, in fairseq's
commands (:func:`install_excepthook`, spawned workers included) and in the plugin's tools
(:func:`run_tool`); ``ACL_FAIRSEQ_TRACEBACK=1`` shows the traceback. The
kinds also derive from the built-in they replace, so ``except ValueError`` still catches them.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import ParamSpec

__all__ = [
    "ERROR_EXIT",
    "TRACEBACK_ENV",
    "AclFairseqError",
    "AclFileNotFoundError",
    "AclIsADirectoryError",
    "AclOSError",
    "AclRuntimeError",
    "AclValueError",
    "ConversionError",
    "install_excepthook",
    "plugin_message",
    "run_tool",
    "traceback_wanted",
]

#: Set to 1 (or any value but 0) to print the traceback of an :class:`AclFairseqError`.
TRACEBACK_ENV = "ACL_FAIRSEQ_TRACEBACK"


class AclFairseqError(Exception):
    """An error of the plugin's checks: the message names the flag or file and the fix."""


class AclValueError(AclFairseqError, ValueError):
    """A flag, a value or an input that cannot work."""


class ConversionError(AclValueError):
    """A model or tokenizer cannot be converted, either way between fairseq and Hugging Face
    (the message says which file or field and why)."""


class AclFileNotFoundError(AclFairseqError, FileNotFoundError):
    """A file or folder that a flag names, or that the data needs, is not there."""


class AclIsADirectoryError(AclFairseqError, IsADirectoryError):
    """A flag names a folder where a file is needed."""


class AclOSError(AclFairseqError, OSError):
    """A file that could not be written or read (a full disk, a read-only folder): the
    message names the file, the disk and what was left as it was."""


class AclRuntimeError(AclFairseqError, RuntimeError):
    """A state of the run (a save folder in use, a model built with another option) that
    stops it."""


def plugin_message(error: BaseException) -> str | None:
    """The message of an :class:`AclFairseqError`: ``error`` itself, or the last line of the
    traceback that torch's ``ProcessRaisedException`` carries from a spawned worker
    (``acl_fairseq.errors.AclValueError: MESSAGE``); None for any other exception."""
    if isinstance(error, AclFairseqError):
        return str(error)
    if type(error).__name__ != "ProcessRaisedException" or not error.args:
        return None
    last = str(error.args[0]).rstrip().rsplit("\n", 1)[-1]
    name, sep, message = last.partition(": ")
    module, _, kind = name.rpartition(".")
    if not sep or not module.startswith("acl_fairseq"):
        return None
    try:
        cls = getattr(importlib.import_module(module), kind)
    except (ImportError, AttributeError):
        return None
    return message if isinstance(cls, type) and issubclass(cls, AclFairseqError) else None


def traceback_wanted() -> bool:
    """Whether ``ACL_FAIRSEQ_TRACEBACK`` asks for the full traceback of the plugin's errors."""
    return os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0")


def _prog() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def install_excepthook(prog: str | None = None, acts: Callable[[], bool] = lambda: True) -> bool:
    """In a fairseq command (``prog``, default the program's name, starts with ``fairseq``),
    prints an uncaught :class:`AclFairseqError` as ``PROG: error: MESSAGE`` (exit status 1);
    other exceptions go to the previous hook. Idempotent; returns whether it is installed."""
    if not (prog or _prog()).startswith("fairseq"):
        return False
    if getattr(sys.excepthook, "_acl_fairseq", False):
        return True
    previous = sys.excepthook

    def excepthook(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        message = None if traceback_wanted() or not acts() else plugin_message(value)
        if message is None:
            previous(kind, value, tb)
            return
        sys.stderr.write(f"{prog or _prog()}: error: {message}\n")
        sys.stderr.flush()

    excepthook._acl_fairseq = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook
    return True


#: The exit status of a tool stopped by an :class:`AclFairseqError` (argparse's, for a bad flag).
ERROR_EXIT = 2

P = ParamSpec("P")


def run_tool(prog: str, main: Callable[P, int], *args: P.args, **kwargs: P.kwargs) -> int:
    """How a tool runs its main: ``main(*args, **kwargs)``'s exit status; an
    :class:`AclFairseqError` it raises is printed on stderr as ``PROG: error: MESSAGE`` (status
    :data:`ERROR_EXIT`), like argparse's errors. Other exceptions, and every error under
    ``ACL_FAIRSEQ_TRACEBACK=1``, keep their traceback."""
    try:
        return main(*args, **kwargs)
    except AclFairseqError as e:
        if traceback_wanted():
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return ERROR_EXIT
