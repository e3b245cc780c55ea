"""Tokenizers of the preparation: GPT-2 BPE, BERT WordPiece and SentencePiece, and the
parallel tokenization of a task's texts."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from acl_fairseq.data.tasks import DataError

logger = logging.getLogger("prepare_glue")

TOKENIZERS = ("gpt2", "wordpiece", "sentencepiece")
CHUNK_SIZE = 1000
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
    """BERT WordPiece via the ``tokenizers`` library, without [CLS]/[SEP].

    BERT special tokens in the output (e.g. ``[UNK]`` for unknown characters) are mapped to
    fairseq's specials, since the converted ``dict.txt`` does not list them.
    """

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
    raise ValueError(f"unknown tokenizer {config.kind!r}")


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(config: TokenizerConfig) -> None:
    global _WORKER_TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_TOKENIZER = build_tokenizer(config)


def text_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    """The tokens of ``text`` as they go into the fairseq text file: every token split on
    whitespace, as fairseq's ``tokenize_line`` will split the line (keeps one line each)."""
    return [part for token in tokenizer.tokenize(text) for part in token.split()]


def _encode_chunk(job: tuple[int, list[str]]) -> tuple[int, list[str], list[int]]:
    """Tokenize a chunk of texts into space-joined lines (+ token counts)."""
    key, texts = job
    assert _WORKER_TOKENIZER is not None
    lines, lengths = [], []
    for text in texts:
        tokens = text_tokens(_WORKER_TOKENIZER, text)
        lines.append(" ".join(tokens))
        lengths.append(len(tokens))
    return key, lines, lengths


def tokenize_texts(
    config: TokenizerConfig,
    columns: Sequence[Sequence[str]],
    workers: int,
    desc: str = "tokenize",
    chunk_size: int = CHUNK_SIZE,
) -> tuple[list[list[str]], list[list[int]]]:
    """Tokenize several lists of texts (in parallel over chunks); keeps the order."""
    jobs: list[tuple[int, list[str]]] = []
    origin: list[int] = []  # column of each job
    for c, texts in enumerate(columns):
        for start in range(0, len(texts), chunk_size):
            jobs.append((len(jobs), list(texts[start : start + chunk_size])))
            origin.append(c)
    results: list[tuple[list[str], list[int]]] = [([], [])] * len(jobs)
    from tqdm import tqdm

    total = sum(len(texts) for texts in columns)
    with tqdm(total=total, desc=desc, unit="text", disable=None) as bar:
        if workers <= 1 or len(jobs) <= 1:
            _init_worker(config)
            stream: Iterable[tuple[int, list[str], list[int]]] = map(_encode_chunk, jobs)
            pool = None
        else:
            pool = multiprocessing.Pool(
                min(workers, len(jobs)), initializer=_init_worker, initargs=(config,)
            )
            stream = pool.imap_unordered(_encode_chunk, jobs)
        try:
            for key, lines, lengths in stream:
                results[key] = (lines, lengths)
                bar.update(len(lines))
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    out_lines: list[list[str]] = [[] for _ in columns]
    out_lengths: list[list[int]] = [[] for _ in columns]
    for (lines, lengths), c in zip(results, origin):
        out_lines[c].extend(lines)
        out_lengths[c].extend(lengths)
    return out_lines, out_lengths


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: Path,
    vocab_size: int,
    character_coverage: float,
    workers: int,
) -> Path:
    """Train a unigram SentencePiece model; the vocabulary size is capped to what data allows."""
    import sentencepiece as spm

    corpus = model_prefix.with_suffix(".train.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(text.replace("\r", " ") + "\n")
    try:
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=character_coverage,
            hard_vocab_limit=False,  # soft limit: small data gives a smaller vocabulary
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            num_threads=max(1, workers),
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataError(f"sentencepiece training failed: {e}") from None
    finally:
        corpus.unlink(missing_ok=True)
    return model_prefix.with_suffix(".model")


def sentencepiece_dictionary(model: Path, train_lines: Iterable[str], path: Path) -> int:
    """Write a fairseq dict.txt holding every piece of ``model`` (counts from the train data).

    One dictionary shared by input0 and input1 (``sentence_prediction`` uses input0's for both)
    and complete, so valid/test pieces unseen in train do not become ``<unk>``.
    """
    import sentencepiece as spm
    from fairseq.data import Dictionary

    sp = spm.SentencePieceProcessor(model_file=str(model))
    counts: Counter[str] = Counter()
    for line in train_lines:
        counts.update(line.split())
    dictionary = Dictionary()
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i):
            continue
        piece = sp.id_to_piece(i)
        dictionary.add_symbol(piece, n=counts.get(piece, 0))
    dictionary.finalize(threshold=0, padding_factor=8)
    dictionary.save(str(path))
    return len(dictionary)
