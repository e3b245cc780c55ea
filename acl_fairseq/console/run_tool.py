"""The one way a tool runs its main: the plugin's errors as one line, ``PROG: error: MESSAGE``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import ParamSpec

from acl_fairseq.errors import AclFairseqError, traceback_wanted

__all__ = ["ERROR_EXIT", "run_tool"]

#: The exit status of a tool stopped by an :class:`AclFairseqError` (argparse's, for a bad flag).
ERROR_EXIT = 2

P = ParamSpec("P")


def run_tool(prog: str, main: Callable[P, int], *args: P.args, **kwargs: P.kwargs) -> int:
    """``main(*args, **kwargs)``'s exit status; an :class:`AclFairseqError` it raises is printed
    on stderr as ``PROG: error: MESSAGE`` (status :data:`ERROR_EXIT`), like argparse's errors.
    Other exceptions, and every error under ``ACL_FAIRSEQ_TRACEBACK=1``, keep their traceback."""
    try:
        return main(*args, **kwargs)
    except AclFairseqError as e:
        if traceback_wanted():
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return ERROR_EXIT
