"""The tokenizer recorded by ``acl-fairseq-prepare`` as a fairseq ``bpe`` object (``encode`` /
``decode`` of strings), so that the hub interface encodes raw text as the training data."""

from __future__ import annotations

from pathlib import Path

from acl_fairseq.data.tokenizers import (
    Gpt2Tokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    text_tokens,
)


class RecordedBpe:
    """``encode(text)``: the space-joined tokens of the training text files; ``decode`` the
    reverse (GPT-2 ids, SentencePiece pieces, WordPiece ``##`` continuations)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> str:
        return " ".join(text_tokens(self.tokenizer, text))

    def decode(self, text: str) -> str:
        tokens = text.split()
        if isinstance(self.tokenizer, Gpt2Tokenizer):
            return self.tokenizer.bpe.decode([int(t) for t in tokens if t.isdigit()])
        if isinstance(self.tokenizer, SentencePieceTokenizer):
            return "".join(tokens).replace("\u2581", " ").strip()
        return " ".join(tokens).replace(" ##", "")


def recorded_bpe(data_dir: str | Path) -> RecordedBpe:
    """The ``RecordedBpe`` of a prepared folder (``DATA/prepare_glue.json``)."""
    from acl_fairseq.data.binarize import meta_tokenizer

    return RecordedBpe(meta_tokenizer(data_dir))
