"""Running a comparison: the fairseq-train / fairseq-validate commands of a run, their
execution with streamed progress, and the run's result (``test.json``)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from acl_fairseq.acl_grad import read_angle_log
from acl_fairseq.atomic_write import write_json, write_text
from acl_fairseq.cli.compare.plan import (
    CE_SCL_ANGLE_THRESHOLD,
    Run,
    format_lambda,
    run_epochs,
    run_extra_args,
    total_updates,
)
from acl_fairseq.cli.compare.report import angle_summary
from acl_fairseq.errors import AclRuntimeError, AclValueError
from acl_fairseq.experiment.commands import stream_to_log
from acl_fairseq.experiment.fairseq_log import best_dev, json_records, progress_kind, test_metrics
from acl_fairseq.experiment.paths import BIN, USER_DIR
from acl_fairseq.experiment.predictions import PREDICTIONS_FILE, predict_split, write_predictions
from acl_fairseq.experiment.recipe import criterion_flags, flag_groups, multi_exit_arch
from acl_fairseq.experiment.recipe import train_command as fairseq_train_command
from acl_fairseq.experiment.results import RESULT_FILE, write_result
from acl_fairseq.inference.loader import load_for_inference


def method_flags(run: Run, opts: argparse.Namespace) -> list[str]:
    lam = format_lambda(run.lam)
    temperature = f"{opts.temperature:g}"
    threshold = f"{opts.acl_grad_threshold:g}"
    if run.method == "ce_scl":
        plain = opts.ce_scl_plain
        return criterion_flags(
            "ce_scl",
            lam,
            temperature,
            acl_grad=None if plain else True,
            acl_grad_threshold=None if plain else f"{CE_SCL_ANGLE_THRESHOLD:g}",
        )
    if run.method == "ce_scl_grad":  # CE+SCL gated by ACL-Grad
        return criterion_flags("ce_scl", lam, temperature, True, threshold)
    if run.method == "acl_embed":  # ACL without its gate
        return criterion_flags("acl_embed", lam, temperature, acl_grad=False)
    exits = {"exit_layers": opts.exit_layers or None, "exit_weighting": opts.exit_weighting}
    if run.method in ("multi_exit_joint", "joint_from_acl", "joint_from_start"):
        return criterion_flags(run.method, **exits)
    if run.method != "acl_cl":
        return criterion_flags(run.method, lam, temperature, acl_grad_threshold=threshold)
    variant = []
    if opts.cross_layer_weighting != "exit":
        variant += ["--cross-layer-weighting", opts.cross_layer_weighting]
    if opts.acl_cl_teacher == "frozen":
        assert run.stage1 is not None
        stage1_best = opts.out / "runs" / run.stage1.name / "checkpoint_best.pt"
        variant += ["--frozen-teacher", str(stage1_best)]
    cross = f"{opts.cross_layer_lambda:g}"
    flags = criterion_flags(
        "acl_cl", lam, temperature, acl_grad_threshold=threshold, cross_layer_lambda=cross, **exits
    )
    return flags + variant


def grad_threshold(run: Run, opts: argparse.Namespace) -> float | None:
    """The ACL-Grad threshold a run uses (None: no angles are measured)."""
    if run.method == "ce_scl":
        return None if opts.ce_scl_plain else CE_SCL_ANGLE_THRESHOLD
    if run.method in ("ce_scl_grad", "acl", "acl_cl"):
        return opts.acl_grad_threshold
    return None


def train_command(run: Run, opts: argparse.Namespace, run_dir: Path) -> list[str]:
    updates = total_updates(opts, run)
    if run.stage1 is not None:
        restore: Path | None = opts.out / "runs" / run.stage1.name / "checkpoint_best.pt"
    elif opts.restore_file.lower() == "none":
        restore = None
    else:
        restore = Path(opts.restore_file).resolve()
    # fairseq saves checkpoint_best.pt only where it saves: at every validation, so the best
    # checkpoint is the best dev record (the interval copies are deleted after training)
    return fairseq_train_command(
        opts.data,
        run_dir,
        arch=multi_exit_arch(opts.arch_args),
        criterion=method_flags(run, opts),
        exit_pooling=opts.exit_pooling,
        restore=restore,
        num_classes=opts.num_classes,
        separator_token=(opts.data / "input1").is_dir(),
        batch_size=opts.batch_size,
        required_batch_size_multiple=1,
        max_epoch=run_epochs(run, opts),
        max_update=opts.max_update or None,
        lr=f"{opts.lr:g}",
        total_updates=updates,
        warmup_updates=max(1, updates * opts.warmup_percent // 100),
        valid_subset=opts.dev_subset,
        best_metric="accuracy",
        seed=run.seed,
        cpu=opts.cpu,
        num_workers=0,
        log_format="json",
        log_interval=opts.log_interval,
        validate_interval_updates=opts.validate_interval_updates or max(1, updates // 3),
        extra=["--acl-grad-log", str(run_dir / "angles.tsv"), *run_extra_args(run, opts)],
    )


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
        "--required-batch-size-multiple", "1",  # fairseq drops a last batch of another size
        *(["--cpu"] if opts.cpu else []), "--num-workers", "0", "--log-format", "json",
    ]  # fmt: skip


def save_predictions(
    opts: argparse.Namespace, checkpoint: Path, path: Path, test: dict[str, float]
) -> None:
    """Every exit's prediction for every dev and test example of ``checkpoint``
    (``predictions.tsv``, for per-example paired tests), checked against fairseq-validate's
    test accuracy (which fairseq logs rounded to 0.1)."""
    loaded = load_for_inference(checkpoint, opts.data)
    splits = [
        predict_split(loaded.model, loaded.task, split, opts.eval_batch_size)
        for split in (opts.dev_subset, opts.test_subset)
    ]
    accuracy = splits[1].accuracy()
    if "accuracy" in test and abs(accuracy - float(test["accuracy"])) > 0.05 + 1e-9:
        raise RunFailed(
            f"{checkpoint}: the per-example predictions give {accuracy:.2f}% on "
            f"{opts.test_subset}, fairseq-validate {test['accuracy']}%"
        )
    write_predictions(path, splits)


def portable(cmd: Sequence[str], opts: argparse.Namespace) -> list[str]:
    """The command with this results folder written as ``<out>`` (compared on resume)."""
    out = str(opts.out)
    return [a.replace(out, "<out>") for a in cmd]


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
    """Runs ``cmd`` with its output to ``log_file``, on every core unless ``OMP_NUM_THREADS``
    says otherwise; ``on_record(kind, record)`` per JSON progress record. Returns the exit
    status."""

    def on_line(line: str) -> None:
        kind = progress_kind(line)
        if kind is not None and on_record is not None:
            for record in json_records([line]):
                on_record(kind, record)

    env = {"OMP_NUM_THREADS": str(os.cpu_count() or 1), **os.environ}
    return stream_to_log(cmd, log_file, on_line, env)


def _tail(path: Path, n: int = 40) -> str:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


class RunFailed(AclRuntimeError):
    """A run that did not train or evaluate; the message names it and its log."""


def check_same_flags(run: Run, run_dir: Path, expected: list[str]) -> None:
    meta = run_dir / "run.json"
    if not meta.exists():
        return
    saved = json.loads(meta.read_text(encoding="utf-8")).get("train_command")
    if saved is None or saved == expected:
        return
    # which installation's fairseq-train and which checkout's plugin (--user-dir) ran it does
    # not change the run (a study restored on another machine, or run from another worktree)
    saved, expected = ([Path(c[0]).name, *c[1:]] if c else c for c in (saved, expected))
    cosmetic = ("--log-interval ", "--user-dir ")  # does not change the run's results
    old_flags, new_flags = (
        [g for g in flag_groups(args) if not g.startswith(cosmetic)] for args in (saved, expected)
    )
    if old_flags == new_flags:
        return
    only_old = [g for g in old_flags if g not in new_flags]
    only_new = [g for g in new_flags if g not in old_flags]
    raise AclValueError(
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
    test_json = run_dir / RESULT_FILE
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
        # a run linked from another folder (python -m studies) is trained where it lives
        if run_dir.exists():
            shutil.rmtree(run_dir.resolve())
        run_dir.resolve().mkdir(parents=True)
        write_text(run_dir / "command.txt", shlex.join(cmd) + "\n")
        write_json(
            run_dir / "run.json",
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
        write_text(run_dir / "train.done", "")

    dev = best_dev((run_dir / "train.log").read_text(encoding="utf-8"), opts.dev_subset)
    check_best_checkpoint(best, dev)
    code = stream(validate_command(opts, best), run_dir / "test.log")
    if code != 0:
        raise RunFailed(
            f"evaluating {run.name} failed (exit {code}); {run_dir / 'test.log'}:\n"
            + _tail(run_dir / "test.log")
        )
    test = test_metrics((run_dir / "test.log").read_text(encoding="utf-8"), opts.test_subset)
    save_predictions(opts, best, run_dir / PREDICTIONS_FILE, test)
    meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    result = {
        **{k: v for k, v in meta.items() if k != "train_command"},
        "dev_subset": opts.dev_subset,
        "test_subset": opts.test_subset,
        "dev": dev,
        "test": test,
        "angles": angle_summary(read_angle_log(run_dir / "angles.tsv")),
        "seconds": round(time.time() - start, 1),
    }
    write_result(run_dir, result)
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
