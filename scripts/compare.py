#!/usr/bin/env python
"""Compare fine-tuning methods over several seeds: CE, CE+SCL, ACL, and multi-exit joint CE
versus ACL-CL, with checkpoints chosen on dev and accuracy reported on a held-out test split.

Methods (every run: ``fairseq-train --task acl_sentence_prediction``, the demo's optimizer):

  ce                fairseq's ``sentence_prediction`` criterion (plain CE), final exit only
  ce_scl            CE + SCL (``--criterion ce_scl``, Gunel et al.); run by default with
                    ``--acl-grad --acl-grad-threshold 180``: the CE/SCL gradient angle is
                    measured and logged every update (for the angle histogram) but the SCL
                    term is never dropped, so the objective is plain CE+SCL (at the cost of a
                    second backward pass; ``--ce-scl-plain`` turns the measurement off)
  acl               CE + ACL-Embed with ACL-Grad (``--criterion acl_embed``,
                    ``--acl-grad-threshold``, default 90)
  multi_exit_joint  stage 2 of the joint baseline: the multi-exit model restored from the CE
                    run's best checkpoint (same seed), joint weighted CE over every exit
                    (``--criterion multi_exit_ce``)
  acl_cl            stage 2 of ACL: the multi-exit model restored from the acl run's best
                    checkpoint (same seed), ``--criterion acl_cross_layer``

Every run uses the multi-exit architecture (``--arch roberta`` -> ``multi_exit_roberta``,
``roberta_base`` -> ``multi_exit_roberta_base``, ...); the single-exit methods with
``--exit-layers none``, so that ``--exit-pooling`` means the same for every method and stage 2
restores a final head trained with the pooling it is used with. With ``--exit-pooling first``
such a model computes exactly what plain RoBERTa computes. A multi-exit method whose stage-1
method is not in ``--methods`` gets its stage-1 run added.

For each run the best checkpoint on ``valid`` (dev) is kept (``--best-checkpoint-metric
accuracy``); its dev accuracy is the best validation record of the training log, and
``fairseq-validate --valid-subset test`` on that checkpoint gives the held-out numbers (per exit
for the multi-exit methods).

Output (``--out``, default ``RESULTS``)::

    runs/<method>-seed<k>/            train.log (fairseq JSON log), angles.tsv (ACL-Grad log:
                                      update, angle, kept), command.txt, run.json,
                                      checkpoint_best.pt, test.log, test.json (the numbers)
    runs/<method>-lam<l>-seed<k>/     the lambda sweep (--lambdas), same files; checkpoints
                                      deleted after evaluation unless --keep-sweep-checkpoints
    results.md                        Markdown tables: mean, sample std and per-seed values
    results.csv                       every number of every run (long format)
    summary.csv                       mean / std / n per method, lambda and metric

``results.md`` / ``*.csv`` are rebuilt from every ``runs/*/test.json`` in the folder, so
several invocations (main comparison, lambda sweep) add up to one report; ``--report-only``
only rebuilds them.

Resumable: a run whose ``test.json`` exists is not run again (``--force`` re-runs), a run whose
training finished but whose evaluation did not is only evaluated, and a stage-2 run is trained
again when its stage-1 run was. A finished run made with other flags than the ones asked for now
stops the script (use ``--force`` or another ``--out``).

Lambda sweep (``--lambdas 0.1,0.5,1.0``): ce_scl and acl (those of them in ``--methods``) are
also run with each ``--contrastive-lambda`` value, named ``<method>-lam<l>-seed<k>``; the value
equal to ``--contrastive-lambda`` is the main run itself (same flags, not trained twice).
``results.md`` then reports dev and test accuracy per lambda and the lambda chosen on dev.

Example (the demo's data and converted MiniLM)::

    python scripts/compare.py demo_work/data/rt-bin \\
        --restore-file demo_work/minilm-fairseq/model.pt \\
        --arch-args-file demo_work/minilm-fairseq/fairseq_args.txt \\
        --seeds 1,2,3 --lr 5e-5 --batch-size 16 --epochs 1 --exit-pooling mean --out RESULTS
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "acl_fairseq"
BIN = Path(sys.executable).parent

METHODS = ("ce", "ce_scl", "acl", "multi_exit_joint", "acl_cl")
MULTI_EXIT_METHODS = ("multi_exit_joint", "acl_cl")
SWEEP_METHODS = ("ce_scl", "acl")
CONTRASTIVE_METHODS = ("ce_scl", "acl", "acl_cl")
STAGE1 = {"multi_exit_joint": "ce", "acl_cl": "acl"}
MULTI_EXIT_ARCH = {
    "roberta": "multi_exit_roberta",
    "roberta_base": "multi_exit_roberta_base",
    "roberta_large": "multi_exit_roberta_large",
}
RESET_FLAGS = ("--reset-optimizer", "--reset-dataloader", "--reset-meters", "--reset-lr-scheduler")
CE_SCL_ANGLE_THRESHOLD = 180.0  # the angle never exceeds 180 degrees: nothing is dropped
# metrics of test.json's "dev" / "test" that go into results.csv (losses are left out)
_METRIC_RE = re.compile(r"^accuracy(_exit\d+)?$|^(f1|mcc|acc_and_f1)$")


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Run:
    """One fairseq-train run (and its evaluation)."""

    method: str
    seed: int
    lam: float | None  # --contrastive-lambda (None: the method has no contrastive term)
    sweep: bool = False  # a lambda-sweep run with a lambda other than the main one

    @property
    def name(self) -> str:
        if self.sweep:
            return f"{self.method}-lam{format_lambda(self.lam)}-seed{self.seed}"
        return f"{self.method}-seed{self.seed}"

    @property
    def multi_exit(self) -> bool:
        return self.method in MULTI_EXIT_METHODS

    @property
    def stage1(self) -> Run | None:
        """The run whose best checkpoint this (stage-2) run restores."""
        if self.method not in STAGE1:
            return None
        first = STAGE1[self.method]
        return Run(first, self.seed, self.lam if first in CONTRASTIVE_METHODS else None)


def format_lambda(lam: float | None) -> str:
    return "" if lam is None else f"{lam:g}"


def parse_list(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: expected a comma list, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{what}: duplicate value in {text!r}")
    return values


def plan_runs(
    methods: Sequence[str],
    seeds: Sequence[int],
    base_lambda: float,
    lambdas: Sequence[float] | None = None,
) -> list[Run]:
    """Runs in an order that trains every stage-1 run before the stage-2 run restoring it:
    seed by seed, all methods of a seed in ``METHODS`` order; then the lambda sweep."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; expected some of {list(METHODS)}")
    wanted = set(methods) | {STAGE1[m] for m in methods if m in STAGE1}
    runs: list[Run] = []
    for seed in seeds:
        for method in METHODS:
            if method in wanted:
                lam = base_lambda if method in CONTRASTIVE_METHODS else None
                runs.append(Run(method, seed, lam))
    for seed in seeds:
        for method in SWEEP_METHODS:
            if method not in methods:
                continue
            for lam in lambdas or ():
                run = Run(method, seed, lam, sweep=not math.isclose(lam, base_lambda))
                if run not in runs:
                    runs.append(run)
    return runs


# ----------------------------------------------------------------------------- commands


def read_arch_args(file: str | None, text: str | None) -> list[str]:
    """The model flags (``--arch ...``) without ``--restore-file`` and ``--reset-*``."""
    if file:
        args = shlex.split(Path(file).read_text(encoding="utf-8"))
    else:
        args = shlex.split(text or "")
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--restore-file":
            skip = True
            continue
        if arg.startswith("--restore-file=") or arg in RESET_FLAGS:
            continue
        out.append(arg)
    if not any(a in ("--arch", "-a") or a.startswith("--arch=") for a in out):
        raise SystemExit(
            f"no --arch in the model flags {' '.join(out)!r}: pass --arch-args-file "
            "(fairseq_args.txt of scripts/convert_hf_bert.py) or --arch-args '--arch roberta_base'"
        )
    return out


def multi_exit_arch(args: Sequence[str]) -> list[str]:
    """``args`` with the ``--arch`` value replaced by its multi-exit variant."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg.startswith("--arch="):
            out[i] = "--arch=" + _multi_exit_name(arg[len("--arch=") :])
        elif arg in ("--arch", "-a") and i + 1 < len(out):
            out[i + 1] = _multi_exit_name(out[i + 1])
    return out


def _multi_exit_name(arch: str) -> str:
    if arch.startswith("multi_exit_roberta"):
        return arch
    if arch in MULTI_EXIT_ARCH:
        return MULTI_EXIT_ARCH[arch]
    raise SystemExit(
        f"--arch {arch} has no multi-exit variant: use roberta, roberta_base, roberta_large "
        "or a multi_exit_roberta* arch"
    )


def count_examples(data: Path, split: str = "train") -> int:
    """Examples in ``DATA/input0/SPLIT`` (reads the index header; fairseq as a fallback)."""
    idx = data / "input0" / f"{split}.idx"
    if not idx.exists():
        raise SystemExit(f"{idx} not found: is {data} a binarized sentence_prediction dataset?")
    with open(idx, "rb") as f:
        if f.read(9) == b"MMIDIDX\x00\x00":
            f.read(8 + 1)  # version, dtype code
            return struct.unpack("<Q", f.read(8))[0]
    from fairseq.data import data_utils

    dataset = data_utils.load_indexed_dataset(str(data / "input0" / split), None)
    return len(dataset)


def count_classes(data: Path) -> int:
    """Labels listed with a non-zero count in ``DATA/label/dict.txt`` (as the task checks)."""
    path = data / "label" / "dict.txt"
    if not path.exists():
        raise SystemExit(f"{path} not found: pass --num-classes")
    n = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] != "<mask>" and parts[1].lstrip("-").isdigit():
            n += int(parts[1]) > 0
    return n


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def run_epochs(run: Run | None, opts: argparse.Namespace) -> int:
    """Epochs of a run: ``--stage2-epochs`` for the multi-exit (stage-2) runs, else ``--epochs``."""
    if run is not None and run.multi_exit and opts.stage2_epochs:
        return opts.stage2_epochs
    return opts.epochs


def run_extra_args(run: Run, opts: argparse.Namespace) -> list[str]:
    """``--extra`` of a run; stage-2 runs with ``--stage2-epochs`` drop ``--patience``
    (a fixed budget, equal for both multi-exit methods)."""
    args = list(opts.extra_args)
    if run.multi_exit and opts.stage2_epochs:
        while "--patience" in args:
            i = args.index("--patience")
            del args[i : i + 2]
        args = [a for a in args if not a.startswith("--patience=")]
    return args


def total_updates(opts: argparse.Namespace, run: Run | None = None) -> int:
    """Optimizer updates of one run (for the polynomial schedule and the progress)."""
    update_freq = int((_flag_value(opts.extra_args, "--update-freq") or "1").split(",")[0])
    batches = math.ceil(opts.n_train / opts.batch_size)
    updates = run_epochs(run, opts) * math.ceil(batches / update_freq)
    if opts.max_update:
        updates = min(updates, opts.max_update)
    return max(1, updates)


def method_flags(run: Run, opts: argparse.Namespace) -> list[str]:
    lam = format_lambda(run.lam)
    temperature = f"{opts.temperature:g}"
    threshold = f"{opts.acl_grad_threshold:g}"
    exit_layers = ["--exit-layers", opts.exit_layers] if opts.exit_layers else []
    if run.method == "ce":
        return ["--criterion", "sentence_prediction", "--exit-layers", "none"]
    if run.method == "ce_scl":
        flags = ["--criterion", "ce_scl", "--contrastive-lambda", lam, "--temperature", temperature]
        if not opts.ce_scl_plain:
            flags += ["--acl-grad", "--acl-grad-threshold", f"{CE_SCL_ANGLE_THRESHOLD:g}"]
        return flags + ["--exit-layers", "none"]
    if run.method == "acl":
        return [
            "--criterion", "acl_embed", "--contrastive-lambda", lam, "--temperature", temperature,
            "--acl-grad-threshold", threshold, "--exit-layers", "none",
        ]  # fmt: skip
    if opts.exit_weighting:
        exit_layers += ["--exit-weighting", opts.exit_weighting]
    if run.method == "multi_exit_joint":
        return ["--criterion", "multi_exit_ce", *exit_layers]
    if run.method == "acl_cl":
        variant = []
        if opts.cross_layer_weighting != "exit":
            variant += ["--cross-layer-weighting", opts.cross_layer_weighting]
        if opts.acl_cl_teacher == "frozen":
            assert run.stage1 is not None
            stage1_best = opts.out / "runs" / run.stage1.name / "checkpoint_best.pt"
            variant += ["--frozen-teacher", str(stage1_best)]
        return [
            "--criterion", "acl_cross_layer", "--contrastive-lambda", lam,
            "--cross-layer-lambda", f"{opts.cross_layer_lambda:g}", "--temperature", temperature,
            "--acl-grad-threshold", threshold, *exit_layers, *variant,
        ]  # fmt: skip
    raise ValueError(run.method)


def grad_threshold(run: Run, opts: argparse.Namespace) -> float | None:
    """The ACL-Grad threshold a run uses (None: no angles are measured)."""
    if run.method == "ce_scl":
        return None if opts.ce_scl_plain else CE_SCL_ANGLE_THRESHOLD
    if run.method in ("acl", "acl_cl"):
        return opts.acl_grad_threshold
    return None


def train_command(run: Run, opts: argparse.Namespace, run_dir: Path) -> list[str]:
    updates = total_updates(opts, run)
    if run.stage1 is not None:
        restore = [str(opts.out / "runs" / run.stage1.name / "checkpoint_best.pt")]
    elif opts.restore_file.lower() == "none":
        restore = []
    else:
        restore = [str(Path(opts.restore_file).resolve())]
    if restore:
        restore = ["--restore-file", *restore, "--reset-optimizer", "--reset-dataloader"]
        restore.append("--reset-meters")
    validate_every = opts.validate_interval_updates or max(1, updates // 3)
    cmd = [
        str(BIN / "fairseq-train"), str(opts.data), "--user-dir", str(USER_DIR),
        "--task", "acl_sentence_prediction", *multi_exit_arch(opts.arch_args),
        *method_flags(run, opts), "--exit-pooling", opts.exit_pooling, *restore,
        "--num-classes", str(opts.num_classes), "--init-token", "0",
        *(["--separator-token", "2"] if (opts.data / "input1").is_dir() else []),
        "--batch-size", str(opts.batch_size), "--required-batch-size-multiple", "1",
        "--max-epoch", str(run_epochs(run, opts)),
        *(["--max-update", str(opts.max_update)] if opts.max_update else []),
        "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6",
        "--weight-decay", "0.1", "--lr", f"{opts.lr:g}", "--lr-scheduler", "polynomial_decay",
        "--total-num-update", str(updates),
        "--warmup-updates", str(max(1, updates * opts.warmup_percent // 100)),
        "--valid-subset", opts.dev_subset,
        "--best-checkpoint-metric", "accuracy", "--maximize-best-checkpoint-metric",
        "--no-epoch-checkpoints", "--no-last-checkpoints", "--no-save-optimizer-state",
        "--save-dir", str(run_dir), "--seed", str(run.seed),
        *(["--cpu"] if opts.cpu else []), "--num-workers", "0",
        "--log-format", "json", "--log-interval", str(opts.log_interval),
        "--validate-interval-updates", str(validate_every),
        # fairseq saves checkpoint_best.pt only where it saves: at every validation, so the
        # best checkpoint is the best dev record (the interval copies are deleted after training)
        "--save-interval-updates", str(validate_every), "--keep-interval-updates", "1",
        "--acl-grad-log", str(run_dir / "angles.tsv"),
        *run_extra_args(run, opts),
    ]  # fmt: skip
    return cmd


def validate_command(opts: argparse.Namespace, checkpoint: Path) -> list[str]:
    """``fairseq-validate`` on the test split. fairseq-validate evaluates with the criterion
    saved in the checkpoint (the multi-exit ones log ``accuracy_exit{l}`` of every exit); the
    ``--criterion`` here only lets the command line parse (the task's config refers to
    ``criterion.classification_head_name``, which the default criterion lacks)."""
    return [
        str(BIN / "fairseq-validate"), str(opts.data), "--user-dir", str(USER_DIR),
        "--task", "acl_sentence_prediction", "--criterion", "sentence_prediction",
        "--path", str(checkpoint),
        "--valid-subset", opts.test_subset, "--batch-size", str(opts.eval_batch_size),
        *(["--cpu"] if opts.cpu else []), "--num-workers", "0", "--log-format", "json",
    ]  # fmt: skip


def portable(cmd: Sequence[str], opts: argparse.Namespace) -> list[str]:
    """The command with this results folder written as ``<out>`` (compared on resume)."""
    out = str(opts.out)
    return [a.replace(out, "<out>") for a in cmd]


# ----------------------------------------------------------------------------- logs


def json_records(lines: Iterable[str], kind: str | None = None) -> list[dict]:
    """JSON records of fairseq's json progress output; ``kind``: only ``| kind |`` lines."""
    records = []
    for line in lines:
        if kind is not None and f"| {kind} |" not in line:
            continue
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _numbers(record: dict, prefix: str) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if key.startswith(prefix):
            try:
                out[key[len(prefix) :]] = float(value)
            except (TypeError, ValueError):
                continue
    return out


def best_dev(log_text: str, subset: str = "valid") -> dict[str, float]:
    """Metrics of the validation record the best checkpoint was saved at: the highest
    accuracy, the last one among ties (fairseq's ``>=``)."""
    prefix = f"{subset}_"
    records = [
        _numbers(r, prefix)
        for r in json_records(log_text.splitlines(), "valid")
        if f"{prefix}accuracy" in r
    ]
    if not records:
        raise ValueError("no validation record with an accuracy in the training log")
    best = records[0]
    for record in records[1:]:
        if record["accuracy"] >= best["accuracy"]:
            best = record
    return best


def test_metrics(output: str, subset: str = "test") -> dict[str, float]:
    records = [r for r in json_records(output.splitlines()) if f"{subset}_accuracy" in r]
    if not records:
        raise ValueError(f"fairseq-validate printed no {subset}_accuracy")
    return _numbers(records[-1], f"{subset}_")


def check_best_checkpoint(best: Path, dev: dict[str, float]) -> None:
    """Stops unless ``best`` was saved at the update of the best dev record."""
    import torch

    state = torch.load(best, map_location="cpu", weights_only=False, mmap=True)
    saved = state["optimizer_history"][-1]["num_updates"]
    if "num_updates" in dev and int(dev["num_updates"]) != int(saved):
        raise RunFailed(
            f"{best} was saved at update {saved}, but the best dev accuracy was at update "
            f"{int(dev['num_updates'])}: the checkpoint does not match the dev record"
        )


def read_angles(path: Path) -> list[tuple[int, float, int]]:
    """``(update, angle in degrees, kept 0/1)`` rows of an ``--acl-grad-log`` file (whose
    fourth column, the angle on the heads alone, is not used here)."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            rows.append((int(parts[0]), float(parts[1]), int(parts[2])))
    return rows


def angle_summary(rows: Sequence[tuple[int, float, int]]) -> dict[str, float] | None:
    if not rows:
        return None
    angles = [a for _, a, _ in rows]
    return {
        "updates": len(rows),
        "mean_angle": statistics.fmean(angles),
        "pct_over_90": 100.0 * sum(a > 90.0 for a in angles) / len(angles),
        "pct_dropped": 100.0 * sum(k == 0 for _, _, k in rows) / len(rows),
    }


# ----------------------------------------------------------------------------- running


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Elapsed time and an ETA from the durations of the runs trained so far."""

    def __init__(self, total: int):
        self.start = time.time()
        self.total = total
        self.durations: list[float] = []

    def eta(self, remaining: int, current: float | None = None) -> str:
        """``remaining``: runs still to do, the current one included; ``current``: projected
        duration of the current run (from its own updates) when nothing finished yet."""
        per_run = statistics.fmean(self.durations) if self.durations else current
        if per_run is None:
            return "ETA after the first run"
        return f"ETA {_clock(per_run * remaining)}"

    def elapsed(self) -> str:
        return f"elapsed {_clock(time.time() - self.start)}"


def stream(cmd: list[str], log_file: Path, on_record=None) -> int:
    """Runs ``cmd`` with its output to ``log_file``; ``on_record(kind, record)`` per JSON
    progress record. Returns the exit status."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    with open(log_file, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                f.flush()
                if on_record is None:
                    continue
                for kind in ("train_inner", "valid"):
                    if f"| {kind} |" in line:
                        for record in json_records([line]):
                            on_record(kind, record)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return proc.wait()


def _tail(path: Path, n: int = 40) -> str:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


class RunFailed(Exception):
    pass


def flag_groups(args: Sequence[str]) -> list[str]:
    """``args`` as one string per flag with its values (``--lr 5e-05``), in order."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return [shlex.join(g) for g in groups]


def check_same_flags(run: Run, run_dir: Path, expected: list[str]) -> None:
    meta = run_dir / "run.json"
    if not meta.exists():
        return
    saved = json.loads(meta.read_text(encoding="utf-8")).get("train_command")
    if saved is None or saved == expected:
        return
    cosmetic = ("--log-interval ",)  # does not change the run's results
    old_flags, new_flags = (
        [g for g in flag_groups(args) if not g.startswith(cosmetic)] for args in (saved, expected)
    )
    if old_flags == new_flags:
        return
    only_old = [g for g in old_flags if g not in new_flags]
    only_new = [g for g in new_flags if g not in old_flags]
    raise SystemExit(
        f"{run_dir} was trained with other flags than asked for now (only then: "
        f"{', '.join(only_old) or '-'}; only now: {', '.join(only_new) or '-'}). Pass --force "
        "to train it again, or write to another --out."
    )


def execute(
    run: Run, opts: argparse.Namespace, progress: Progress, index: int, force: bool = False
) -> str:
    """Trains (unless done) and evaluates one run; returns 'skipped', 'evaluated' or 'trained'.
    ``force``: train again even if done (``--force``, or its stage 1 was trained again)."""
    run_dir = opts.out / "runs" / run.name
    test_json = run_dir / "test.json"
    cmd = train_command(run, opts, run_dir)
    expected = portable(cmd, opts)
    tag = f"[{index}/{progress.total}] {run.name}"
    if not force:
        check_same_flags(run, run_dir, expected)
        if test_json.exists():
            print(f"{tag}: done before ({test_json})", flush=True)
            return "skipped"
    best = run_dir / "checkpoint_best.pt"
    trained_before = not force and best.exists() and (run_dir / "train.done").exists()
    remaining = progress.total - index + 1
    start = time.time()
    if trained_before:
        print(f"{tag}: trained before, evaluating; {progress.elapsed()}", flush=True)
    else:
        if run.stage1 is not None:
            stage1_best = opts.out / "runs" / run.stage1.name / "checkpoint_best.pt"
            if not stage1_best.exists():
                raise RunFailed(f"{run.name} restores {stage1_best}, which does not exist")
        updates = total_updates(opts, run)
        print(
            f"{tag}: training {updates} updates; {progress.elapsed()}, {progress.eta(remaining)}",
            flush=True,
        )
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n", encoding="utf-8")
        (run_dir / "run.json").write_text(
            json.dumps(
                {
                    "run": run.name,
                    "method": run.method,
                    "seed": run.seed,
                    "lambda": run.lam,
                    "sweep": run.sweep,
                    "acl_grad_threshold": grad_threshold(run, opts),
                    "stage1": run.stage1.name if run.stage1 else None,
                    "train_command": expected,
                },
                indent=1,
            )
            + "\n",
            encoding="utf-8",
        )

        def on_record(kind: str, record: dict) -> None:
            if kind == "train_inner":
                done = int(float(record.get("num_updates", 0)))
                wall = float(record.get("wall", 0))
                projected = wall / done * updates if done else None
                angle = record.get("acl_grad_angle")
                print(
                    f"   update {done}/{updates} loss {record.get('loss')} "
                    f"acc {record.get('accuracy')}"
                    + (f" angle {angle}" if angle is not None else "")
                    + f" | run {_clock(time.time() - start)}, {progress.eta(remaining, projected)}",
                    flush=True,
                )
            else:
                prefix = f"{opts.dev_subset}_"
                print(
                    f"   dev at update {record.get(prefix + 'num_updates')}: accuracy "
                    f"{record.get(prefix + 'accuracy')}",
                    flush=True,
                )

        code = stream(cmd, run_dir / "train.log", on_record)
        if code != 0 or not best.exists():
            raise RunFailed(
                f"training {run.name} failed (exit {code}); {run_dir / 'train.log'}:\n"
                + _tail(run_dir / "train.log")
            )
        for interval_copy in run_dir.glob("checkpoint_*_*.pt"):
            interval_copy.unlink()
        (run_dir / "train.done").write_text("", encoding="utf-8")

    dev = best_dev((run_dir / "train.log").read_text(encoding="utf-8"), opts.dev_subset)
    check_best_checkpoint(best, dev)
    code = stream(validate_command(opts, best), run_dir / "test.log")
    if code != 0:
        raise RunFailed(
            f"evaluating {run.name} failed (exit {code}); {run_dir / 'test.log'}:\n"
            + _tail(run_dir / "test.log")
        )
    test = test_metrics((run_dir / "test.log").read_text(encoding="utf-8"), opts.test_subset)
    meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    result = {
        **{k: v for k, v in meta.items() if k != "train_command"},
        "dev_subset": opts.dev_subset,
        "test_subset": opts.test_subset,
        "dev": dev,
        "test": test,
        "angles": angle_summary(read_angles(run_dir / "angles.tsv")),
        "seconds": round(time.time() - start, 1),
    }
    test_json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if run.sweep and not opts.keep_sweep_checkpoints:
        best.unlink()
    if not trained_before:
        progress.durations.append(time.time() - start)
    exits = sorted(k for k in test if k.startswith("accuracy_exit"))
    per_exit = (
        " (exits: " + ", ".join(f"{k[len('accuracy_exit') :]}: {test[k]:g}" for k in exits) + ")"
        if exits
        else ""
    )
    print(
        f"{tag}: dev {dev['accuracy']:g}, test {test['accuracy']:g}{per_exit}; run "
        f"{_clock(time.time() - start)}, {progress.elapsed()}",
        flush=True,
    )
    return "evaluated" if trained_before else "trained"


# ----------------------------------------------------------------------------- report


def summarize(values: Sequence[float]) -> tuple[float, float, int]:
    """``(mean, sample std, n)``; the std is nan for fewer than two values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else math.nan
    return mean, std, n


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def fmt_mean_std(values: Sequence[float], digits: int = 2) -> str:
    mean, std, n = summarize(values)
    if n == 0:
        return "-"
    return fmt(mean, digits) if n == 1 else f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def load_results(out: Path) -> list[dict]:
    """Every ``runs/*/test.json`` under ``out``, sorted by method, lambda, seed."""
    results = []
    for path in sorted((out / "runs").glob("*/test.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        result["dir"] = str(path.parent)
        results.append(result)
    order = {m: i for i, m in enumerate(METHODS)}
    results.sort(
        key=lambda r: (order.get(r["method"], 99), r.get("lambda") or 0.0, r["seed"], r["run"])
    )
    return results


def main_results(results: Sequence[dict]) -> list[dict]:
    return [r for r in results if not r.get("sweep")]


def exit_layers_of(results: Sequence[dict], split: str = "test") -> list[int]:
    layers = set()
    for r in results:
        layers |= {
            int(k[len("accuracy_exit") :]) for k in r[split] if k.startswith("accuracy_exit")
        }
    return sorted(layers)


def lambda_groups(results: Sequence[dict], method: str) -> dict[float, list[dict]]:
    """Runs of ``method`` (main and sweep) by their contrastive lambda."""
    groups: dict[float, list[dict]] = {}
    for r in results:
        if r["method"] == method and r.get("lambda") is not None:
            groups.setdefault(float(r["lambda"]), []).append(r)
    return dict(sorted(groups.items()))


def chosen_on_dev(groups: dict[float, list[dict]]) -> float | None:
    """The lambda with the highest mean dev accuracy (the smallest among ties)."""
    best = None
    for lam, runs in groups.items():
        mean = summarize([r["dev"]["accuracy"] for r in runs])[0]
        if best is None or mean > best[1]:
            best = (lam, mean)
    return None if best is None else best[0]


@dataclass
class Row:
    label: str  # first column(s), already formatted
    values: dict[int, float]  # seed -> value


def markdown_table(first_columns: Sequence[str], rows: Sequence[Row]) -> list[str]:
    """Mean, sample std, n and the per-seed values of each row."""
    seeds = sorted({s for row in rows for s in row.values})
    head = [*first_columns, "mean", "std", "n", *(f"seed {s}" for s in seeds)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        mean, std, n = summarize([row.values[s] for s in sorted(row.values)])
        cells = [
            row.label,
            fmt(mean),
            fmt(std),
            str(n),
            *(fmt(row.values.get(s)) for s in seeds),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _method_label(r: dict) -> str:
    lam = r.get("lambda")
    return r["method"] if lam is None else f"{r['method']} (λ {format_lambda(lam)})"


def _rows(results: Sequence[dict], split: str, metric: str, label=_method_label) -> list[Row]:
    rows: dict[str, Row] = {}
    for r in results:
        if metric in r[split]:
            row = rows.setdefault(label(r), Row(label(r), {}))
            row.values[r["seed"]] = r[split][metric]
    return list(rows.values())


def report(out: Path) -> tuple[str, list[list[Any]], list[list[Any]]]:
    """``(results.md text, results.csv rows, summary.csv rows)`` from the runs in ``out``."""
    results = load_results(out)
    main = main_results(results)
    md = [f"# Results ({out.name})", ""]
    if not results:
        md.append("No finished run yet.")
    dev_subset = results[0].get("dev_subset", "valid") if results else "valid"
    test_subset = results[0].get("test_subset", "test") if results else "test"
    summary: list[list[Any]] = [["method", "lambda", "split", "metric", "n", "mean", "std"]]

    def add_summary(method, lam, split, metric, values):
        mean, std, n = summarize(values)
        summary.append([method, format_lambda(lam), split, metric, n, mean, std])

    if main:
        md += [
            f"Checkpoints chosen on dev (`{dev_subset}`, best accuracy), reported on the "
            f"held-out `{test_subset}` split. Accuracy in %; std is the sample standard "
            "deviation over seeds (n - 1).",
            "",
        ]
        for title, split in (("Dev accuracy", "dev"), ("Test accuracy", "test")):
            md += [f"## {title}", "", *markdown_table(["method"], _rows(main, split, "accuracy"))]
            md.append("")
        multi = [r for r in main if r["method"] in MULTI_EXIT_METHODS]
        layers = exit_layers_of(multi)
        if multi and layers:
            rows = []
            for method in MULTI_EXIT_METHODS:
                runs = [r for r in multi if r["method"] == method]
                for layer in layers:
                    final = " (final)" if layer == layers[-1] else ""
                    for row in _rows(runs, "test", f"accuracy_exit{layer}"):
                        rows.append(Row(f"{row.label} | {layer}{final}", row.values))
            md += [
                "## Test accuracy per exit (multi-exit methods)",
                "",
                *markdown_table(["method", "exit layer"], rows),
                "",
                "Layer-score curve (test accuracy, mean ± std):",
                "",
                "| method | " + " | ".join(f"exit {layer}" for layer in layers) + " |",
                "|---|" + "---|" * len(layers),
            ]
            for method in MULTI_EXIT_METHODS:
                runs = [r for r in multi if r["method"] == method]
                if runs:
                    cells = []
                    for layer in layers:
                        key = f"accuracy_exit{layer}"
                        cells.append(
                            fmt_mean_std([r["test"][key] for r in runs if key in r["test"]])
                        )
                    md.append(f"| {method} | " + " | ".join(cells) + " |")
            md.append("")
        with_angles = [r for r in main if r.get("angles")]
        if with_angles:
            md += [
                "## ACL-Grad angles during training",
                "",
                "Per run: mean angle between the CE and the contrastive gradient over the "
                "updates, % of updates above 90°, % of updates whose contrastive term was "
                "dropped (ce_scl: threshold 180°, nothing dropped). Mean ± std over seeds.",
                "",
                "| method | threshold | n | mean angle (°) | > 90° (%) | dropped (%) |",
                "|---|---|---|---|---|---|",
            ]
            by_method: dict[str, list[dict]] = {}
            for r in with_angles:
                by_method.setdefault(_method_label(r), []).append(r)
            for label, runs in by_method.items():
                cells = [
                    fmt_mean_std([r["angles"][k] for r in runs], 1)
                    for k in ("mean_angle", "pct_over_90", "pct_dropped")
                ]
                thr = runs[0].get("acl_grad_threshold")
                thr_text = "-" if thr is None else f"{thr:g}°"
                md.append(f"| {label} | {thr_text} | {len(runs)} | " + " | ".join(cells) + " |")
            md.append("")
        for r_method in METHODS:
            runs = [r for r in main if r["method"] == r_method]
            if not runs:
                continue
            lam = runs[0].get("lambda")
            for split in ("dev", "test"):
                for metric in sorted({k for r in runs for k in r[split] if _METRIC_RE.match(k)}):
                    values = [r[split][metric] for r in runs if metric in r[split]]
                    add_summary(r_method, lam, split, metric, values)
            if any(r.get("angles") for r in runs):
                for key in ("mean_angle", "pct_over_90", "pct_dropped"):
                    values = [r["angles"][key] for r in runs if r.get("angles")]
                    add_summary(r_method, lam, "train", f"acl_grad_{key}", values)

    sweep_methods = [m for m in SWEEP_METHODS if len(lambda_groups(results, m)) > 1]
    if sweep_methods:
        md += [
            "## Sensitivity to lambda (--contrastive-lambda)",
            "",
            "The lambda equal to the main runs' is the main run itself.",
            "",
        ]
        for title, split in (("Dev accuracy", "dev"), ("Test accuracy", "test")):
            rows = []
            for method in sweep_methods:
                for lam, runs in lambda_groups(results, method).items():
                    values = {r["seed"]: r[split]["accuracy"] for r in runs}
                    rows.append(Row(f"{method} | {format_lambda(lam)}", values))
            md += [f"### {title}", "", *markdown_table(["method", "λ"], rows), ""]
        md += [
            "### Lambda chosen on dev (highest mean dev accuracy), reported on test",
            "",
            "| method | λ | dev accuracy | test accuracy |",
            "|---|---|---|---|",
        ]
        for method in sweep_methods:
            groups = lambda_groups(results, method)
            lam = chosen_on_dev(groups)
            runs = groups[lam]
            md.append(
                f"| {method} | {format_lambda(lam)} | "
                f"{fmt_mean_std([r['dev']['accuracy'] for r in runs])} | "
                f"{fmt_mean_std([r['test']['accuracy'] for r in runs])} |"
            )
            for lam_value, group in groups.items():
                if any(r.get("sweep") for r in group):  # the main lambda is summarised above
                    for split in ("dev", "test"):
                        values = [r[split]["accuracy"] for r in group]
                        add_summary(method, lam_value, split, "accuracy", values)
        md.append("")

    per_run: list[list[Any]] = [["run", "method", "lambda", "seed", "split", "metric", "value"]]
    for r in results:
        base = [r["run"], r["method"], format_lambda(r.get("lambda")), r["seed"]]
        for split in ("dev", "test"):
            for metric in sorted(k for k in r[split] if _METRIC_RE.match(k)):
                per_run.append([*base, split, metric, r[split][metric]])
        if r.get("angles"):
            for key in ("mean_angle", "pct_over_90", "pct_dropped"):
                per_run.append([*base, "train", f"acl_grad_{key}", r["angles"][key]])
    return "\n".join(md) + "\n", per_run, summary


def write_report(out: Path) -> Path:
    text, per_run, summary = report(out)
    (out / "results.md").write_text(text, encoding="utf-8")
    for name, rows in (("results.csv", per_run), ("summary.csv", summary)):
        with open(out / name, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            for row in rows:
                writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])
    return out / "results.md"


# ----------------------------------------------------------------------------- command line


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; options with their default unless the help names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default in (None, False, argparse.SUPPRESS)
        ):
            return text
        if isinstance(default, list):
            default = ",".join(map(str, default))
        return f"{text} (default: {default})".strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("data", type=Path, help="binarized sentence_prediction data directory")
    p.add_argument("--out", type=Path, default=Path("RESULTS"), help="results folder")
    p.add_argument(
        "--restore-file",
        default="none",
        help="pretrained fairseq checkpoint (model.pt); 'none' trains from scratch (tests)",
    )
    arch = p.add_mutually_exclusive_group()
    arch.add_argument(
        "--arch-args-file", help="file with the model flags (fairseq_args.txt of convert_hf_bert)"
    )
    arch.add_argument("--arch-args", help="model flags, e.g. '--arch roberta_base'")
    p.add_argument(
        "--methods",
        type=lambda s: parse_list(s, str, "--methods"),
        default=list(METHODS),
        help=f"comma list of {','.join(METHODS)} (default: all)",
    )
    p.add_argument(
        "--seeds",
        type=lambda s: parse_list(s, int, "--seeds"),
        default=[1, 2, 3],
        help="comma list",
    )
    p.add_argument(
        "--lambdas",
        type=lambda s: parse_list(s, float, "--lambdas"),
        help="lambda sweep of ce_scl and acl, e.g. 0.1,0.5,1.0",
    )
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (Adam)")
    p.add_argument("--batch-size", type=int, default=16, help="sentences per update")
    p.add_argument("--epochs", type=int, default=1, help="epochs of every run (each stage)")
    p.add_argument("--max-update", type=int, help="stop every run after this many updates")
    p.add_argument(
        "--warmup-percent", type=int, default=6, help="warm-up updates, in percent of the total"
    )
    p.add_argument(
        "--exit-pooling", choices=("first", "mean"), default="mean", help="pooling of every head"
    )
    p.add_argument(
        "--exit-layers", help="shallow exits of the multi-exit methods (default: every layer)"
    )
    p.add_argument(
        "--contrastive-lambda", type=float, default=0.5, help="lambda of ce_scl, acl, acl_cl"
    )
    p.add_argument("--cross-layer-lambda", type=float, default=0.5, help="acl_cl's lambda_cl")
    p.add_argument(
        "--acl-cl-teacher",
        choices=("live", "frozen"),
        default="live",
        help="acl_cl's teacher: the live last exit, or a frozen snapshot of its stage-1 run's "
        "best checkpoint (--frozen-teacher)",
    )
    p.add_argument(
        "--cross-layer-weighting",
        choices=("exit", "layer", "uniform"),
        default="exit",
        help="acl_cl's weights of the exits' contrastive terms (exit: those of the CE terms)",
    )
    p.add_argument(
        "--exit-weighting",
        choices=("layer", "uniform"),
        help="weights of the exits' CE terms of both multi-exit methods (default: the "
        "criterions' own, layer)",
    )
    p.add_argument(
        "--stage2-epochs",
        type=int,
        help="epochs of the multi-exit (stage-2) runs, default --epochs; stage 2 trains this "
        "fixed budget for both multi-exit methods: a --patience in --extra applies to stage 1 only",
    )
    p.add_argument("--temperature", type=float, default=0.3, help="of the contrastive losses")
    p.add_argument(
        "--acl-grad-threshold", type=float, default=90.0, help="ACL-Grad of acl and acl_cl"
    )
    p.add_argument(
        "--ce-scl-plain",
        action="store_true",
        help="run ce_scl without measuring the gradient angle (one backward, no angles.tsv)",
    )
    p.add_argument("--num-classes", type=int, help="default: from DATA/label/dict.txt")
    p.add_argument("--dev-subset", default="valid", help="split the checkpoint is chosen on")
    p.add_argument("--test-subset", default="test", help="held-out split reported")
    p.add_argument(
        "--validate-interval-updates", type=int, help="default: a third of a run's updates"
    )
    p.add_argument("--log-interval", type=int, default=10, help="updates per progress line")
    p.add_argument("--eval-batch-size", type=int, default=64, help="of fairseq-validate")
    p.add_argument(
        "--extra",
        default="",
        help="more fairseq-train flags for every run, after the others (so they override them); "
        "one string: --extra '--update-freq 2 --fp16' or --extra=--fp16",
    )
    p.add_argument("--cpu", action="store_true", help="train on CPU (default when no CUDA)")
    p.add_argument("--force", action="store_true", help="re-run runs that are done")
    p.add_argument(
        "--keep-going", action="store_true", help="after a failed run, go on with the others"
    )
    p.add_argument(
        "--keep-sweep-checkpoints",
        action="store_true",
        help="keep checkpoint_best.pt of the lambda-sweep runs (deleted after evaluation)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report-only", action="store_true", help="only rebuild results.md/csv")
    return p


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    opts.out = opts.out.resolve()
    if opts.report_only:
        print(f"wrote {write_report(opts.out)}")
        return 0
    opts.data = opts.data.resolve()
    if not (opts.arch_args_file or opts.arch_args):
        raise SystemExit("give the model flags: --arch-args-file FILE or --arch-args '...'")
    opts.arch_args = read_arch_args(opts.arch_args_file, opts.arch_args)
    opts.extra_args = shlex.split(opts.extra)
    if opts.restore_file.lower() != "none" and not Path(opts.restore_file).exists():
        raise SystemExit(f"--restore-file {opts.restore_file}: no such file")
    opts.num_classes = opts.num_classes or count_classes(opts.data)
    opts.n_train = count_examples(opts.data, "train")
    for split in (opts.dev_subset, opts.test_subset):
        count_examples(opts.data, split)  # fails early, naming the file, when a split is missing
    if not opts.cpu and not opts.dry_run and not _cuda_available():
        opts.cpu = True
    try:
        runs = plan_runs(opts.methods, opts.seeds, opts.contrastive_lambda, opts.lambdas)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    added = sorted({r.method for r in runs} - set(opts.methods))
    print(
        f"{len(runs)} runs ({', '.join(r.name for r in runs)}) of {total_updates(opts)} updates "
        f"each ({opts.n_train} training examples, batch {opts.batch_size}, {opts.epochs} "
        f"epoch(s)) -> {opts.out}",
        flush=True,
    )
    if added:
        print(f"added stage-1 runs for the multi-exit methods: {', '.join(added)}")
    if "ce_scl" in opts.methods and not opts.ce_scl_plain:
        print(
            "ce_scl runs with --acl-grad --acl-grad-threshold 180: the angle is measured and "
            "logged every update (angles.tsv), the SCL term is never dropped"
        )
    if opts.dry_run:
        for run in runs:
            cmd = train_command(run, opts, opts.out / "runs" / run.name)
            print(f"# {run.name}\n{shlex.join(cmd)}")
        return 0
    (opts.out / "runs").mkdir(parents=True, exist_ok=True)
    progress = Progress(len(runs))
    failed: list[str] = []
    trained: set[str] = set()
    counts = {"skipped": 0, "evaluated": 0, "trained": 0}
    for i, run in enumerate(runs, start=1):
        if run.stage1 is not None and run.stage1.name in failed:
            print(f"[{i}/{len(runs)}] {run.name}: skipped, its stage 1 failed", flush=True)
            failed.append(run.name)
            continue
        # a stage-2 run restores its stage 1's checkpoint: stage 1 trained again, so is it
        force = opts.force or (run.stage1 is not None and run.stage1.name in trained)
        try:
            outcome = execute(run, opts, progress, i, force)
            counts[outcome] += 1
            if outcome == "trained":
                trained.add(run.name)
        except RunFailed as e:
            if not opts.keep_going:
                write_report(opts.out)
                raise SystemExit(str(e)) from None
            print(f"[{i}/{len(runs)}] {run.name}: FAILED\n{e}", flush=True)
            failed.append(run.name)
        write_report(opts.out)
    path = write_report(opts.out)
    print(
        f"\n{counts['trained']} trained, {counts['evaluated']} only evaluated, "
        f"{counts['skipped']} done before, {len(failed)} failed; {progress.elapsed()}\n"
        f"wrote {path}, {opts.out / 'results.csv'}, {opts.out / 'summary.csv'}",
        flush=True,
    )
    print(path.read_text(encoding="utf-8"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
