"""The user's commands, one module per command (a package where a command has several parts),
each a thin command over the library; and the one thing their parsers share, the help layout
of the tools with a long description (``HelpFormatter``)."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; options with their default unless the help names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default in (None, False, argparse.SUPPRESS)
        ):
            return text
        if isinstance(default, list):
            default = ",".join(map(str, default))
        return f"{text} (default: {default})".strip()
