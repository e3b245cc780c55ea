"""``acl-fairseq-predict``'s input and output lines, shared with the bundle's runner so that
both read the same examples, batch them the same way and print the same lines.

Input: one example per line, plain text or the 1-based ``--text-columns`` of a TSV line, UTF-8
(``read_input``, ``read_rows``). Batches: the examples sorted by length (stable), cut every
``batch_size``, padded on the right (``length_batches``, ``collate``), after an untimed
warm-up (``warm_up``). A blank line (every text empty or white space) is not classified: its
output line is ``-<TAB>-<TAB>-`` and a note on stderr counts them (``blank_lines``,
``blank_note``, ``with_blanks``). Output: one line per example, in input order,
``label<TAB>probability<TAB>exit_layer`` (``output_lines``; a regression model's score in the
labels' units, ``-``, the layer), then a ``summary`` on stderr.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .decide import maxprob

__all__ = [
    "InputError",
    "InputRow",
    "BLANK_LINE",
    "answers",
    "blank_lines",
    "blank_note",
    "check_inputs",
    "count_lines",
    "collate",
    "decode_lines",
    "length_batches",
    "line_list",
    "output_lines",
    "parse_columns",
    "read_input",
    "read_rows",
    "summary",
    "warm_up",
    "with_blanks",
]

BLANK_LINE = "-\t-\t-"
"""The output line of a blank input line: nothing classified."""


class InputError(ValueError):
    """Bad input lines or flags; the message names the flag, the file or the line."""


@dataclass(frozen=True)
class InputRow:
    """One example: its 1-based line number in the input and its text(s)."""

    line: int
    texts: tuple[str, ...]


def parse_columns(spec: str | None) -> list[int] | None:
    """``--text-columns "1,2"`` -> ``[1, 2]`` (1-based; one or two columns)."""
    if spec is None:
        return None
    try:
        columns = [int(c) for c in spec.split(",") if c.strip()]
    except ValueError:
        columns = []
    if not 1 <= len(columns) <= 2 or any(c < 1 for c in columns):
        raise InputError(
            f"--text-columns {spec!r}: expected one or two 1-based column numbers, like 1 or 1,2"
        )
    return columns


def read_rows(
    lines: Iterable[str], source: str, columns: Sequence[int] | None, header: bool = False
) -> list[InputRow]:
    """The examples of ``lines``: one text per line, or the ``columns`` of a TSV line."""
    rows = []
    for number, raw in enumerate(lines, start=1):
        if header and number == 1:
            continue
        line = raw.rstrip("\r\n")
        if columns is None:
            rows.append(InputRow(number, (line,)))
            continue
        fields = line.split("\t")
        if max(columns) > len(fields):
            raise InputError(
                f"{source} line {number}: {len(fields)} tab-separated column(s), but "
                f"--text-columns asks for column {max(columns)}"
            )
        rows.append(InputRow(number, tuple(fields[c - 1] for c in columns)))
    return rows


def read_input(path: str, stdin: TextIO) -> list[str]:
    """The lines of ``--input`` (``-``: stdin), which must be UTF-8 (the line that is not is
    named)."""
    if path == "-":
        buffer = getattr(stdin, "buffer", None)
        if buffer is not None:
            return decode_lines(buffer.read(), "stdin")
        lines = stdin.readlines()
        for number, line in enumerate(lines, start=1):
            try:
                line.encode("utf-8")  # undecodable bytes arrive as lone surrogates
            except UnicodeEncodeError as e:
                raise InputError(_not_utf8("stdin", number, e.start)) from None
        return lines
    if not Path(path).is_file():
        raise InputError(f"--input {path}: no such file")
    return decode_lines(Path(path).read_bytes(), f"--input {path}")


def _not_utf8(source: str, line: int, column: int) -> str:
    return (
        f"{source} line {line}: not valid UTF-8 (at character {column + 1}): the input must be "
        "UTF-8 text; convert it first, e.g. iconv -f latin1 -t utf-8 FILE"
    )


def decode_lines(data: bytes, source: str) -> list[str]:
    """``data`` split into lines (kept ends) and decoded as UTF-8 (a BOM is dropped)."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = []
    for number, raw in enumerate(data.splitlines(keepends=True), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(_not_utf8(source, number, e.start)) from None
    return lines


def check_inputs(
    rows: Sequence[InputRow], num_inputs: int, source: str, what: str, columns: Any
) -> None:
    """Every row has the model's number of texts (``num_inputs``: 2 for sentence pairs);
    ``what`` names the model, ``columns`` is ``--text-columns`` (None: not given)."""
    if columns is None and num_inputs == 2:
        raise InputError(f"{what} is a sentence-pair model: give a TSV with --text-columns 1,2")
    for row in rows:
        if len(row.texts) != num_inputs:
            kind = "a sentence-pair" if num_inputs == 2 else "a single-sentence"
            fix = "--text-columns 1,2" if num_inputs == 2 else "--text-columns 1"
            raise InputError(
                f"{source} line {row.line}: {len(row.texts)} text column(s) for {kind} model "
                f"({num_inputs} input(s)): give a TSV with {fix}"
            )


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """The examples' indices in batches of ``batch_size``, by length (stable: less padding)."""
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def warm_up(examples: Sequence[Any], batch_size: int) -> list[Any]:
    """The examples of the untimed first forward (one-time costs: threads, the padded path):
    the shortest and the longest, at most ``batch_size``."""
    by_length = sorted(examples, key=len)
    return [by_length[0], by_length[-1]][: min(2, batch_size, len(examples))] if examples else []


def summary(count: int, seconds: float, layers: Sequence[int], depth: int, label: str) -> str:
    """The line on stderr after the output: sentences/s, the mean exit layer, the policy."""
    rate = count / seconds if seconds > 0 else float("inf")
    mean = sum(layers) / len(layers) if layers else 0.0
    return (
        f"{count} sentences, {rate:.1f} sentences/s (timed after one warm-up forward), mean "
        f"exit layer {mean:.2f} of {depth} ({label})"
    )


def collate(rows: Sequence[Any], pad: int) -> np.ndarray:
    """1-D id sequences -> B x T int64, padded with ``pad`` on the right."""
    width = max((len(r) for r in rows), default=0)
    tokens = np.full((len(rows), width), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens


def answers(logits: Any) -> tuple[list[int], list[float]]:
    """Each row's argmax and its softmax probability (B x K logits)."""
    logits = np.asarray(logits, dtype=np.float32)
    return logits.argmax(axis=1).tolist(), maxprob(logits).tolist()


def output_lines(
    logits: Any,
    layers: Sequence[int],
    labels: Sequence[str] | None,
    regression: bool = False,
    divisor: float = 1.0,
) -> list[str]:
    """One output line per row of ``logits`` (B x K) that left at ``layers``: the label of its
    argmax, the softmax probability of that label (4 decimals), the layer; a regression model
    (or no ``labels``): its score times ``divisor`` (4 significant digits), ``-``, the layer."""
    logits = np.asarray(logits, dtype=np.float32)
    if regression or labels is None:
        return [
            f"{float(value) * divisor:.4g}\t-\t{int(layer)}"
            for value, layer in zip(logits[:, 0].tolist(), layers)
        ]
    best, top = answers(logits)
    return [
        f"{labels[index]}\t{prob:.4f}\t{int(layer)}"
        for index, prob, layer in zip(best, top, layers)
    ]


def blank_lines(rows: Sequence[InputRow]) -> list[int]:
    """The line numbers of the rows whose every text is empty or white space: nothing to
    classify."""
    return [row.line for row in rows if not any(text.strip() for text in row.texts)]


def count_lines(lines: Sequence[int], what: str) -> str:
    """``"1 blank input line"`` / ``"3 blank input lines"``."""
    return f"{len(lines)} {what}{'' if len(lines) == 1 else 's'}"


def line_list(lines: Sequence[int], shown: int = 5) -> str:
    """``"line 4"``, ``"lines 2, 5, 9"``, ``"lines 1, 2, 3, 4, 5 and 7 more"``."""
    head = ", ".join(str(n) for n in lines[:shown])
    more = f" and {len(lines) - shown} more" if len(lines) > shown else ""
    return f"line{'' if len(lines) == 1 else 's'} {head}{more}"


def blank_note(blank: Sequence[int]) -> str:
    """The note on stderr about the blank lines ``blank`` (sorted line numbers)."""
    return (
        f"note: {count_lines(blank, 'blank input line')} ({line_list(blank)}): not "
        f"classified, '{BLANK_LINE[0]}' on their output lines"
    )


def with_blanks(rows: Sequence[InputRow], blank: set[int], lines: Iterable[str]) -> list[str]:
    """The output lines of ``rows`` in input order: ``lines`` (one per row not in ``blank``)
    with ``BLANK_LINE`` at the blank rows."""
    answered = iter(lines)
    return [BLANK_LINE if row.line in blank else next(answered) for row in rows]
