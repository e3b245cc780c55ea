"""Tokenizing a task's texts for preparation: in parallel over chunks, with the one text
encoder (``TextEncoder``), and the SentencePiece model and dictionary trained on them."""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..task_specs import DataError
from ..text_encoder import TextEncoder
from .kinds import TokenizerConfig, build_tokenizer

CHUNK_SIZE = 1000


_WORKER_ENCODER: TextEncoder | None = None


def _init_worker(config: TokenizerConfig) -> None:
    global _WORKER_ENCODER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_ENCODER = TextEncoder(build_tokenizer(config))


def _encode_chunk(job: tuple[int, list[str]]) -> tuple[int, list[str], list[int]]:
    """Tokenize a chunk of texts into space-joined lines (+ token counts)."""
    key, texts = job
    assert _WORKER_ENCODER is not None
    lines, lengths = [], []
    for text in texts:
        tokens = _WORKER_ENCODER.tokens(text)
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
    """Writes a dict.txt of every piece of ``model`` (counts from train): one for input0 and
    input1, and complete, so pieces unseen in train do not become ``<unk>``."""
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
