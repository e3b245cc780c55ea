"""The converged study of docs/results.md, phase by phase, resumable.

Every phase runs ``acl-fairseq-compare`` (resumable: a finished run is never trained again) into
``WORK/runs/<task>/...``, and every choice is made on dev and written to
``WORK/runs/<task>/choices.json`` with all the dev scores it was made from; test accuracy is
only reported. The data comes from ``python -m studies data`` (same ``--work-dir``).

Protocol (each stage): MiniLM-L6, mean pooling, batch 32, Adam (0.9, 0.98), weight decay 0.1,
6% warm-up then linear decay over the epoch cap, validation 4 times per epoch, the checkpoint
with the best dev accuracy kept, training stopped after a full epoch without a better dev
accuracy (``--patience 4``). Stage 2 (multi-exit) trains a fixed budget, the same for joint CE
and ACL-CL.

Phases (``TASK`` is ``movie`` or ``pair``)::

    TASK-lr        CE, seed 1, the task's learning rates; chooses the shared learning rate
    TASK-grid      CE+SCL (without angle measurement) and ACL, seed 1, every (lambda, tau) of
                   GRID
    TASK-seeds     CE, CE+SCL and ACL at the chosen values, SEEDS (the CE/SCL angle measured on
                   seed 1)
    movie-variants ACL-CL variants (teacher, weighting, lambda_cl) on seed 1, and joint CE
    movie-exits    joint CE and the chosen ACL-CL variant, SEEDS (stage 2 of the seed runs)
    movie-earlyexit  entropy early exit of both multi-exit families (seed 1) on test
    fewshot        CE, CE+SCL, ACL at the movie choices: FEWSHOT sizes x 5 seeds
    restore        put the committed results of docs/study back under WORK (another machine)
    exit-training  the training study for early answers, and exit-training-report its tables
                   (studies/exit_training.py, docs/study/exit-training.md)

Usage::

    python -m studies movie-lr --work-dir study_work --threads 1
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
from pathlib import Path

from acl_fairseq.data.splits import count_examples
from acl_fairseq.experiment import commands
from acl_fairseq.experiment.fewshot import best_on_dev
from studies.data import REPO
from studies.runs import check_retrained, link_run, need_checkpoints, restore

# Sized to about 10-15 CPU-hours on 2 cores (1 thread per run, 2 runs at a time): an epoch cap
# of 2, a 2-point lambda grid at tau 0.3 (the same for both methods and both tasks), one epoch
# of stage 2, 60 updates per few-shot run.
# (lambda, tau), the same for both methods
GRID = ((0.1, 0.3), (0.5, 0.3))
SEEDS = (1, 2, 3)
FEWSHOT_SIZES = (16, 64, 256, 1024)
FEWSHOT_SEEDS = (1, 2, 3, 4, 5)
FEWSHOT_UPDATES = 60
BATCH = 32
TASKS = {
    # data folder, learning rates tried with CE, epoch cap, epochs of stage 2; the pair task
    # did not leave the majority class within 140 updates at 2e-5, so it starts higher; both
    # go up to 2e-4 (with random batches, 1e-4 was the best of 2e-5..1e-4 on movie, at the cap)
    "movie": {
        "data": "movie-bin",
        "lrs": (2e-5, 5e-5, 1e-4, 2e-4),
        "epochs": 2,
        "stage2_epochs": 1,
    },
    "pair": {"data": "pair-bin", "lrs": (5e-5, 1e-4, 2e-4), "epochs": 2, "stage2_epochs": 1},
}
# batches of similar length (--group-by-length) in every run: a random batch pads its sentences
# to its longest, about twice the tokens here (pairs: 57.9 tokens on average, 124 per example
# in random batches of 32, 59 grouped; movie sentences: 26.9, 52 and 27)
BATCHING = "--group-by-length"
# ACL runs (exact ACL-Grad) also log the angle that --acl-grad-scope top:K would measure on the
# same update (heads + top K encoder layers): the cheap scopes' agreement at convergence
ACL_EXTRA = "--acl-grad-log-top-k 1,2,3"
# entropy thresholds of the early-exit curve (nats; ln 2 = 0.693 lets every row leave at exit 1)
EXIT_THRESHOLDS = "0.05,0.1,0.2,0.3,0.4,0.5,0.6,0.65,0.69"
VALIDATIONS_PER_EPOCH = 4
PATIENCE = VALIDATIONS_PER_EPOCH  # one epoch without a better dev accuracy
# ACL-CL variants: (teacher, contrastive weighting of the exits, lambda_cl)
VARIANTS = {
    "live-exit-0.5": ("live", "exit", 0.5),
    "frozen-exit-0.5": ("frozen", "exit", 0.5),
    "frozen-uniform-0.5": ("frozen", "uniform", 0.5),
}


def lr_name(lr: float) -> str:
    return f"lr{lr:g}"


class Study:
    def __init__(self, work: Path, task: str):
        self.work = work.resolve()
        self.task = task
        self.spec = TASKS.get(task, TASKS["movie"])
        self.root = self.work / "runs" / task
        self.choices_file = self.root / "choices.json"

    # ------------------------------------------------------------------ common
    def data(self, name: str | None = None) -> Path:
        return self.work / "data" / (name or self.spec["data"])

    def common(self, data: Path, epochs: int, validate: int, extra: str) -> list[str]:
        model = self.work / "minilm-fairseq"
        return [
            str(data), "--restore-file", str(model / "model.pt"),
            "--arch-args-file", str(model / "fairseq_args.txt"), "--batch-size", str(BATCH),
            "--epochs", str(epochs), "--exit-pooling", "mean",
            "--validate-interval-updates", str(validate), "--extra", f"{BATCHING} {extra}", "--cpu",
        ]  # fmt: skip

    def stage1(self, method: str = "") -> list[str]:
        data = self.data()
        updates_per_epoch = -(-count_examples(data) // BATCH)
        validate = updates_per_epoch // VALIDATIONS_PER_EPOCH
        extra = f"--patience {PATIENCE}" + (f" {ACL_EXTRA}" if method == "acl" else "")
        return self.common(data, self.spec["epochs"], validate, extra)

    def compare(self, out: Path, args: list[str]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        record = out / "study.json"
        if not record.exists():
            record.write_text(json.dumps({"commit": git_commit()}) + "\n", encoding="utf-8")
        print(f"\n### {out.relative_to(self.work)}", flush=True)
        compare = [sys.executable, "-m", "acl_fairseq.cli.compare", *args, "--out", str(out)]
        code = commands.run(compare).returncode
        if code:
            raise SystemExit(f"compare failed in {out}")

    def choices(self) -> dict:
        if self.choices_file.exists():
            return json.loads(self.choices_file.read_text(encoding="utf-8"))
        return {}

    def choose(self, key: str, scores: dict[str, float], value) -> None:
        """Records the choice ``key = value`` with the dev scores it was made from. Two chains
        of one phase (``--methods``) choose into the same file: the read-modify-write holds a
        lock and the file is replaced whole, so no choice is lost and none is read half-written."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "choices.lock", "a", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            data = self.choices()
            data[key] = {"chosen": value, "dev_accuracy": scores}
            partial = self.choices_file.with_suffix(".json.partial")
            partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            os.replace(partial, self.choices_file)
        print(f"{self.task}: chose {key} = {value} on dev ({scores})", flush=True)

    def chosen(self, key: str):
        data = self.choices()
        if key not in data:
            raise SystemExit(f"{self.task}: no {key} chosen yet; run the phase that chooses it")
        return data[key]["chosen"]

    # ------------------------------------------------------------------ phases
    def lr(self) -> None:
        scores = {}
        for lr in self.spec["lrs"]:
            out = self.root / "lr" / lr_name(lr)
            args = [*self.stage1("ce"), "--methods", "ce", "--seeds", "1", "--lr", f"{lr}"]
            self.compare(out, args)
            scores[f"{lr:g}"] = dev_accuracy(out, "ce-seed1")
        self.choose("lr", scores, float(best_on_dev(scores)))

    def grid(self) -> None:
        lr = self.chosen("lr")
        for method in ("ce_scl", "acl"):
            scores = {}
            for lam, tau in GRID:
                out = self.root / "grid" / f"{method}-lam{lam:g}-tau{tau:g}"
                args = [*self.stage1(method), "--methods", method, "--seeds", "1"]
                args += ["--lr", f"{lr}"]
                args += ["--contrastive-lambda", f"{lam}", "--temperature", f"{tau}"]
                if method == "ce_scl":
                    args.append("--ce-scl-plain")
                self.compare(out, args)
                scores[f"{lam:g},{tau:g}"] = dev_accuracy(out, f"{method}-seed1")
            lam, tau = map(float, best_on_dev(scores).split(","))
            self.choose(method, scores, [lam, tau])

    def hyper_parameters(self, method: str) -> list[str]:
        """The chosen learning rate (and lambda, tau) of ``method``."""
        args = ["--lr", f"{self.chosen('lr')}"]
        if method in ("ce_scl", "acl", "acl_cl"):
            lam, tau = self.chosen("acl" if method == "acl_cl" else method)
            args += ["--contrastive-lambda", f"{lam}", "--temperature", f"{tau}"]
        return args

    def seeds(self) -> None:
        main = self.root / "main"
        seeds = ",".join(map(str, SEEDS))
        lr = self.chosen("lr")
        link_run(self.root / "lr" / lr_name(lr), main, "ce-seed1")
        lam, tau = self.chosen("acl")
        link_run(self.root / "grid" / f"acl-lam{lam:g}-tau{tau:g}", main, "acl-seed1")
        for method in ("ce", "acl", "ce_scl"):
            args = [*self.stage1(method), *self.hyper_parameters(method), "--methods", method]
            if method == "ce_scl":  # the CE/SCL angle is measured on seed 1 only (cost)
                self.compare(main, [*args, "--seeds", "1"])
                args += ["--ce-scl-plain", "--seeds", ",".join(map(str, SEEDS[1:]))]
            else:
                args += ["--seeds", seeds]
            self.compare(main, args)

    def stage2_args(self, variant: str) -> list[str]:
        teacher, weighting, lam_cl = VARIANTS[variant]
        return [
            "--stage2-epochs", str(self.spec["stage2_epochs"]), "--acl-cl-teacher", teacher,
            "--cross-layer-weighting", weighting, "--cross-layer-lambda", f"{lam_cl}",
        ]  # fmt: skip

    def variants(self) -> None:
        scores = {}
        main = self.root / "main"
        outs = {name: self.root / "variants" / name for name in VARIANTS}
        dependents = [out / "runs" / "acl_cl-seed1" for out in outs.values()]
        again = need_checkpoints(main, ["acl-seed1"], dependents)
        for name, out in outs.items():
            link_run(main, out, "acl-seed1")
            # the flags of the stage-1 run it restores (acl: the top-K angle log)
            args = [*self.stage1("acl"), *self.hyper_parameters("acl_cl")]
            args += self.stage2_args(name)
            self.compare(out, [*args, "--methods", "acl_cl", "--seeds", "1"])
            scores[name] = dev_accuracy(out, "acl_cl-seed1")
        check_retrained(main, again)
        self.choose("acl_cl", scores, best_on_dev(scores))

    def exits(self) -> None:
        main = self.root / "main"
        variant = self.chosen("acl_cl")
        seeds = ",".join(map(str, SEEDS))
        link_run(self.root / "variants" / variant, main, "acl_cl-seed1")
        again = []
        for method, stage1 in (("multi_exit_joint", "ce"), ("acl_cl", "acl")):
            for s in SEEDS:
                dependent = [main / "runs" / f"{method}-seed{s}"]
                again += need_checkpoints(main, [f"{stage1}-seed{s}"], dependent)
        for method, stage1 in (("multi_exit_joint", "ce"), ("acl_cl", "acl")):
            args = [*self.stage1(stage1), *self.hyper_parameters(stage1)]
            args += self.stage2_args(variant)
            self.compare(main, [*args, "--methods", method, "--seeds", seeds])
        check_retrained(main, again)

    def earlyexit(self) -> None:
        """Entropy early exit of both multi-exit families (seed 1) on the test split."""
        out = self.root / "earlyexit"
        out.mkdir(parents=True, exist_ok=True)
        for method in ("multi_exit_joint", "acl_cl"):
            table = out / f"{method}-seed1.tsv"
            if table.exists():
                continue
            checkpoint = self.root / "main" / "runs" / f"{method}-seed1" / "checkpoint_best.pt"
            commands.run(
                [
                    sys.executable, "-m", "acl_fairseq.cli.sweep",
                    "--checkpoint", str(checkpoint), "--data", str(self.data()),
                    "--split", "test", "--policy", "entropy", "--thresholds", EXIT_THRESHOLDS,
                    "--batch-sizes", "32", "--repeats", "1", "--out", str(table), "--cpu",
                ],
                check=True,
            )  # fmt: skip

    def fewshot(self) -> None:
        movie = Study(self.work, "movie")
        for k in FEWSHOT_SIZES:
            for seed in FEWSHOT_SEEDS:
                data = self.data(f"fewshot{k}-s{seed}-bin")
                updates_per_epoch = -(-count_examples(data) // BATCH)
                epochs = -(-FEWSHOT_UPDATES // updates_per_epoch)
                extra = "--validate-interval 1000 --save-interval 1000"
                args = self.common(data, epochs, FEWSHOT_UPDATES // 4, extra)
                args += ["--max-update", str(FEWSHOT_UPDATES)]
                out = self.root / f"k{k}" / f"s{seed}"
                for method in ("ce", "ce_scl", "acl"):
                    run = [*args, *movie.hyper_parameters(method), "--methods", method]
                    run += ["--seeds", str(seed)]
                    if method == "ce_scl":
                        run.append("--ce-scl-plain")
                    self.compare(out, run)


def git_commit() -> str:
    try:
        return commands.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def dev_accuracy(out: Path, run: str) -> float:
    result = json.loads((out / "runs" / run / "test.json").read_text(encoding="utf-8"))
    return float(result["dev"]["accuracy"])


PHASES = {
    "lr": Study.lr,
    "grid": Study.grid,
    "seeds": Study.seeds,
    "variants": Study.variants,
    "exits": Study.exits,
    "earlyexit": Study.earlyexit,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("phases", nargs="+", help="e.g. movie-lr pair-grid fewshot")
    p.add_argument("--work-dir", type=Path, default=REPO / "study_work")
    p.add_argument("--threads", type=int, default=1, help="OMP threads of every run")
    p.add_argument(
        "--docs", type=Path, default=REPO / "docs" / "study", help="committed results (restore)"
    )
    p.add_argument(
        "--methods",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        help="second-round phases: only these methods (e.g. two processes sharing a phase); "
        "exit-training: only these recipes",
    )
    p.add_argument(
        "--seeds",
        type=lambda text: [int(v) for v in text.split(",") if v.strip()],
        help="second-round phases: only these seeds",
    )
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    for phase in args.phases:
        if phase == "restore":
            print(f"restored {restore(args.work_dir, args.docs)} runs", flush=True)
            continue
        from studies import exit_training
        from studies.round2 import run_phase  # it builds on this module

        if run_phase(args.work_dir, phase, args.methods, args.seeds):
            continue
        if exit_training.run_phase(args.work_dir, phase, args.methods, args.seeds):
            continue
        if phase == "fewshot":
            Study(args.work_dir, "fewshot").fewshot()
            continue
        task, _, step = phase.partition("-")
        if task not in TASKS or step not in PHASES:
            raise SystemExit(f"unknown phase {phase!r}: TASK-STEP with TASK in {list(TASKS)}")
        PHASES[step](Study(args.work_dir, task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
