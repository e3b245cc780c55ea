"""New text encoded exactly as a prepared folder's splits were: the one encoder of raw text.

``TextEncoder``: the tokenizer recorded by ``acl-fairseq-prepare``, also a fairseq ``bpe``
(``encode`` / ``decode``). ``ExampleEncoder`` adds what fairseq-preprocess and
``SentencePredictionTask.load_dataset`` do: the dictionary, ``--init-token``, the separator of
pairs, and over-long examples cut or refused. Used by preparation, predict and the hub.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import AclValueError
from .prepared import meta_tokenizer
from .tokenizer.kinds import (
    Gpt2Tokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerConfig,
    build_tokenizer,
    text_tokens,
)

__all__ = ["EncodeError", "ExampleEncoder", "TextEncoder"]


class EncodeError(AclValueError):
    """An example the model cannot take (number of texts, length); the message says where."""


class TextEncoder:
    """One text <-> the token line of the training text files (a fairseq ``bpe``)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_data(cls, data_dir: str | Path) -> TextEncoder:
        """The tokenizer a prepared folder's text was encoded with (``DataError`` without one)."""
        return cls(meta_tokenizer(data_dir))

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> TextEncoder:
        """The tokenizer of a ``prepare_glue.json`` already read (``prepared.read_meta``)."""
        return cls(build_tokenizer(TokenizerConfig(**meta["tokenizer"])))

    def tokens(self, text: str) -> list[str]:
        """The tokens of ``text`` as they go into the text file (no whitespace inside one)."""
        return text_tokens(self.tokenizer, text)

    def encode(self, text: str) -> str:
        """``text`` -> its space-joined tokens (GPT-2 ids, SentencePiece or WordPiece pieces)."""
        return " ".join(self.tokens(text))

    def decode(self, line: str) -> str:
        """A token line -> text (GPT-2 ids, SentencePiece pieces, WordPiece ``##`` pieces)."""
        tokens = line.split()
        if isinstance(self.tokenizer, Gpt2Tokenizer):
            return self.tokenizer.bpe.decode([int(t) for t in tokens if t.isdigit()])
        if isinstance(self.tokenizer, SentencePieceTokenizer):
            return "".join(tokens).replace("\u2581", " ").strip()
        return " ".join(tokens).replace(" ##", "")


@dataclass
class ExampleEncoder:
    """Text(s) of one example -> the ``src_tokens`` the model was trained on."""

    text: TextEncoder
    dictionary: Any  # fairseq Dictionary (input0/dict.txt)
    num_inputs: int
    init_token: int | None
    separator_token: int | None
    max_positions: int
    truncate: bool

    @classmethod
    def from_task(
        cls, task: Any, data_dir: str | Path, max_positions: int, text: TextEncoder | None = None
    ) -> ExampleEncoder:
        """The encoder of a ``sentence_prediction`` task on its prepared data folder (whose
        ``TextEncoder`` is ``text`` when given)."""
        cfg = task.cfg
        return cls(
            text=text or TextEncoder.from_data(data_dir),
            dictionary=task.source_dictionary,
            num_inputs=2 if (Path(data_dir) / "input1").is_dir() else 1,
            init_token=cfg.init_token,
            separator_token=cfg.separator_token,
            max_positions=int(max_positions),
            truncate=cfg.shorten_method == "truncate",
        )

    def ids(self, text: str) -> Tensor:
        """One text -> dictionary ids ending in ``</s>`` (as fairseq-preprocess writes them)."""
        line = self.text.encode(text)
        return self.dictionary.encode_line(line, append_eos=True, add_if_not_exist=False).long()

    def encode(self, texts: Sequence[str], where: str = "input") -> Tensor:
        """The example of ``texts`` (one, or two for a pair): 1D ids as
        ``SentencePredictionTask.load_dataset`` builds them. ``where`` names the example in
        errors (e.g. ``stdin line 3``)."""
        if len(texts) != self.num_inputs:
            kind = "a sentence-pair" if self.num_inputs == 2 else "a single-sentence"
            raise EncodeError(
                f"{where}: {len(texts)} text(s) for {kind} model ({self.num_inputs} input(s))"
            )
        first = self.ids(texts[0])
        if self.init_token is not None:
            first = torch.cat([first.new([self.init_token]), first])
        tokens = first
        if self.num_inputs == 2:
            second = self.ids(texts[1])
            if self.separator_token is not None:
                second = torch.cat([second.new([self.separator_token]), second])
            tokens = torch.cat([first, second])
        if tokens.numel() > self.max_positions:
            if not self.truncate:
                raise EncodeError(
                    f"{where}: {tokens.numel()} tokens, more than the model's "
                    f"{self.max_positions} positions (the checkpoint was not trained with "
                    "--shorten-method truncate): shorten it"
                )
            tokens = tokens[: self.max_positions]
        return tokens
