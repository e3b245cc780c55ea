"""The tokenizers of prepared data: GPT-2 BPE, BERT WordPiece and SentencePiece, built from the
picklable ``TokenizerConfig`` that ``prepare_glue.json`` records."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import AclValueError

TOKENIZERS = ("gpt2", "wordpiece", "sentencepiece")
# BERT special tokens -> fairseq specials (the BERT converter drops these five from dict.txt).
WORDPIECE_SPECIALS = {
    "[UNK]": "<unk>",
    "[CLS]": "<s>",
    "[SEP]": "</s>",
    "[PAD]": "<pad>",
    "[MASK]": "<mask>",
}


@dataclass(frozen=True)
class TokenizerConfig:
    """Everything a worker process needs to build the tokenizer (picklable)."""

    kind: str
    gpt2_encoder_json: str | None = None
    gpt2_vocab_bpe: str | None = None
    vocab: str | None = None  # vocab.txt or tokenizer.json
    lowercase: bool | None = None
    spm_model: str | None = None


class Tokenizer(Protocol):
    """Turns one text into the token strings that go into the fairseq text file."""

    def tokenize(self, text: str) -> list[str]: ...


class Gpt2Tokenizer:
    """GPT-2 byte-level BPE as RoBERTa uses it: token ids written as strings."""

    def __init__(self, encoder_json: str, vocab_bpe: str) -> None:
        from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

        self.bpe = get_encoder(encoder_json, vocab_bpe)

    def tokenize(self, text: str) -> list[str]:
        return [str(i) for i in self.bpe.encode(text)]


def _json_lowercase(normalizer: dict[str, Any] | None) -> bool:
    """Whether a tokenizer.json normalizer lowercases."""
    if not normalizer:
        return False
    if normalizer.get("type") == "BertNormalizer":
        return bool(normalizer.get("lowercase"))
    if normalizer.get("type") == "Lowercase":
        return True
    if normalizer.get("type") == "Sequence":
        return any(_json_lowercase(n) for n in normalizer.get("normalizers", []))
    return False


def _set_json_lowercase(normalizer: dict[str, Any] | None, lowercase: bool) -> dict[str, Any]:
    """Return a normalizer that lowercases (or not), otherwise unchanged."""
    if normalizer and normalizer.get("type") == "BertNormalizer":
        return {**normalizer, "lowercase": lowercase}
    if normalizer and normalizer.get("type") == "Lowercase":
        return {"type": "Sequence", "normalizers": []} if not lowercase else normalizer
    parts = []
    if normalizer and normalizer.get("type") == "Sequence":
        parts = [_set_json_lowercase(n, lowercase) for n in normalizer.get("normalizers", [])]
        parts = [p for p in parts if p != {"type": "Sequence", "normalizers": []}]
    elif normalizer:
        parts = [normalizer]
    if lowercase and not any(_json_lowercase(p) for p in parts):
        parts.append({"type": "Lowercase"})
    return {"type": "Sequence", "normalizers": parts}


def wordpiece_lowercase_default(vocab: str) -> bool:
    """Lowercasing default: from tokenizer.json when given, else True (uncased BERT)."""
    if vocab.endswith(".json"):
        with open(vocab, encoding="utf-8") as f:
            return _json_lowercase(json.load(f).get("normalizer"))
    return True


class WordPieceTokenizer:
    """BERT WordPiece via ``tokenizers``, without [CLS]/[SEP]; BERT's specials in the output
    become fairseq's (the converted ``dict.txt`` lacks them)."""

    def __init__(self, vocab: str, lowercase: bool | None) -> None:
        from tokenizers import BertWordPieceTokenizer
        from tokenizers import Tokenizer as HfTokenizer

        if lowercase is None:
            lowercase = wordpiece_lowercase_default(vocab)
        self.specials = dict(WORDPIECE_SPECIALS)
        if vocab.endswith(".json"):
            with open(vocab, encoding="utf-8") as f:
                config = json.load(f)
            if _json_lowercase(config.get("normalizer")) != lowercase:
                config["normalizer"] = _set_json_lowercase(config.get("normalizer"), lowercase)
            unk = (config.get("model") or {}).get("unk_token")
            if unk:
                self.specials[unk] = "<unk>"
            self.tokenizer = HfTokenizer.from_str(json.dumps(config))
        else:
            self.tokenizer = BertWordPieceTokenizer(vocab, lowercase=lowercase)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    def tokenize(self, text: str) -> list[str]:
        tokens = self.tokenizer.encode(text, add_special_tokens=False).tokens
        return [self.specials.get(t, t) for t in tokens]


class SentencePieceTokenizer:
    """SentencePiece pieces (``▁the``, ``cat``, ...)."""

    def __init__(self, model: str) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=model)

    def tokenize(self, text: str) -> list[str]:
        return self.sp.encode(text, out_type=str)


def build_tokenizer(config: TokenizerConfig) -> Tokenizer:
    """Instantiate the tokenizer described by ``config``."""
    if config.kind == "gpt2":
        assert config.gpt2_encoder_json and config.gpt2_vocab_bpe
        return Gpt2Tokenizer(config.gpt2_encoder_json, config.gpt2_vocab_bpe)
    if config.kind == "wordpiece":
        assert config.vocab
        return WordPieceTokenizer(config.vocab, config.lowercase)
    if config.kind == "sentencepiece":
        assert config.spm_model
        return SentencePieceTokenizer(config.spm_model)
    raise AclValueError(f"unknown tokenizer {config.kind!r}")


def text_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    """The tokens of ``text`` as they go into the fairseq text file: every token split on
    whitespace, as fairseq's ``tokenize_line`` will split the line (keeps one line each)."""
    return [part for token in tokenizer.tokenize(text) for part in token.split()]
