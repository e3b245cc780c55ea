#!/usr/bin/env python
"""Turn GLUE (or any TSV classification data) into fairseq binarized data.

The output layout is the one of fairseq's RoBERTa GLUE recipe
(``examples/roberta/preprocess_GLUE_tasks.sh``)::

    OUT/TASK-bin/input0/{dict.txt,train.*,valid.*,test.*}
    OUT/TASK-bin/input1/...                 (sentence-pair tasks only)
    OUT/TASK-bin/label/{dict.txt,train.*,valid.*}   (classification)
    OUT/TASK-bin/label/{train,valid}.label          (regression, plain floats)
    OUT/TASK-bin/prepare_glue.json                  (summary: num_classes, row counts, ...)

so that ``fairseq-train OUT/TASK-bin --task sentence_prediction ...`` works.

Conventions taken over from fairseq's recipe:

* MNLI: ``dev_matched`` becomes split ``valid`` and ``dev_mismatched`` becomes ``valid1``
  (``test_matched`` -> ``test``, ``test_mismatched`` -> ``test1``): the recipe passes
  ``--validpref matched,mismatched`` and fairseq-preprocess names the k-th extra prefix
  ``valid{k}``. Evaluate both with ``--valid-subset valid,valid1``.
* STS-B: the 0..5 similarity score is divided by 5.0 and written as plain text
  ``label/{train,valid}.label`` (the recipe's ``awk '{print $1 / 5.0}'``), for
  ``--regression-target --num-classes 1``.
* Test splits are binarized for the inputs only (GLUE test files have no labels).

Tokenizers (``--tokenizer``):

* ``gpt2``: RoBERTa's GPT-2 BPE (fairseq's ``gpt2_bpe_utils.get_encoder``), ids written as
  strings like ``multiprocessing_bpe_encoder.py``; ``--srcdict`` is RoBERTa's dict.txt.
* ``wordpiece``: BERT WordPiece (``tokenizers``) from a vocab.txt or tokenizer.json, without
  [CLS]/[SEP] (``<s>`` comes from ``--init-token 0``, ``</s>`` from binarization). BERT
  specials in the output become fairseq's: [UNK] -> ``<unk>``, [CLS] -> ``<s>``,
  [SEP] -> ``</s>``, [PAD] -> ``<pad>``, [MASK] -> ``<mask>`` (``<unk>`` if the dict lacks it).
  ``--srcdict`` is the dict.txt written by ``scripts/convert_hf_bert.py``.
* ``sentencepiece``: a unigram model trained per task on its training inputs (saved as
  ``TASK-bin/sentencepiece.model``). The dictionary is built here rather than by
  fairseq-preprocess, because input0 and input1 must share one dictionary
  (``sentence_prediction`` reads input0's for both): every piece of the model, ordered by
  training frequency, padded to a multiple of 8 like fairseq-preprocess does.

fairseq-preprocess runs in-process by default (fairseq is imported once instead of once per
call, several seconds each); ``--preprocess-subprocess`` runs the executable instead.

Unlike the recipe, rows with a missing field, an empty text or a label outside the task's
label set are never silently dropped: they are reported with file and line number and stop
the run, unless ``--skip-bad-rows`` is given.

Examples::

    python scripts/prepare_glue.py --glue-dir glue_data --out-dir glue-bin --tasks all \\
        --tokenizer gpt2 --gpt2-encoder-json encoder.json --gpt2-vocab-bpe vocab.bpe \\
        --srcdict dict.txt
    python scripts/prepare_glue.py --task custom --name reviews --train train.tsv \\
        --valid dev.tsv --text-columns 1 --label-column 2 --header --out-dir data-bin \\
        --tokenizer sentencepiece --spm-vocab-size 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger("prepare_glue")

TOKENIZERS = ("gpt2", "wordpiece", "sentencepiece")
MAX_LISTED_BAD_ROWS = 20
CHUNK_SIZE = 1000
META_FILE = "prepare_glue.json"
# BERT special tokens -> fairseq specials (the BERT converter drops these five from dict.txt).
WORDPIECE_SPECIALS = {
    "[UNK]": "<unk>",
    "[CLS]": "<s>",
    "[SEP]": "</s>",
    "[PAD]": "<pad>",
    "[MASK]": "<mask>",
}


class DataError(Exception):
    """A user-facing problem with the input data or the arguments (reported without traceback)."""


# --------------------------------------------------------------------------------------------
# Task table (data, not code)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitSpec:
    """One input file of a task: where its columns are (1-based, as ``cut -f``)."""

    kind: str  # "train", "valid" or "test"
    filename: str  # relative to GLUE_DIR/TASK, or an absolute path (custom mode)
    text_columns: tuple[int, ...]
    label_column: int | None  # None: unlabeled (GLUE test files)
    num_fields: int | None = None  # official number of tab-separated fields, None: unknown
    header: bool = True


@dataclass(frozen=True)
class TaskSpec:
    """A sentence(-pair) classification or regression task."""

    name: str
    splits: tuple[SplitSpec, ...]
    labels: tuple[str, ...] | None = None  # allowed labels; None: anything seen in train
    regression: bool = False
    label_range: tuple[float, float] | None = None
    label_divisor: float = 1.0  # regression targets are written as value / label_divisor
    strict_num_fields: bool = False  # rows with another field count are bad (QQP, as fairseq)

    @property
    def num_inputs(self) -> int:
        """Number of text inputs (1 or 2)."""
        return len(self.splits[0].text_columns)


def _glue_splits(
    fields: int,
    text_columns: tuple[int, ...],
    label_column: int,
    test_fields: int,
    test_columns: tuple[int, ...],
    header: bool = True,
) -> tuple[SplitSpec, ...]:
    """The usual train.tsv / dev.tsv / test.tsv triple."""
    return (
        SplitSpec("train", "train.tsv", text_columns, label_column, fields, header),
        SplitSpec("valid", "dev.tsv", text_columns, label_column, fields, header),
        SplitSpec("test", "test.tsv", test_columns, None, test_fields, True),
    )


BINARY = ("0", "1")
ENTAILMENT = ("entailment", "not_entailment")

GLUE_TASKS: dict[str, TaskSpec] = {
    "QQP": TaskSpec(
        "QQP", _glue_splits(6, (4, 5), 6, 3, (2, 3)), labels=BINARY, strict_num_fields=True
    ),
    "MNLI": TaskSpec(
        "MNLI",
        (
            SplitSpec("train", "train.tsv", (9, 10), 12, 12),
            SplitSpec("valid", "dev_matched.tsv", (9, 10), 16, 16),
            SplitSpec("valid", "dev_mismatched.tsv", (9, 10), 16, 16),
            SplitSpec("test", "test_matched.tsv", (9, 10), None, 10),
            SplitSpec("test", "test_mismatched.tsv", (9, 10), None, 10),
        ),
        labels=("contradiction", "entailment", "neutral"),
    ),
    "QNLI": TaskSpec("QNLI", _glue_splits(4, (2, 3), 4, 3, (2, 3)), labels=ENTAILMENT),
    "MRPC": TaskSpec("MRPC", _glue_splits(5, (4, 5), 1, 5, (4, 5)), labels=BINARY),
    "RTE": TaskSpec("RTE", _glue_splits(4, (2, 3), 4, 3, (2, 3)), labels=ENTAILMENT),
    "STS-B": TaskSpec(
        "STS-B",
        _glue_splits(10, (8, 9), 10, 9, (8, 9)),
        regression=True,
        label_range=(0.0, 5.0),
        label_divisor=5.0,
    ),
    "SST-2": TaskSpec("SST-2", _glue_splits(2, (1,), 2, 2, (2,)), labels=BINARY),
    # CoLA train/dev have no header line (the test file has one).
    "CoLA": TaskSpec("CoLA", _glue_splits(4, (4,), 2, 2, (2,), header=False), labels=BINARY),
}


def output_split_names(splits: Sequence[SplitSpec]) -> list[str]:
    """fairseq names: the k-th file of a kind is ``kind`` for k=0, else ``kind{k}``."""
    seen: Counter[str] = Counter()
    names = []
    for split in splits:
        k = seen[split.kind]
        names.append(split.kind if k == 0 else f"{split.kind}{k}")
        seen[split.kind] += 1
    return names


def resolve_tasks(value: str) -> list[TaskSpec]:
    """Parse ``--tasks`` (``all`` or a comma list, case- and hyphen-insensitive)."""
    lookup = {name.lower().replace("-", ""): spec for name, spec in GLUE_TASKS.items()}
    if value.strip().lower() == "all":
        return list(GLUE_TASKS.values())
    tasks = []
    for raw in value.split(","):
        key = raw.strip().lower().replace("-", "")
        if key not in lookup:
            raise DataError(
                f"unknown task {raw.strip()!r}; choose from {', '.join(GLUE_TASKS)}, all or custom"
            )
        if lookup[key] not in tasks:
            tasks.append(lookup[key])
    return tasks


# --------------------------------------------------------------------------------------------
# Reading and validating rows
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadRow:
    """A rejected row, reported as ``file:line: reason``."""

    path: Path
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class SplitData:
    """The good rows of one file: texts per input column and labels."""

    name: str  # fairseq split name (train, valid, valid1, test, ...)
    path: Path
    texts: list[list[str]]  # texts[input_index][row]
    labels: list[str] | None
    line_numbers: list[int] = field(default_factory=list)
    extra_field_rows: int = 0

    def __len__(self) -> int:
        return len(self.line_numbers)


def iter_tsv(path: Path, header: bool) -> Iterable[tuple[int, list[str] | None]]:
    """Yield ``(line_number, fields)`` for the data lines of a TSV file.

    Lines are split on ``\\n`` only and fields on ``\\t`` only, without any quoting, exactly
    like ``cut -f`` in fairseq's recipe (GLUE text contains quote characters). ``fields`` is
    None when the line is not valid UTF-8.
    """
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for index, raw in enumerate(lines):
        if header and index == 0:
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield index + 1, None
            continue
        if line.endswith("\r"):
            line = line[:-1]
        yield index + 1, line.split("\t")


def check_label(value: str, task: TaskSpec) -> str | None:
    """Return why ``value`` is not a valid label of ``task`` (None when it is)."""
    if not value:
        return "empty label"
    if task.regression:
        try:
            number = float(value)
        except ValueError:
            return f"label {value!r} is not a number"
        if not math.isfinite(number):
            return f"label {value!r} is not a finite number"
        if task.label_range is not None:
            low, high = task.label_range
            if not low <= number <= high:
                return f"label {value!r} is outside [{low:g}, {high:g}]"
        return None
    if task.labels is not None and value not in task.labels:
        return f"label {value!r} is not one of {', '.join(task.labels)}"
    if any(c.isspace() for c in value):
        return f"label {value!r} contains whitespace"
    return None


def check_row(
    fields: list[str] | None, split: SplitSpec, task: TaskSpec
) -> tuple[list[str], str | None, str | None]:
    """Validate one row; return ``(texts, label, reason)`` where ``reason`` is None if good."""
    if fields is None:
        return [], None, "line is not valid UTF-8"
    if task.strict_num_fields and split.num_fields and len(fields) != split.num_fields:
        return [], None, f"expected {split.num_fields} tab-separated fields, found {len(fields)}"
    columns = list(split.text_columns)
    if split.label_column is not None:
        columns.append(split.label_column)
    needed = max(columns)
    if len(fields) < needed:
        expected = split.num_fields or needed
        return (
            [],
            None,
            (
                f"missing field: expected {expected} tab-separated fields "
                f"(column {needed} needed), found {len(fields)}"
            ),
        )
    texts = [fields[c - 1].strip() for c in split.text_columns]
    for column, text in zip(split.text_columns, texts):
        if not text:
            return [], None, f"empty text in column {column}"
    label = None
    if split.label_column is not None:
        label = fields[split.label_column - 1].strip()
        reason = check_label(label, task)
        if reason:
            return [], None, f"{reason} (column {split.label_column})"
    return texts, label, None


def read_split(
    path: Path, split: SplitSpec, task: TaskSpec, name: str
) -> tuple[SplitData, list[BadRow]]:
    """Read one TSV file, keeping the good rows and returning the bad ones."""
    data = SplitData(
        name=name,
        path=path,
        texts=[[] for _ in split.text_columns],
        labels=[] if split.label_column is not None else None,
    )
    bad: list[BadRow] = []
    for line_number, fields in iter_tsv(path, split.header):
        texts, label, reason = check_row(fields, split, task)
        if reason is not None:
            bad.append(BadRow(path, line_number, reason))
            continue
        for column, text in zip(data.texts, texts):
            column.append(text)
        if data.labels is not None:
            data.labels.append(label)  # type: ignore[arg-type]
        data.line_numbers.append(line_number)
        if split.num_fields and fields is not None and len(fields) > split.num_fields:
            data.extra_field_rows += 1
    return data, bad


def split_path(task: TaskSpec, split: SplitSpec, glue_dir: Path | None) -> Path:
    """Where the file of ``split`` lives."""
    path = Path(split.filename)
    if path.is_absolute() or glue_dir is None:
        return path
    return glue_dir / task.name / split.filename


def load_task(task: TaskSpec, glue_dir: Path | None) -> tuple[list[SplitData], list[BadRow]]:
    """Read and validate all files of a task. Train/valid files are required, test optional."""
    names = output_split_names(task.splits)
    paths = [split_path(task, split, glue_dir) for split in task.splits]
    missing = [p for s, p in zip(task.splits, paths) if s.kind != "test" and not p.is_file()]
    if missing:
        raise DataError(f"{task.name}: missing input file(s): {', '.join(map(str, missing))}")
    missing_test = [p for s, p in zip(task.splits, paths) if s.kind == "test" and not p.is_file()]
    if missing_test:
        logger.warning(
            "%s: no test split (missing %s)", task.name, ", ".join(map(str, missing_test))
        )
    splits: list[SplitData] = []
    bad: list[BadRow] = []
    train_labels: set[str] = set()
    for spec, path, name in zip(task.splits, paths, names):
        if spec.kind == "test" and missing_test:
            continue
        data, split_bad = read_split(path, spec, task, name)
        if data.labels is not None and not task.regression:
            if spec.kind == "train":
                train_labels.update(data.labels)
            else:
                data, unseen = _drop_unseen_labels(data, train_labels)
                split_bad.extend(unseen)
        if len(data) == 0:
            raise DataError(f"{task.name}: {path} has no usable rows")
        if data.extra_field_rows:
            logger.warning(
                "%s: %d rows of %s have more than %d fields; columns are taken by position",
                task.name,
                data.extra_field_rows,
                path,
                spec.num_fields,
            )
        splits.append(data)
        bad.extend(split_bad)
    return splits, bad


def _drop_unseen_labels(data: SplitData, known: set[str]) -> tuple[SplitData, list[BadRow]]:
    """Reject rows whose label never occurs in the training data (fairseq would map it to unk)."""
    assert data.labels is not None
    keep = [i for i, label in enumerate(data.labels) if label in known]
    bad = [
        BadRow(data.path, data.line_numbers[i], f"label {label!r} does not occur in train")
        for i, label in enumerate(data.labels)
        if label not in known
    ]
    if not bad:
        return data, []
    data.texts = [[column[i] for i in keep] for column in data.texts]
    data.labels = [data.labels[i] for i in keep]
    data.line_numbers = [data.line_numbers[i] for i in keep]
    return data, bad


def format_bad_rows(bad: Sequence[BadRow], limit: int = MAX_LISTED_BAD_ROWS) -> str:
    """First ``limit`` bad rows, one per line, plus how many more there are."""
    lines = [f"  {row}" for row in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


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


def _encode_chunk(job: tuple[int, list[str]]) -> tuple[int, list[str], list[int]]:
    """Tokenize a chunk of texts into space-joined lines (+ token counts)."""
    key, texts = job
    assert _WORKER_TOKENIZER is not None
    lines, lengths = [], []
    for text in texts:
        # Split tokens on any whitespace, as fairseq's tokenize_line will: keeps one line each.
        tokens = [part for token in _WORKER_TOKENIZER.tokenize(text) for part in token.split()]
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


# --------------------------------------------------------------------------------------------
# fairseq-preprocess
# --------------------------------------------------------------------------------------------


def run_fairseq_preprocess(args: list[str], use_subprocess: bool = False) -> None:
    """Run ``fairseq-preprocess ARGS``.

    By default in this process through ``fairseq_cli.preprocess.main`` (importing fairseq
    costs several seconds, paid once instead of once per call); with ``use_subprocess`` as
    the ``fairseq-preprocess`` executable next to ``sys.executable`` (or ``python -m``).
    """
    logger.debug("fairseq-preprocess %s", " ".join(args))
    if use_subprocess:
        exe = Path(sys.executable).with_name("fairseq-preprocess")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fairseq_cli.preprocess"]
        result = subprocess.run(cmd + args, check=False)
        if result.returncode != 0:
            raise DataError(f"fairseq-preprocess failed (exit {result.returncode}): {args}")
        return
    from fairseq import options
    from fairseq_cli import preprocess

    parsed = options.get_preprocessing_parser().parse_args(args)
    pre_logger = logging.getLogger("fairseq_cli.preprocess")
    handlers = list(pre_logger.handlers)
    try:
        preprocess.main(parsed)
    finally:  # main() adds a FileHandler for destdir/preprocess.log on every call
        for handler in pre_logger.handlers[:]:
            if handler not in handlers:
                pre_logger.removeHandler(handler)
                handler.close()


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


@dataclass
class Options:
    """Parsed command line, minus the task selection."""

    out_dir: Path
    tokenizer: TokenizerConfig
    srcdict: Path | None
    spm_vocab_size: int = 8000
    spm_character_coverage: float = 1.0
    workers: int = 1
    max_tokens: int = 512
    skip_bad_rows: bool = False
    keep_intermediate: bool = False
    preprocess_subprocess: bool = False


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")


def prepare_task(task: TaskSpec, splits: list[SplitData], opts: Options, skipped: int) -> Path:
    """Tokenize and binarize one task into ``OUT/TASK-bin``; returns that folder."""
    bin_dir = opts.out_dir / f"{task.name}-bin"
    if bin_dir.exists():
        shutil.rmtree(bin_dir)
    bin_dir.mkdir(parents=True)
    if opts.keep_intermediate:
        tok_dir = opts.out_dir / f"{task.name}-tok"
        if tok_dir.exists():
            shutil.rmtree(tok_dir)
        tok_dir.mkdir(parents=True)
        cleanup = None
    else:
        cleanup = tempfile.TemporaryDirectory(prefix=f".{task.name}-tok-", dir=opts.out_dir)
        tok_dir = Path(cleanup.name)
    try:
        _prepare_task(task, splits, opts, skipped, bin_dir, tok_dir)
    finally:
        if cleanup is not None:
            cleanup.cleanup()
    return bin_dir


def _split_prefixes(splits: Sequence[SplitData], tok_dir: Path, suffix: str) -> list[str]:
    """``--trainpref/--validpref/--testpref`` arguments; several files of a kind comma-joined
    in order, which fairseq-preprocess writes as ``valid``, ``valid1``, ..."""
    args = []
    for kind in ("train", "valid", "test"):
        files = [str(tok_dir / f"{s.name}.{suffix}") for s in splits if s.name.startswith(kind)]
        if files:
            args += [f"--{kind}pref", ",".join(files)]
    return args


def _prepare_task(
    task: TaskSpec,
    splits: list[SplitData],
    opts: Options,
    skipped: int,
    bin_dir: Path,
    tok_dir: Path,
) -> None:
    config = opts.tokenizer
    srcdict = opts.srcdict
    if config.kind == "sentencepiece" and config.spm_model is None:
        train = splits[0]
        model = train_sentencepiece(
            (text for column in train.texts for text in column),
            bin_dir / "sentencepiece",
            opts.spm_vocab_size,
            opts.spm_character_coverage,
            opts.workers,
        )
        config = TokenizerConfig("sentencepiece", spm_model=str(model))
        logger.info("%s: trained sentencepiece model %s", task.name, model)
    elif config.kind == "sentencepiece":
        assert config.spm_model is not None
        shutil.copyfile(config.spm_model, bin_dir / "sentencepiece.model")

    columns = [column for split in splits for column in split.texts]
    lines, lengths = tokenize_texts(config, columns, opts.workers, desc=f"{task.name} tokenize")
    position = 0
    too_long = empty = total = 0
    for split in splits:
        split_lengths = lengths[position : position + task.num_inputs]
        for i in range(task.num_inputs):
            _write_lines(tok_dir / f"{split.name}.input{i}", lines[position + i])
        position += task.num_inputs
        specials = 2 if task.num_inputs == 1 else 4  # <s> a </s> (</s> b </s>)
        for row in zip(*split_lengths):
            total += 1
            too_long += sum(row) + specials > opts.max_tokens
            empty += any(n == 0 for n in row)
        if split.labels is not None and not task.regression:
            _write_lines(tok_dir / f"{split.name}.label", split.labels)
    if too_long:
        logger.warning(
            "%s: %d of %d examples are longer than --max-tokens=%d tokens (with <s>/</s>); "
            "fairseq's sentence_prediction truncates/skips them at train time",
            task.name,
            too_long,
            total,
            opts.max_tokens,
        )
    if empty:
        logger.warning("%s: %d examples have an input that produced no tokens", task.name, empty)

    if config.kind == "sentencepiece" and srcdict is None:
        assert config.spm_model is not None
        srcdict = tok_dir / "dict.txt"
        train_lines = (line for i in range(task.num_inputs) for line in lines[i])
        size = sentencepiece_dictionary(Path(config.spm_model), train_lines, srcdict)
        logger.info("%s: shared input dictionary with %d entries", task.name, size)
    assert srcdict is not None

    common = ["--only-source", "--workers", str(max(1, opts.workers))]
    for i in range(task.num_inputs):
        args = _split_prefixes(splits, tok_dir, f"input{i}")
        args += ["--destdir", str(bin_dir / f"input{i}"), "--srcdict", str(srcdict)]
        run_fairseq_preprocess(common + args, opts.preprocess_subprocess)

    label_dir = bin_dir / "label"
    labelled = [s for s in splits if s.labels is not None]
    if task.regression:
        label_dir.mkdir()
        for split in labelled:
            assert split.labels is not None
            values = (f"{float(v) / task.label_divisor:.6g}" for v in split.labels)
            _write_lines(label_dir / f"{split.name}.label", values)
    else:
        args = _split_prefixes(labelled, tok_dir, "label") + ["--destdir", str(label_dir)]
        run_fairseq_preprocess(common + args, opts.preprocess_subprocess)

    train_labels = sorted(set(splits[0].labels or []))
    meta = {
        "task": task.name,
        "tokenizer": asdict(config),
        "num_inputs": task.num_inputs,
        "regression": task.regression,
        "num_classes": 1 if task.regression else len(train_labels),
        "labels": None if task.regression else train_labels,
        "label_divisor": task.label_divisor if task.regression else None,
        "splits": {s.name: {"file": str(s.path), "rows": len(s)} for s in splits},
        "skipped_bad_rows": skipped,
        "too_long": too_long,
        "max_tokens": opts.max_tokens,
    }
    (bin_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    logger.info(
        "%s: wrote %s (%s)",
        task.name,
        bin_dir,
        ", ".join(f"{s.name}={len(s)}" for s in splits),
    )


def custom_task(args: argparse.Namespace) -> TaskSpec:
    """Build the TaskSpec of ``--task custom`` from the command line."""
    if not args.train or not args.valid or not args.text_columns or args.label_column is None:
        raise DataError("--task custom needs --train, --valid, --text-columns and --label-column")
    try:
        text_columns = tuple(int(c) for c in args.text_columns.split(","))
    except ValueError:
        raise DataError(f"--text-columns must be like 1 or 1,2: {args.text_columns!r}") from None
    if not 1 <= len(text_columns) <= 2 or min(text_columns) < 1 or args.label_column < 1:
        raise DataError("--text-columns takes one or two 1-based columns, --label-column one")
    labels = tuple(x.strip() for x in args.labels.split(",")) if args.labels else None
    splits = [
        SplitSpec(
            "train",
            str(Path(args.train).resolve()),
            text_columns,
            args.label_column,
            header=args.header,
        ),
        SplitSpec(
            "valid",
            str(Path(args.valid).resolve()),
            text_columns,
            args.label_column,
            header=args.header,
        ),
    ]
    if args.test:
        test_label = None if args.test_unlabeled else args.label_column
        splits.append(
            SplitSpec(
                "test", str(Path(args.test).resolve()), text_columns, test_label, header=args.header
            )
        )
    return TaskSpec(
        args.name,
        tuple(splits),
        labels=None if args.regression else labels,
        regression=args.regression,
        label_divisor=args.label_divisor,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        description="Binarize GLUE / TSV classification data for fairseq sentence_prediction.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--tasks",
        "--task",
        dest="tasks",
        default="all",
        help=f"'all', a comma list of {', '.join(GLUE_TASKS)}, or 'custom'",
    )
    p.add_argument("--glue-dir", type=Path, help="folder with CoLA/, SST-2/, ... (GLUE download)")
    p.add_argument("--out-dir", type=Path, required=True, help="writes OUT/TASK-bin/")
    p.add_argument("--tokenizer", choices=TOKENIZERS, required=True)
    p.add_argument(
        "--srcdict",
        type=Path,
        help="fairseq dict.txt of the model (required for gpt2 and wordpiece)",
    )
    p.add_argument("--gpt2-encoder-json", help="GPT-2 encoder.json (gpt2)")
    p.add_argument("--gpt2-vocab-bpe", help="GPT-2 vocab.bpe (gpt2)")
    p.add_argument("--vocab", help="BERT vocab.txt or tokenizer.json (wordpiece)")
    p.add_argument(
        "--lowercase",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lowercase for wordpiece (default: from tokenizer.json, else yes)",
    )
    p.add_argument(
        "--spm-vocab-size",
        type=int,
        default=8000,
        help="sentencepiece vocabulary size (upper bound; capped by the data)",
    )
    p.add_argument("--spm-character-coverage", type=float, default=1.0)
    p.add_argument("--spm-model", help="use this sentencepiece model instead of training one")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument(
        "--max-tokens", type=int, default=512, help="only warns about (counts) longer examples"
    )
    p.add_argument(
        "--skip-bad-rows", action="store_true", help="skip (and list) bad rows instead of stopping"
    )
    p.add_argument(
        "--keep-intermediate",
        action="store_true",
        help="keep the tokenized text files in OUT/TASK-tok/",
    )
    p.add_argument(
        "--preprocess-subprocess",
        action="store_true",
        help="run fairseq-preprocess as a subprocess instead of in-process",
    )
    g = p.add_argument_group("custom TSV data (--task custom)")
    g.add_argument("--name", default="custom", help="output is OUT/NAME-bin")
    g.add_argument("--train")
    g.add_argument("--valid")
    g.add_argument("--test")
    g.add_argument("--text-columns", help="1-based text column(s), e.g. 1 or 1,2")
    g.add_argument("--label-column", type=int, help="1-based label column")
    g.add_argument("--header", action="store_true", help="files start with a header line")
    g.add_argument("--labels", help="allowed labels, comma separated (default: any)")
    g.add_argument("--regression", action="store_true", help="labels are floats")
    g.add_argument(
        "--label-divisor",
        type=float,
        default=1.0,
        help="regression labels are written as value / divisor",
    )
    g.add_argument(
        "--test-unlabeled", action="store_true", help="the --test file has no label column"
    )
    return p


def _tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    """Check the tokenizer flags and collect them."""

    def need(*names: str) -> None:
        missing = [n for n in names if getattr(args, n.lstrip("-").replace("-", "_")) is None]
        if missing:
            raise DataError(f"--tokenizer {args.tokenizer} needs {', '.join(missing)}")

    if args.tokenizer == "gpt2":
        need("--gpt2-encoder-json", "--gpt2-vocab-bpe", "--srcdict")
    elif args.tokenizer == "wordpiece":
        need("--vocab", "--srcdict")
    elif args.srcdict is not None and args.spm_model is None:
        raise DataError("--srcdict with sentencepiece needs the matching --spm-model")
    if args.lowercase is not None and args.tokenizer != "wordpiece":
        logger.warning("--lowercase/--no-lowercase only applies to --tokenizer wordpiece")
    for name in ("gpt2_encoder_json", "gpt2_vocab_bpe", "vocab", "spm_model", "srcdict"):
        value = getattr(args, name)
        if value is not None and not Path(value).is_file():
            raise DataError(f"--{name.replace('_', '-')}: no such file {value}")
    return TokenizerConfig(
        kind=args.tokenizer,
        gpt2_encoder_json=args.gpt2_encoder_json,
        gpt2_vocab_bpe=args.gpt2_vocab_bpe,
        vocab=args.vocab,
        lowercase=args.lowercase,
        spm_model=args.spm_model,
    )


def run(args: argparse.Namespace) -> list[Path]:
    """Validate all selected tasks first, then prepare them; returns the TASK-bin folders."""
    config = _tokenizer_config(args)
    if args.tasks.strip().lower() == "custom":
        tasks = [custom_task(args)]
        glue_dir = None
    else:
        tasks = resolve_tasks(args.tasks)
        if args.glue_dir is None:
            raise DataError("--glue-dir is required for GLUE tasks")
        glue_dir = args.glue_dir
    out_dir = args.out_dir.resolve()
    if "," in str(out_dir):
        raise DataError("--out-dir must not contain ',' (fairseq-preprocess splits on it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = Options(
        out_dir=out_dir,
        tokenizer=config,
        srcdict=args.srcdict,
        spm_vocab_size=args.spm_vocab_size,
        spm_character_coverage=args.spm_character_coverage,
        workers=max(1, args.workers),
        max_tokens=args.max_tokens,
        skip_bad_rows=args.skip_bad_rows,
        keep_intermediate=args.keep_intermediate,
        preprocess_subprocess=args.preprocess_subprocess,
    )

    loaded = []
    all_bad: list[BadRow] = []
    for task in tasks:
        splits, bad = load_task(task, glue_dir)
        loaded.append((task, splits, bad))
        all_bad.extend(bad)
    if all_bad and not opts.skip_bad_rows:
        raise DataError(
            f"{len(all_bad)} bad row(s) (use --skip-bad-rows to skip them):\n"
            + format_bad_rows(all_bad)
        )
    if all_bad:
        logger.warning("skipping %d bad row(s):\n%s", len(all_bad), format_bad_rows(all_bad))
    return [prepare_task(task, splits, opts, len(bad)) for task, splits, bad in loaded]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except DataError as e:
        logger.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
    )
    sys.exit(main())
