"""Few-shot fine-tuning on your own labelled data, by the study's protocol (docs/results.md):
CE, CE+SCL and ACL trained on k examples per class, each with the learning rate chosen on a dev
split of the same size, over several draws, with a table of means, per-draw differences and
paired tests.

For each k of --per-class and each draw d (1..--draws): k examples per class are drawn from the
pool (TSV, less the test split) for training and k per class from the rest of the pool for dev
(seeded by d, so a re-run draws the same); both are binarized with the test split; every method
trains --updates updates (validated every --validate-every, the best dev checkpoint kept) once
per learning rate of --lrs, with seed d; per method and draw the learning rate with the best
dev accuracy is chosen and its test accuracy reported. Each run is an acl-fairseq-compare run
(resumable: a finished run is not trained again).

Output (--out)::

    raw/k16-d1/{train,dev,test}.tsv   the draw        data/k16-d1-bin/   its binarized data
    runs/k16-d1/lr0.0001/...          acl-fairseq-compare's results at each learning rate
    fewshot.md, fewshot.json          the table; every dev and test accuracy and the choices

Example (a BERT converted by acl-fairseq-convert-bert into M/)::

    acl-fairseq-fewshot reviews.tsv --text-columns 1 --label-column 2 --header \\
        --test-size 2000 --per-class 16,64 --draws 5 --model M --out FEWSHOT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from acl_fairseq.console.help_format import HelpFormatter
from acl_fairseq.data.binarize import Options, prepare_tasks
from acl_fairseq.data.splits import fewshot_train_dev, split_off
from acl_fairseq.data.task_specs import (
    DataError,
    SplitSpec,
    TaskSpec,
    format_bad_rows,
    read_split,
    tsv_task,
)
from acl_fairseq.data.tokenizer_flags import (
    add_tokenizer_arguments,
    model_folder_tokenizer,
    tokenizer_config,
)
from acl_fairseq.experiment import fewshot

PROG = "acl-fairseq-fewshot"
Row = tuple[str, ...]


class FewshotError(ValueError):
    """A flag or input file that cannot work; the message names it."""


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
    p.add_argument("tsv", type=Path, help="labelled examples: the pool (and the test split)")
    p.add_argument("--text-columns", default="1", help="1-based text column(s): 1, or 1,2")
    p.add_argument("--label-column", type=int, default=2, help="1-based label column")
    p.add_argument("--header", action="store_true", help="the TSV files start with a header")
    test = p.add_mutually_exclusive_group(required=True)
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
    return p


def read_rows(path: Path, args: argparse.Namespace) -> list[Row]:
    """(text(s)..., label) of every row of a labelled TSV; bad rows are an error."""
    if not path.is_file():
        raise FewshotError(f"{path}: no such file")
    columns = tuple(int(c) for c in args.text_columns.split(","))
    spec = SplitSpec("train", str(path), columns, args.label_column, header=args.header)
    data, bad = read_split(path, spec, TaskSpec("fewshot", (spec,)), "train")
    if bad:
        raise FewshotError(f"{len(bad)} bad row(s) in {path}:\n{format_bad_rows(bad)}")
    if not data.labels:
        raise FewshotError(f"{path}: no labelled row")
    return [(*texts, label) for *texts, label in zip(*data.texts, data.labels)]


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


def write_tsv(path: Path, rows: Sequence[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")


def check_out(out: Path, args: argparse.Namespace, argv: Sequence[str]) -> None:
    """``--out`` holds this study (same data and split) or nothing yet."""
    record = out / "fewshot_input.json"
    files = [args.tsv] + ([args.test] if args.test else [])
    identity = {
        "files": {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
        "split": [args.text_columns, args.label_column, args.header, args.test_size],
    }
    if record.exists():
        if json.loads(record.read_text(encoding="utf-8")).get("identity") != identity:
            raise FewshotError(
                f"--out {out} holds a few-shot study of other data or another split: give "
                "another --out (its draws and runs would not be this data's)"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    payload = {"identity": identity, "command": shlex.join([PROG, *argv])}
    record.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


def prepare_draw(out: Path, name: str, splits: dict[str, list[Row]], opts: Options,
                 labels: tuple[str, ...]) -> Path:  # fmt: skip
    """The draw's TSV files and binarized folder (kept when prepared before)."""
    data = out / "data" / f"{name}-bin"
    if (data / "prepare_glue.json").is_file():
        return data
    raw = out / "raw" / name
    for split, rows in splits.items():
        write_tsv(raw / f"{split}.tsv", rows)
    inputs = len(splits["train"][0]) - 1
    task = tsv_task(name, raw / "train.tsv", raw / "dev.tsv", raw / "test.tsv",
                    tuple(range(1, inputs + 1)), inputs + 1, labels=labels)  # fmt: skip
    prepare_tasks([task], None, opts)
    return data


def run_compare(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "acl_fairseq.cli.compare", *args])
    if proc.returncode != 0:
        raise FewshotError(
            f"acl-fairseq-compare failed (exit {proc.returncode}): {shlex.join(args)}"
        )


def accuracies(out: Path, method: str, draw: int) -> tuple[float, float]:
    result = json.loads((out / "runs" / f"{method}-seed{draw}" / "test.json").read_text("utf-8"))
    return float(result["dev"]["accuracy"]), float(result["test"]["accuracy"])


def run(args: argparse.Namespace, argv: Sequence[str]) -> str:
    unknown = [m for m in args.methods if m not in fewshot.METHODS]
    if unknown:
        raise FewshotError(f"--methods: {', '.join(unknown)}; expected some of "
                           f"{', '.join(fewshot.METHODS)}")  # fmt: skip
    if args.draws < 1 or args.updates < 1 or args.validate_every < 1:
        raise FewshotError("--draws, --updates and --validate-every must be at least 1")
    model, config, srcdict = model_and_tokenizer(args)
    rows = read_rows(args.tsv, args)
    if args.test is not None:
        pool, test = rows, read_rows(args.test, args)
    else:
        try:
            pool, test = split_off(rows, args.test_size, seed=0)
        except ValueError as e:
            raise FewshotError(f"--test-size {args.test_size}: {e}") from None
    check_sizes(pool, args.per_class)
    labels = tuple(sorted({row[-1] for row in pool}))
    out = args.out.resolve()
    check_out(out, args, argv)
    opts = Options(out_dir=out / "data", tokenizer=config, srcdict=srcdict, workers=args.workers,
                   spm_vocab_size=args.spm_vocab_size)  # fmt: skip
    results = []
    for k in args.per_class:
        for draw in range(1, args.draws + 1):
            name = fewshot.draw_name(k, draw)
            train, dev = fewshot_train_dev(pool, k, draw)
            data = prepare_draw(out, name, {"train": train, "dev": dev, "test": test}, opts, labels)
            dev_by, test_by = {m: {} for m in args.methods}, {m: {} for m in args.methods}
            for lr in args.lrs:
                runs = out / "runs" / name / f"lr{lr:g}"
                run_compare(fewshot.compare_args(
                    data, runs, draw, lr, args.methods, args.updates, args.validate_every,
                    args.batch_size, args.contrastive_lambda, args.temperature,
                    [*model, *(["--cpu"] if args.cpu else [])], args.extra,
                ))  # fmt: skip
                for m in args.methods:
                    dev_by[m][lr], test_by[m][lr] = accuracies(runs, m, draw)
            results += [fewshot.DrawResult(k, draw, m, dev_by[m], test_by[m]) for m in args.methods]
    table = fewshot.report(results, len(test))
    (out / "fewshot.md").write_text(table, encoding="utf-8")
    record = [{"per_class": r.per_class, "draw": r.draw, "method": r.method, "lr": r.lr,
               "dev": r.dev, "test": r.test, "dev_by_lr": r.dev_by_lr,
               "test_by_lr": r.test_by_lr} for r in results]  # fmt: skip
    (out / "fewshot.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    logging.getLogger().setLevel(level)  # importing fairseq set the root logger to DEBUG
    try:
        table = run(args, argv)
    except (FewshotError, DataError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"\n{table}\nwrote {args.out / 'fewshot.md'} and {args.out / 'fewshot.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
