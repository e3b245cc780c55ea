"""Binarizing a task: its texts tokenized, then fairseq-preprocess of the tokenized splits into
``OUT/TASK-bin``, with the tokenizer's files and ``prepare_glue.json`` next to them."""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .prepared import write_meta
from .splits import overlaps
from .task_specs import BadRow, DataError, SplitData, TaskSpec, format_bad_rows, load_task
from .tokenizer.files import relative_to, store_tokenizer
from .tokenizer.kinds import TokenizerConfig
from .tokenizer.parallel import sentencepiece_dictionary, tokenize_texts, train_sentencepiece
from .vocab_check import check_srcdict_coverage

logger = logging.getLogger("prepare_glue")


def run_fairseq_preprocess(args: list[str], use_subprocess: bool = False) -> None:
    """Runs ``fairseq-preprocess ARGS``: in this process (fairseq imported once, not once per
    call), or with ``use_subprocess`` as the executable next to ``sys.executable``."""
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
    consoles = logging.getLogger().handlers  # not destdir/preprocess.log: it keeps the record
    for console in consoles:
        console.addFilter(_no_namespace)
    try:
        preprocess.main(parsed)
    finally:  # main() adds a FileHandler for destdir/preprocess.log on every call
        for console in consoles:
            console.removeFilter(_no_namespace)
        for handler in pre_logger.handlers[:]:
            if handler not in handlers:
                pre_logger.removeHandler(handler)
                handler.close()


def _no_namespace(record: logging.LogRecord) -> bool:
    """fairseq-preprocess logs its whole argument namespace first: not on the console."""
    return not isinstance(record.msg, argparse.Namespace)


@dataclass
class Options:
    """Parsed command line, minus the task selection."""

    out_dir: Path
    tokenizer: TokenizerConfig
    srcdict: Path | None
    spm_vocab_size: int = 8000
    spm_character_coverage: float = 1.0
    workers: int = 1
    max_tokens: int | None = 512  # None: no length warning (the caller checks lengths)
    skip_bad_rows: bool = False
    keep_intermediate: bool = False
    preprocess_subprocess: bool = False
    overlap: str = "warn"  # splits that share texts: "stop", "warn" or "allow" (said, kept)


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")


def prepare_tasks(tasks: Sequence[TaskSpec], glue_dir: Path | None, opts: Options) -> list[Path]:
    """Reads and checks every task's rows first, then prepares each; the TASK-bin folders.
    Bad rows stop everything unless ``opts.skip_bad_rows``."""
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
    for task, splits, _ in loaded:
        check_overlaps(task, splits, opts.overlap)
    return [prepare_task(task, splits, opts, len(bad)) for task, splits, bad in loaded]


def split_overlaps(task: TaskSpec, splits: Sequence[SplitData]) -> list[str]:
    """One line per two splits of ``task`` that share texts: how many rows, and the first
    rows by file and line."""
    rows = {s.name: [(*texts, "") for texts in zip(*s.texts)] for s in splits}
    named = {s.name: s for s in splits}
    lines = []
    for o in overlaps(rows):
        a, b = named[o.first], named[o.second]
        shown = [
            f"{b.path.name} line {b.line_numbers[j]} = {a.path.name} line {a.line_numbers[i]}"
            f" {_short(' / '.join(rows[o.second][j][:-1]))!r}"
            for i, j in o.pairs
        ]
        more = ", ..." if o.shared > len(o.pairs) else ""
        lines.append(
            f"{task.name}: {o.shared} of the {len(b)} {o.second} rows are {o.first} rows (the "
            f"same text): {', '.join(shown)}{more}"
        )
    return lines


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def check_overlaps(task: TaskSpec, splits: Sequence[SplitData], overlap: str = "stop") -> None:
    """Splits that share texts (a dev or test example seen in training scores higher than it
    should): ``DataError`` (``stop``) naming ``--allow-overlap``, a warning (``warn``), or a
    note that they are kept (``allow``)."""
    lines = split_overlaps(task, splits)
    if not lines:
        return
    if overlap == "stop":
        raise DataError(
            "; ".join(lines) + ": an example in training and in dev or test scores higher than "
            "it should; remove those rows, or pass --allow-overlap to keep them"
        )
    for line in lines:
        if overlap == "warn":
            logger.warning("%s (--allow-overlap: say that they are meant)", line)
        else:
            logger.info("%s (kept: --allow-overlap)", line)


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
    recorded = store_tokenizer(config, bin_dir)

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
            too_long += opts.max_tokens is not None and sum(row) + specials > opts.max_tokens
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
    if opts.srcdict is not None:
        train_lines = (line for i in range(task.num_inputs) for line in lines[i])
        check_srcdict_coverage(task.name, train_lines, opts.srcdict, config)

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
        "paths": "tokenizer paths are relative to this folder; splits.*.file (the input "
        "file at preparation, relative to this folder) is informational",
        "tokenizer": asdict(recorded),
        "num_inputs": task.num_inputs,
        "regression": task.regression,
        "num_classes": 1 if task.regression else len(train_labels),
        "labels": None if task.regression else train_labels,
        "label_divisor": task.label_divisor if task.regression else None,
        "splits": {s.name: {"file": relative_to(s.path, bin_dir), "rows": len(s)} for s in splits},
        "skipped_bad_rows": skipped,
        "too_long": too_long,
        "max_tokens": opts.max_tokens,
    }
    write_meta(bin_dir, meta)
    logger.info(
        "%s: wrote %s (%s)",
        task.name,
        bin_dir,
        ", ".join(f"{s.name}={len(s)}" for s in splits),
    )
