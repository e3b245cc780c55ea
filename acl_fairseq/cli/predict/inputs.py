"""Raw text to model input for ``acl-fairseq-predict``: reading the input lines (plain text
or TSV) and encoding them exactly as the binarized splits were built for training.

Encoding: the tokenizer recorded at preparation (``prepare_glue.json``), the source dictionary
(``encode_line(..., append_eos=True, add_if_not_exist=False)``, as fairseq-preprocess), then as
fairseq's ``SentencePredictionTask.load_dataset``: ``--init-token`` prepended to input0 and,
for pairs, ``--separator-token`` prepended to input1 and both concatenated; over-long examples
are cut (``--shorten-method truncate``) or refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


class PredictError(ValueError):
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


@dataclass
class ExampleEncoder:
    """Text(s) of one example -> the ``src_tokens`` the model was trained on."""

    tokenizer: Any  # acl_fairseq.data.tokenizers.Tokenizer
    dictionary: Any  # fairseq Dictionary (input0/dict.txt)
    num_inputs: int
    init_token: int | None
    separator_token: int | None
    max_positions: int
    truncate: bool

    @classmethod
    def from_task(cls, task: Any, data_dir: str | Path, max_positions: int) -> ExampleEncoder:
        """The encoder of a loaded ``sentence_prediction`` task on its prepared data folder."""
        from acl_fairseq.data.binarize import meta_tokenizer
        from acl_fairseq.data.tasks import DataError

        try:
            tokenizer = meta_tokenizer(data_dir)
        except DataError as e:
            raise PredictError(
                f"--data {data_dir}: {e} (the raw text is encoded with the tokenizer recorded "
                "at preparation)"
            ) from None
        cfg = task.cfg
        return cls(
            tokenizer=tokenizer,
            dictionary=task.source_dictionary,
            num_inputs=2 if (Path(data_dir) / "input1").is_dir() else 1,
            init_token=cfg.init_token,
            separator_token=cfg.separator_token,
            max_positions=int(max_positions),
            truncate=cfg.shorten_method == "truncate",
        )

    def encode_text(self, text: str) -> Tensor:
        """One text -> dictionary ids ending in ``</s>`` (as fairseq-preprocess writes them)."""
        from acl_fairseq.data.tokenizers import text_tokens

        line = " ".join(text_tokens(self.tokenizer, text))
        ids = self.dictionary.encode_line(line, append_eos=True, add_if_not_exist=False)
        return ids.long()

    def encode(self, row: InputRow, source: str = "input") -> Tensor:
        """The example of ``row``: 1D ids as ``SentencePredictionTask.load_dataset`` builds."""
        if len(row.texts) != self.num_inputs:
            kind = "a sentence-pair" if self.num_inputs == 2 else "a single-sentence"
            fix = "--text-columns 1,2" if self.num_inputs == 2 else "--text-columns 1"
            raise PredictError(
                f"{source} line {row.line}: {len(row.texts)} text column(s) for {kind} model "
                f"({self.num_inputs} input(s)): give a TSV with {fix}"
            )
        first = self.encode_text(row.texts[0])
        if self.init_token is not None:
            first = torch.cat([first.new([self.init_token]), first])
        tokens = first
        if self.num_inputs == 2:
            second = self.encode_text(row.texts[1])
            if self.separator_token is not None:
                second = torch.cat([second.new([self.separator_token]), second])
            tokens = torch.cat([first, second])
        if tokens.numel() > self.max_positions:
            if not self.truncate:
                raise PredictError(
                    f"{source} line {row.line}: {tokens.numel()} tokens, more than the "
                    f"model's {self.max_positions} positions (the checkpoint was not trained "
                    "with --shorten-method truncate): shorten that line"
                )
            tokens = tokens[: self.max_positions]
        return tokens
