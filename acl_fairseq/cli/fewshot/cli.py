"""Few-shot fine-tuning on your own labelled data, by the study's protocol (docs/results.md):
CE, CE+SCL and ACL trained on k examples per class, each with the learning rate chosen on a dev
split of the same size, over several draws, with a table of means, per-draw differences and
paired tests over draws and over examples.

The pool is the TSV less the test split (--test FILE, or --test-size rows held out of the
TSV): rows whose text is in the test split and rows repeating an earlier row's text are left
out of it (both counted in the output), so training, dev and test never share a text (checked
for every draw). For each k of --per-class and each draw d (1..--draws): k examples per class
are drawn from the pool for training and k per class from the rest of the pool for dev (seeded
by d, so a re-run draws the same); both are binarized with the test split; every method trains
--updates updates (validated every --validate-every, the best dev checkpoint kept) once per
learning rate of --lrs, with seed d; per method and draw the learning rate with the best dev
accuracy is chosen and its test accuracy reported. Each run is an acl-fairseq-compare run
(resumable: a finished run is not trained again).

The table (fewshot.md, and its rows in fewshot.json): per k, each method's mean test accuracy;
per pair of methods the per-draw differences, the paired t-test over draws, the exact McNemar
test over the test examples pooled over the draws (the chosen runs' predictions.tsv) with a
paired bootstrap interval, each test Holm-corrected over every row, and a verdict (better /
worse) only when both corrected p-values are below 0.05, else "no verdict" (not a finding of no
difference).

A re-run with the same --out continues the study: more sizes, draws, methods or learning
rates are added; a setting that changes the data or the training (the input files, columns,
tokenizer, model, updates, batch size, lambda, --extra, ...) stops with what differs, where
--force deletes the study's draws and runs first and starts over. --report-only rebuilds the
table from the finished runs of --out without any input file.

Output (--out)::

    raw/k16-d1/{train,dev,test}.tsv   the draw        data/k16-d1-bin/   its binarized data
    runs/k16-d1/lr0.0001/...          acl-fairseq-compare's results at each learning rate
    fewshot.md, fewshot.json          the table; every dev and test accuracy, the choices and
                                      the paired tests
    fewshot_input.json                the settings a re-run is checked against

Example (a BERT converted by acl-fairseq-convert-bert into M/)::

    acl-fairseq-fewshot reviews.tsv --text-columns 1 --label-column 2 --header \\
        --test-size 2000 --per-class 16,64 --draws 5 --model M --out FEWSHOT
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from acl_fairseq.atomic_write import write_json, write_text
from acl_fairseq.cli import HelpFormatter
from acl_fairseq.data.binarize import Options, prepare_tasks
from acl_fairseq.data.splits import check_disjoint, fewshot_train_dev
from acl_fairseq.data.task_specs import tsv_task
from acl_fairseq.data.tokenizer.flags import (
    add_tokenizer_arguments,
    model_folder_tokenizer,
    tokenizer_config,
)
from acl_fairseq.errors import run_tool
from acl_fairseq.experiment import commands, fewshot
from acl_fairseq.experiment.fewshot_report import comparison_rows, report

from . import record
from .pool import FewshotError, Row, pool_and_test

PROG = "acl-fairseq-fewshot"


def _list(kind: type, what: str):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what}: expected a comma list, got {text!r}"
            ) from None
        if not values or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{what}: expected distinct values, got {text!r}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("tsv", type=Path, nargs="?",
                   help="labelled examples: the pool (and the test split)")  # fmt: skip
    p.add_argument("--text-columns", default="1", help="1-based text column(s): 1, or 1,2")
    p.add_argument("--label-column", type=int, default=2, help="1-based label column")
    p.add_argument("--header", action="store_true", help="the TSV files start with a header")
    test = p.add_mutually_exclusive_group()
    test.add_argument("--test", type=Path, help="labelled test TSV (same columns)")
    test.add_argument("--test-size", type=int, help="or: hold out this many rows of TSV")
    p.add_argument("--per-class", type=_list(int, "--per-class"), default=[16],
                   help="k: training (and dev) examples per class, a comma list")  # fmt: skip
    p.add_argument("--draws", type=int, default=5, help="draws per k (seeds 1..N)")
    p.add_argument("--methods", type=_list(str, "--methods"), default=list(fewshot.METHODS),
                   help=f"comma list of {','.join(fewshot.METHODS)}")  # fmt: skip
    p.add_argument("--lrs", type=_list(float, "--lrs"), default=list(fewshot.LEARNING_RATES),
                   help="learning rates tried, chosen per method and draw on dev")  # fmt: skip
    p.add_argument("--updates", type=int, default=fewshot.UPDATES, help="updates of every run")
    p.add_argument("--validate-every", type=int, default=fewshot.VALIDATE_EVERY)
    p.add_argument("--batch-size", type=int, default=fewshot.BATCH_SIZE)
    p.add_argument("--contrastive-lambda", type=float, default=fewshot.CONTRASTIVE_LAMBDA)
    p.add_argument("--temperature", type=float, default=fewshot.TEMPERATURE)
    g = p.add_argument_group("the model and its tokenizer")
    g.add_argument("--model", type=Path, help="a folder of acl-fairseq-convert-bert: its "
                   "model.pt, fairseq_args.txt, dict.txt and WordPiece tokenizer")  # fmt: skip
    g.add_argument("--restore-file", help="pretrained checkpoint ('none': from scratch)")
    arch = g.add_mutually_exclusive_group()
    arch.add_argument("--arch-args-file", help="file with the model flags (fairseq_args.txt)")
    arch.add_argument("--arch-args", help="model flags, e.g. '--arch roberta_base'")
    add_tokenizer_arguments(g, required=False)
    p.add_argument("--exit-pooling", choices=("first", "mean"), default="mean")
    p.add_argument("--extra", default="", help="more fairseq-train flags for every run")
    p.add_argument("--workers", type=int, default=1, help="of the data preparation")
    p.add_argument("--cpu", action="store_true", help="train on CPU")
    p.add_argument("--out", type=Path, default=Path("FEWSHOT"), help="results folder")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--force", action="store_true", help="delete the draws, data and runs "
                       "of --out first and start over (its settings differ)")  # fmt: skip
    again.add_argument("--report-only", action="store_true", help="only rebuild the "
                       "table from the finished runs of --out (no training, no input)")  # fmt: skip
    return p


def check_flags(args: argparse.Namespace) -> None:
    """Every number and list of the command line, before anything is read or trained."""
    if args.tsv is None or (args.test is None and args.test_size is None):
        raise FewshotError("give the TSV and --test FILE or --test-size N (or --report-only)")
    check_out(args.out)
    unknown = [m for m in args.methods if m not in fewshot.METHODS]
    if unknown:
        raise FewshotError(f"--methods: {', '.join(unknown)}; expected some of "
                           f"{', '.join(fewshot.METHODS)}")  # fmt: skip
    small = [f"--per-class {k}" for k in args.per_class if k < 1]
    small += [f"--{name.replace('_', '-')} {getattr(args, name)}"
              for name in ("draws", "updates", "validate_every", "batch_size", "workers")
              if getattr(args, name) < 1]  # fmt: skip
    small += [f"--test-size {args.test_size}"] if args.test_size is not None and (
        args.test_size < 1) else []  # fmt: skip
    if small:
        raise FewshotError(f"{', '.join(small)}: must be at least 1")
    if any(lr <= 0 for lr in args.lrs) or args.temperature <= 0 or args.contrastive_lambda < 0:
        raise FewshotError("--lrs and --temperature must be above 0, --contrastive-lambda at "
                           "least 0")  # fmt: skip
    try:
        columns = [int(c) for c in args.text_columns.split(",")]
    except ValueError:
        columns = []
    if not 1 <= len(columns) <= 2 or min(columns) < 1 or args.label_column < 1:
        raise FewshotError(f"--text-columns {args.text_columns} --label-column "
                           f"{args.label_column}: one or two 1-based text columns and a "
                           "1-based label column")  # fmt: skip
    if args.label_column in columns:
        raise FewshotError(f"--label-column {args.label_column} is a text column too")
    try:
        fewshot.protocol_extra(args.extra)
    except ValueError as e:
        raise FewshotError(f"--extra {args.extra!r}: {e}") from None


def check_out(out: Path) -> None:
    """``--out`` is a folder, or not there yet (it is made)."""
    if out.exists() and not out.is_dir():
        raise FewshotError(
            f"--out {out}: a file, not a folder: give a folder for the study (made if missing)"
        )


def model_and_tokenizer(args: argparse.Namespace):
    """(compare's model flags, tokenizer config, srcdict) from --model or the explicit flags."""
    model: list[str] = ["--exit-pooling", args.exit_pooling]
    if args.model is not None:
        config, srcdict = model_folder_tokenizer(args.model)
        restore = args.restore_file or str(args.model / "model.pt")
        arch = ["--arch-args-file", args.arch_args_file or str(args.model / "fairseq_args.txt")]
        if args.arch_args:
            arch = ["--arch-args", args.arch_args]
        return [*model, "--restore-file", restore, *arch], config, srcdict
    if args.tokenizer is None:
        raise FewshotError("give --model M (a converted BERT) or --tokenizer and its files")
    if not (args.arch_args_file or args.arch_args):
        raise FewshotError("give the model flags: --arch-args-file FILE or --arch-args '...'")
    arch = ["--arch-args-file", args.arch_args_file] if args.arch_args_file else [
        "--arch-args", args.arch_args]  # fmt: skip
    model += ["--restore-file", args.restore_file or "none", *arch]
    return model, tokenizer_config(args), args.srcdict


def check_sizes(pool: list[Row], sizes: Sequence[int]) -> None:
    """Every class needs 2 x k examples in the pool (training and dev sets)."""
    counts: dict[str, int] = {}
    for row in pool:
        counts[row[-1]] = counts.get(row[-1], 0) + 1
    k = max(sizes)
    short = {label: n for label, n in sorted(counts.items()) if n < 2 * k}
    if short:
        listed = ", ".join(f"{label!r} {n}" for label, n in short.items())
        raise FewshotError(
            f"--per-class {k}: the pool has too few examples of {listed}; each draw takes "
            f"{k} per class for training and {k} for dev ({2 * k} per class)"
        )


def tsv_text(rows: Sequence[Row]) -> str:
    return "".join("\t".join(row) + "\n" for row in rows)


def prepare_draw(out: Path, name: str, splits: dict[str, list[Row]], opts: Options,
                 labels: tuple[str, ...]) -> Path:  # fmt: skip
    """The draw's TSV files and binarized folder; a folder prepared before is kept when it
    holds these very rows, and refused when it holds others (its runs are not this draw's)."""
    data, raw = out / "data" / f"{name}-bin", out / "raw" / name
    texts = {split: tsv_text(rows) for split, rows in splits.items()}
    if (data / "prepare_glue.json").is_file():
        files = {split: raw / f"{split}.tsv" for split in texts}
        if all(f.is_file() and f.read_text(encoding="utf-8") == texts[s] for s, f in files.items()):
            return data
        raise FewshotError(
            f"--out {out}: its draw {name} holds other rows than this command draws (drawn by "
            "an earlier version, which left repeated texts or the test split's texts in the "
            "pool, or from other data): its runs are not this draw's. Pass --force to start "
            "over, or give another --out"
        )
    raw.mkdir(parents=True, exist_ok=True)
    for split, text in texts.items():
        write_text(raw / f"{split}.tsv", text)
    inputs = len(splits["train"][0]) - 1
    task = tsv_task(name, raw / "train.tsv", raw / "dev.tsv", raw / "test.tsv",
                    tuple(range(1, inputs + 1)), inputs + 1, labels=labels)  # fmt: skip
    prepare_tasks([task], None, opts)
    return data


def run_compare(args: list[str]) -> None:
    proc = commands.run([sys.executable, "-m", "acl_fairseq.cli.compare", *args])
    if proc.returncode != 0:
        raise FewshotError(
            f"acl-fairseq-compare failed (exit {proc.returncode}): {shlex.join(args)} (if it "
            "says a run was trained with other flags: pass --force to start over, or give "
            "another --out)"
        )


def write_report(
    out: Path, results: list[fewshot.DrawResult], test_size: int | None, leaks: Sequence[str] = ()
) -> str:
    """fewshot.md (the table, and a warning per draw whose splits share a text) and
    fewshot.json (every draw's numbers, the table's rows, the warnings)."""
    table = report(results, test_size)
    if leaks:
        table += "\n" + "".join(f"**Warning**: {leak}\n" for leak in leaks)
    write_text(out / "fewshot.md", table)
    draws = [{"per_class": r.per_class, "draw": r.draw, "method": r.method, "lr": r.lr,
              "dev": r.dev, "test": r.test, "dev_by_lr": r.dev_by_lr,
              "test_by_lr": r.test_by_lr} for r in results]  # fmt: skip
    payload = {"test_size": test_size, "draws": draws, "comparisons": comparison_rows(results)}
    payload["warnings"] = list(leaks)
    write_json(out / "fewshot.json", payload)
    return table


def read_results(out: Path, grid: dict) -> list[fewshot.DrawResult]:
    results = []
    for k in grid["per_class"]:
        for draw in range(1, grid["draws"] + 1):
            results += fewshot.read_draw(out, k, draw, grid["methods"], grid["lrs"])
    return results


def shared_texts(out: Path, grid: dict) -> list[str]:
    """Each draw of ``out`` whose training, dev and test files share a text (drawn by a
    version that left the test split's or repeated texts in the pool): what it means."""
    found = []
    for k in grid["per_class"]:
        for draw in range(1, grid["draws"] + 1):
            raw = out / "raw" / fewshot.draw_name(k, draw)
            files = {split: raw / f"{split}.tsv" for split in ("train", "dev", "test")}
            if not all(f.is_file() for f in files.values()):
                continue
            rows = {split: [tuple(line.split("\t")) for line in f.read_text("utf-8").splitlines()]
                    for split, f in files.items()}  # fmt: skip
            try:
                check_disjoint(rows)
            except ValueError as e:
                found.append(f"draw {raw.name}: {e}: its dev or test accuracy counts examples "
                             "it was trained or chosen on")  # fmt: skip
    return found


def report_only(args: argparse.Namespace) -> str:
    """The table of ``--out``'s finished runs, at the grid of its last run."""
    check_out(args.out)
    out = args.out.resolve()
    grid = record.recorded_grid(out, build_parser().parse_args)
    try:
        results = read_results(out, grid)
    except FileNotFoundError as e:
        raise FewshotError(f"--report-only: {e}; run the study (without --report-only) to "
                           "finish it") from None  # fmt: skip
    leaks = shared_texts(out, grid)
    for leak in leaks:
        print(f"{PROG}: warning: {leak}", file=sys.stderr)
    sizes = {len(r.test_correct) for r in results if r.test_correct is not None}
    return write_report(out, results, sizes.pop() if len(sizes) == 1 else None, leaks)


def run(args: argparse.Namespace, argv: Sequence[str]) -> str:
    if args.report_only:
        return report_only(args)
    check_flags(args)
    model, config, srcdict = model_and_tokenizer(args)
    pool, test = pool_and_test(args)
    check_sizes(pool, args.per_class)
    labels = tuple(sorted({row[-1] for row in pool}))
    out = args.out.resolve()
    if args.force and record.start_over(out):
        print(f"--force: deleted the draws, data and runs in {out}", flush=True)
    record.check_and_record(out, args, argv, record.grid_of(args), build_parser().parse_args,
                            PROG)  # fmt: skip
    # max_tokens: no length warning from the binarizing; each draw is checked against the
    # model's positions below, with the fix this command takes
    opts = Options(out_dir=out / "data", tokenizer=config, srcdict=srcdict, workers=args.workers,
                   spm_vocab_size=args.spm_vocab_size, max_tokens=None,
                   spm_character_coverage=args.spm_character_coverage)  # fmt: skip
    positions = fewshot.model_positions(model, fewshot.protocol_extra(args.extra))
    results = []
    for k in args.per_class:
        for draw in range(1, args.draws + 1):
            name = fewshot.draw_name(k, draw)
            train, dev = fewshot_train_dev(pool, k, draw)
            splits = {"train": train, "dev": dev, "test": test}
            try:
                check_disjoint(splits)
            except ValueError as e:
                raise FewshotError(f"draw {name}: {e}") from None
            data = prepare_draw(out, name, splits, opts, labels)
            fewshot.check_positions(data, name, positions, args.extra)  # before any training
            for lr in args.lrs:
                run_compare(fewshot.compare_args(
                    data, fewshot.runs_folder(out, k, draw, lr), draw, lr, args.methods,
                    args.updates, args.validate_every, args.batch_size,
                    args.contrastive_lambda, args.temperature,
                    [*model, *(["--cpu"] if args.cpu else [])], args.extra,
                ))  # fmt: skip
            results += fewshot.read_draw(out, k, draw, args.methods, args.lrs)
    return write_report(out, results, len(test))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``acl-fairseq-fewshot`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    logging.getLogger().setLevel(level)  # importing fairseq set the root logger to DEBUG
    return run_tool(PROG, study, args, argv)


def study(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Runs (or only reports) the study and prints its table."""
    table = run(args, argv)
    print(f"\n{table}\nwrote {args.out / 'fewshot.md'} and {args.out / 'fewshot.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
