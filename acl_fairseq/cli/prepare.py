"""``acl-fairseq-prepare``: GLUE (or any TSV classification data) into fairseq binarized data.

The layout of fairseq's RoBERTa GLUE recipe, ``OUT/TASK-bin/{input0,input1,label}/`` plus
``prepare_glue.json``, with its conventions (MNLI's mismatched dev is ``valid1``; STS-B's score
is divided by 5; test splits without labels). Tokenizers: ``gpt2``, ``wordpiece``,
``sentencepiece`` (one dictionary for input0 and input1). Bad rows are reported by file and
line and stop the run unless ``--skip-bad-rows``; what skipping cannot fix always stops it.
Details: scripts/glue/README.md and docs/usage.md, "Data".

Examples::

    acl-fairseq-prepare --glue-dir glue_data --out-dir glue-bin --tasks all \\
        --tokenizer gpt2 --gpt2-encoder-json encoder.json --gpt2-vocab-bpe vocab.bpe \\
        --srcdict dict.txt
    acl-fairseq-prepare --task custom --name reviews --train train.tsv \\
        --valid dev.tsv --text-columns 1 --label-column 2 --header --out-dir data-bin \\
        --tokenizer sentencepiece --spm-vocab-size 8000
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from acl_fairseq.data.binarize import Options, prepare_tasks
from acl_fairseq.data.task_specs import GLUE_TASKS, DataError, TaskSpec, resolve_tasks, tsv_task
from acl_fairseq.data.tokenizer.flags import add_tokenizer_arguments, tokenizer_config
from acl_fairseq.errors import run_tool

PROG = "acl-fairseq-prepare"


def custom_task(args: argparse.Namespace) -> TaskSpec:
    """The TaskSpec of ``--task custom`` from the command line."""
    if not args.train or not args.valid or not args.text_columns or args.label_column is None:
        raise DataError("--task custom needs --train, --valid, --text-columns and --label-column")
    try:
        text_columns = tuple(int(c) for c in args.text_columns.split(","))
    except ValueError:
        raise DataError(f"--text-columns must be like 1 or 1,2: {args.text_columns!r}") from None
    if not 1 <= len(text_columns) <= 2 or min(text_columns) < 1 or args.label_column < 1:
        raise DataError("--text-columns takes one or two 1-based columns, --label-column one")
    return tsv_task(
        args.name,
        args.train,
        args.valid,
        args.test,
        text_columns,
        args.label_column,
        header=args.header,
        labels=tuple(x.strip() for x in args.labels.split(",")) if args.labels else None,
        regression=args.regression,
        label_divisor=args.label_divisor,
        test_unlabeled=args.test_unlabeled,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog=PROG,
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
    add_tokenizer_arguments(p)
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
    p.add_argument(
        "--allow-overlap",
        action="store_true",
        help="keep rows of dev or test whose text is also in train (or in each other): "
        "reported and, for --task custom, refused without this flag (GLUE: a warning)",
    )
    return p


def run(args: argparse.Namespace) -> list[Path]:
    """Validate all selected tasks first, then prepare them; returns the TASK-bin folders."""
    config = tokenizer_config(args)
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
        overlap="allow" if args.allow_overlap else "stop" if glue_dir is None else "warn",
    )

    return prepare_tasks(tasks, glue_dir, opts)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``acl-fairseq-prepare`` command (logging to stderr); returns the exit status."""
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=level)
    logging.getLogger().setLevel(level)  # importing fairseq set the root logger to DEBUG
    return run_tool(PROG, _prepare, build_parser().parse_args(argv))


def _prepare(args: argparse.Namespace) -> int:
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
