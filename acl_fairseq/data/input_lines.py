"""Raw input rows encoded by the one text encoder (``acl_fairseq.data.text_encoder``): the
model input of ``acl-fairseq-predict``. The lines themselves are read, checked and batched by
``acl_fairseq.portable.lines``, which the bundle's runner shares."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from acl_fairseq.data.text_encoder import EncodeError, ExampleEncoder
from acl_fairseq.errors import AclValueError


class PredictError(AclValueError):
    """Bad input of ``acl-fairseq-predict``; the message names the flag, file or line."""


def encode_rows(encoder: ExampleEncoder, rows: Sequence[Any], source: str) -> list[Tensor]:
    """Every row's model input (``ExampleEncoder.encode``; ``rows``: ``portable.lines
    .InputRow``, their number of texts checked); errors name the line and the flag."""
    examples = []
    for row in rows:
        try:
            examples.append(encoder.encode(row.texts, f"{source} line {row.line}"))
        except EncodeError as e:
            raise PredictError(str(e)) from None
    return examples


def cut_lines(
    encoder: ExampleEncoder, rows: Sequence[Any], examples: Sequence[Tensor]
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
