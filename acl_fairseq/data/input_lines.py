"""Raw input lines (plain text or TSV columns) read into examples and encoded by the one text
encoder (``acl_fairseq.data.text_encoder.ExampleEncoder``): the input of
``acl-fairseq-predict``."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from torch import Tensor

from acl_fairseq.data.text_encoder import EncodeError, ExampleEncoder
from acl_fairseq.errors import AclValueError


class PredictError(AclValueError):
    """Bad input of ``acl-fairseq-predict``; the message names the flag, file or line."""


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
        raise PredictError(
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
            raise PredictError(
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
                raise PredictError(_not_utf8("stdin", number, e.start)) from None
        return lines
    if not Path(path).is_file():
        raise PredictError(f"--input {path}: no such file")
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
            raise PredictError(_not_utf8(source, number, e.start)) from None
    return lines


def encode_rows(encoder: ExampleEncoder, rows: Sequence[InputRow], source: str) -> list[Tensor]:
    """Every row's model input (``ExampleEncoder.encode``); errors name the line and the flag."""
    examples = []
    for row in rows:
        if len(row.texts) != encoder.num_inputs:
            kind = "a sentence-pair" if encoder.num_inputs == 2 else "a single-sentence"
            fix = "--text-columns 1,2" if encoder.num_inputs == 2 else "--text-columns 1"
            raise PredictError(
                f"{source} line {row.line}: {len(row.texts)} text column(s) for {kind} model "
                f"({encoder.num_inputs} input(s)): give a TSV with {fix}"
            )
        try:
            examples.append(encoder.encode(row.texts, f"{source} line {row.line}"))
        except EncodeError as e:
            raise PredictError(str(e)) from None
    return examples


def blank_lines(rows: Sequence[InputRow]) -> list[int]:
    """The line numbers of the rows whose every text is empty or white space: nothing to
    classify (predict writes ``-`` for them and says so)."""
    return [row.line for row in rows if not any(text.strip() for text in row.texts)]


def cut_lines(
    encoder: ExampleEncoder, rows: Sequence[InputRow], examples: Sequence[Tensor]
) -> list[int]:
    """The line numbers of the rows that ``encode_rows`` cut at the model's positions (a
    checkpoint trained with ``--shorten-method truncate``; otherwise a longer row is an
    error)."""
    if not encoder.truncate:
        return []
    whole = dataclasses.replace(encoder, max_positions=sys.maxsize)
    return [
        row.line
        for row, example in zip(rows, examples)
        if example.numel() >= encoder.max_positions
        and whole.encode(row.texts).numel() > encoder.max_positions
    ]


def count_lines(lines: Sequence[int], what: str) -> str:
    """``"1 blank input line"`` / ``"3 blank input lines"``."""
    return f"{len(lines)} {what}{'' if len(lines) == 1 else 's'}"


def line_list(lines: Sequence[int], shown: int = 5) -> str:
    """``"line 4"``, ``"lines 2, 5, 9"``, ``"lines 1, 2, 3, 4, 5 and 7 more"``."""
    head = ", ".join(str(n) for n in lines[:shown])
    more = f" and {len(lines) - shown} more" if len(lines) > shown else ""
    return f"line{'' if len(lines) == 1 else 's'} {head}{more}"
