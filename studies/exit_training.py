"""The training study for early answers (docs/study/exit-training.md): five recipes for the
exits of the converged movie model, each judged by one rule fixed before the runs
(``studies.exit_judge``).

Phases (``python -m studies PHASE``)::

    exit-training         per seed (``--seeds``, default 1-3), the shared stage 1 (the lambda
                          phase's ACL run at lambda 0.5; trained again when its checkpoint is
                          missing and checked against the committed numbers), then every recipe
                          (``--methods`` names recipes) into WORK/runs/exit-training/RECIPE,
                          then the judge on the run (judge.json) and its CPU time (cpu.json)
    exit-training-report  the tables and the verdict: docs/study/exit-training/ (``--docs``'s
                          folder, default docs/study/exit-training)

Seed by seed: a study cut short has every recipe on its seeds.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from acl_fairseq.cpu_features import cpu_model_name
from studies.data import REPO
from studies.exit_judge import GOAL, MARGIN, RULE, judge, verdicts
from studies.phases import TASKS, git_commit
from studies.records import checkout_of
from studies.round2 import MAIN_LAMBDA, MOVIE, STAGE2_VARIANT, Round2, contrastive
from studies.runs import check_retrained, finished, link_run, need_checkpoints

SEEDS = (1, 2, 3)
FOLDER = "exit-training"
STAGE1_EPOCHS = TASKS["movie"]["epochs"]  # 2: the stage 1 of every recipe but joint-from-start


@dataclass(frozen=True)
class Recipe:
    """One way of training the exits: a compare method and its flags."""

    method: str  # acl_cl (stage 2 from the shared stage 1) or joint_from_start
    epochs: int  # of stage 2, or of the whole run for joint_from_start
    weighting: str | None  # --exit-weighting (None: the criterion's default, layer)
    stage2_extra: str = ""  # --stage2-extra
    what: str = ""


RECIPES = {
    "control": Recipe(
        "acl_cl", 1, None, what="the study's ACL-CL stage 2: one epoch, PABEE's layer weights"
    ),
    "long-uniform": Recipe(
        "acl_cl", STAGE1_EPOCHS, "uniform",
        what="ACL-CL as long as stage 1, uniform weights (gradient equilibrium under Adam)",
    ),
    "long-reverse": Recipe(
        "acl_cl", STAGE1_EPOCHS, "reverse",
        what="ACL-CL as long as stage 1, weights toward the first exits (6:5:4:3:2:1)",
    ),
    "long-alternating": Recipe(
        "acl_cl", STAGE1_EPOCHS, "uniform", "--alternate-exits",
        what="ACL-CL as long as stage 1, BERxiT's alternation: odd updates the final exit only",
    ),
    "joint-from-start": Recipe(
        "joint_from_start", STAGE1_EPOCHS + 1, "uniform",
        what="joint CE over every exit from MiniLM, no stage 1, the budget of stage 1 + 2",
    ),
}  # fmt: skip


def run_name(recipe: Recipe, seed: int) -> str:
    return f"{recipe.method}-seed{seed}"


class ExitTraining(Round2):
    """The phase; ``methods`` are recipe names, ``seeds`` the seeds to run."""

    def __init__(
        self, work: Path, methods: list[str] | None = None, seeds: list[int] | None = None
    ):
        super().__init__(work, FOLDER, methods, seeds)
        self.seeds = tuple(seeds) if seeds else SEEDS
        self.stage1_out = self.work / "runs" / "lambda" / "main"

    def recipe_args(self, name: str, seed: int) -> list[str]:
        """The compare arguments of recipe ``name`` on ``seed``."""
        recipe = RECIPES[name]
        if recipe.method == "joint_from_start":  # a stage-1 run of its own: no ACL, no angles
            args = [*self.stage1_on("movie-bin", recipe.epochs, "ce"), "--lr", f"{MOVIE['lr']}"]
        else:  # the flags of the stage-1 run it restores, then stage 2's
            args = [*self.stage1_on("movie-bin", STAGE1_EPOCHS, "acl"), "--lr", f"{MOVIE['lr']}"]
            args += contrastive("acl", MAIN_LAMBDA, MOVIE["tau"])
            teacher, weighting, lam_cl = STAGE2_VARIANT
            args += ["--stage2-epochs", str(recipe.epochs), "--acl-cl-teacher", teacher]
            args += ["--cross-layer-weighting", weighting, "--cross-layer-lambda", f"{lam_cl}"]
        if recipe.weighting:
            args += ["--exit-weighting", recipe.weighting]
        if recipe.stage2_extra:
            args.append(f"--stage2-extra={recipe.stage2_extra}")
        return [*args, "--methods", recipe.method, "--seeds", str(seed)]

    def run(self) -> None:
        names = self.only(list(RECIPES))
        for seed in self.seeds:
            self.stage1(seed, names)
            for name in names:
                out = self.root / name
                if RECIPES[name].method != "joint_from_start":
                    link_run(self.stage1_out, out, f"acl-seed{seed}")
                run_dir = out / "runs" / run_name(RECIPES[name], seed)
                args = self.recipe_args(name, seed)
                self.timed(
                    run_dir, "train_eval", lambda out=out, args=args: self.compare(out, args)
                )
                self.judged(run_dir)

    def stage1(self, seed: int, names: list[str]) -> None:
        """The shared stage 1 of ``seed``, trained again (once) if a recipe needs its
        checkpoint; its CPU time in ``stage1-seedK.cpu.json`` beside it."""
        dependents = [
            self.root / n / "runs" / run_name(RECIPES[n], seed)
            for n in names
            if RECIPES[n].method != "joint_from_start"
        ]
        name = f"acl-seed{seed}"
        again = need_checkpoints(self.stage1_out, [name], dependents)
        if not again:
            return
        args = [*self.stage1_on("movie-bin", STAGE1_EPOCHS, "acl"), "--lr", f"{MOVIE['lr']}"]
        args += contrastive("acl", MAIN_LAMBDA, MOVIE["tau"])
        args += ["--methods", "acl", "--seeds", str(seed)]
        record = self.stage1_out / "runs" / name
        self.timed(record, "train_eval", lambda: self.compare(self.stage1_out, args))
        check_retrained(self.stage1_out, again)

    def timed(self, run_dir: Path, key: str, work, done_before: bool | None = None) -> None:
        """Runs ``work`` and adds its CPU time (this process and its children) and wall time
        under ``key`` to ``run_dir/cpu.json``; nothing is added when the work was done
        before: the record has ``key``, or ``done_before`` (default: the run was finished)."""
        path = run_dir / "cpu.json"
        record = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if key in record:
            work()  # resumable: checks and skips
            return
        was_finished = finished(run_dir) if done_before is None else done_before
        before = _cpu_seconds(), time.time()
        work()
        if was_finished:
            return
        cpu, wall = _cpu_seconds() - before[0], time.time() - before[1]
        record[key] = {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1)}
        record.setdefault("commit", git_commit())
        record.setdefault("cpu", cpu_model_name())
        record[f"{key}_load_avg"] = [round(x, 2) for x in os.getloadavg()]
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")

    def judged(self, run_dir: Path) -> None:
        """judge.json of the run (the rule and the exits, from one pass over dev and test)."""
        out = run_dir / "judge.json"
        if out.exists():
            return
        checkpoint = run_dir / "checkpoint_best.pt"
        if not checkpoint.exists():
            raise SystemExit(f"{checkpoint}: missing, so {run_dir} cannot be judged")

        def work() -> None:
            result = judge_checkpoint(checkpoint, self.data("movie-bin"))
            out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")

        self.timed(run_dir, "judge", work, done_before=False)  # the run is finished: judge it


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def judge_checkpoint(checkpoint: Path, data: Path) -> dict[str, Any]:
    """Every exit's logits on dev and test (fp32, one thread, batch 64), then ``judge``."""
    import torch

    from acl_fairseq.data.splits import load_batches
    from acl_fairseq.early_exit.thresholds import collect_exits
    from acl_fairseq.inference.loader import load_for_inference
    from acl_fairseq.models.heads import DEFAULT_HEAD

    torch.set_num_threads(1)
    loaded = load_for_inference(checkpoint, data, "cpu", multi_exit=True, dtype="fp32")
    splits = {}
    for split in ("valid", "test"):
        batches = load_batches(loaded.task, split, 64)
        splits[split] = collect_exits(loaded.model, batches, DEFAULT_HEAD)
    torch.save(
        {s: ([(layer, x.half()) for layer, x in e], t) for s, (e, t) in splits.items()},
        checkpoint.parent / "exit_logits.pt",
    )  # beside the checkpoint, never committed: the policies can be searched again without it
    (dev, dev_t), (test, test_t) = splits["valid"], splits["test"]
    return judge(dev, dev_t, test, test_t)


# ------------------------------------------------------------------------------- report
RUN_FILES = (
    "command.txt", "run.json", "test.json", "train.log", "test.log", "judge.json", "cpu.json",
    "predictions.tsv",
)  # fmt: skip
RUN_COLUMNS = [
    "recipe", "seed", "dev_full", "test_full", *[f"test_exit{i}" for i in range(1, 6)],
    *[f"agree_exit{i}" for i in range(1, 6)], "oracle_speedup", "policy", "dev_mean_layer",
    "dev_agreement", "test_accuracy", "test_drop_own", "test_mean_layer", "test_speedup",
    "within_margin", "cpu_min", "wall_min", "judge_cpu_s", "best_update", "commit",
]  # fmt: skip


def collect_runs(work: Path) -> dict[str, list[dict[str, Any]]]:
    """``{recipe: [record per judged seed]}`` from WORK/runs/exit-training."""
    root = work / "runs" / FOLDER
    out: dict[str, list[dict[str, Any]]] = {}
    for name, recipe in RECIPES.items():
        for seed in SEEDS:
            run_dir = root / name / "runs" / run_name(recipe, seed)
            if not (run_dir / "judge.json").exists():
                continue
            record = {"recipe": name, "seed": seed, "run_dir": run_dir}
            for part in ("judge", "test", "cpu"):
                path = run_dir / f"{part}.json"
                record[part] = json.loads(path.read_text("utf-8")) if path.exists() else {}
            out.setdefault(name, []).append(record)
    return out


def run_row(r: dict[str, Any], floor: float) -> list[Any]:
    j, test, cpu = r["judge"], r["test"], r["cpu"]
    rule = j["judge"]
    exits = j["exits"]
    train = cpu.get("train_eval", {})
    return [
        r["recipe"], r["seed"], exits["valid"]["6"], exits["test"]["6"],
        *[exits["test"][str(i)] for i in range(1, 6)],
        *[j["agreement_with_final_test"][str(i)] for i in range(1, 6)],
        j["oracle_test"]["layer_speedup"], rule["policy"], rule["dev"]["mean_exit_layer"],
        rule["dev"]["agreement"], rule["test"]["accuracy"],
        round(rule["test"]["accuracy"] - rule["test"]["full_accuracy"], 2),
        rule["test"]["mean_exit_layer"], rule["test"]["layer_speedup"],
        rule["test"]["accuracy"] >= floor - 1e-9,
        round(train["cpu_s"] / 60, 1) if train else "",
        round(train["wall_s"] / 60, 1) if train else "",
        cpu.get("judge", {}).get("cpu_s", ""), int(test.get("dev", {}).get("num_updates", 0)),
        (cpu.get("commit") or "")[:7],
    ]  # fmt: skip


def _mean_std(values: list[float], digits: int = 2) -> str:
    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "-"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def summary_markdown(per_recipe: dict[str, list[dict[str, Any]]], verdict: dict[str, Any]) -> str:
    """The study's table (mean ± sample std over seeds) and its verdict."""
    lines = [
        "# Exit-training study: generated tables",
        "",
        "Written by `python -m studies exit-training-report`; the protocol and the reading are "
        "in [docs/study/exit-training.md](../exit-training.md). Test accuracy in percent, mean "
        "± sample std over the seeds; speed-up in layers (6 / mean exit layer).",
        "",
        f"Rule: **{RULE}** (chosen on the 600 dev sentences, run on the 2,000 test sentences). "
        f"Reference: the best full depth of the study, {verdict['reference_recipe']} at "
        f"{verdict['reference_accuracy']:.2f}; floor {verdict['floor']:.2f} ({MARGIN:g} point "
        f"below). Goal: >= {GOAL:g}x within the floor, on the mean over {len(SEEDS)} seeds: "
        f"**{verdict['outcome']}** ({verdict['runs']} of {verdict['runs_expected']} runs).",
        "",
        "| recipe | seeds | full depth | exits 1-5 | oracle | rule: test accuracy | rule: "
        "speed-up (min-max) | seeds within the floor | goal | CPU min per run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in per_recipe.items():
        v = verdict["recipes"][name]
        exits = " / ".join(
            f"{statistics.fmean(r['judge']['exits']['test'][str(i)] for r in runs):.1f}"
            for i in range(1, 6)
        )
        full = [r["judge"]["exits"]["test"]["6"] for r in runs]
        oracle = [r["judge"]["oracle_test"]["layer_speedup"] for r in runs]
        acc = [r["judge"]["judge"]["test"]["accuracy"] for r in runs]
        speed = [r["judge"]["judge"]["test"]["layer_speedup"] for r in runs]
        cpu = [r["cpu"]["train_eval"]["cpu_s"] / 60 for r in runs if "train_eval" in r["cpu"]]
        low, high = v["layer_speedup_range"]
        lines.append(
            f"| {name} | {len(runs)} | {_mean_std(full)} | {exits} | "
            f"{statistics.fmean(oracle):.2f}x | {_mean_std(acc)} | {_mean_std(speed)}x "
            f"({low:.2f}-{high:.2f}) | {v['seeds_within_margin']}/{len(runs)} | "
            f"{v['outcome']} | {_mean_std(cpu, 1) if cpu else '-'} |"
        )
    lines += ["", "Every run: [runs.csv](runs.csv); its files: [runs/](runs/).", ""]
    return "\n".join(lines)


def report(work: Path, out: Path) -> dict[str, Any]:
    """Writes ``out``/README.md, runs.csv, verdict.json and each run's small files."""
    per_recipe = collect_runs(work)
    judged = {k: [r["judge"] for r in v] for k, v in per_recipe.items()}
    verdict = verdicts(judged, seeds=len(SEEDS), num_recipes=len(RECIPES))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(RUN_COLUMNS)
        for runs in per_recipe.values():
            writer.writerows(run_row(r, verdict["floor"]) for r in runs)
    (out / "verdict.json").write_text(json.dumps(verdict, indent=1) + "\n", encoding="utf-8")
    (out / "README.md").write_text(summary_markdown(per_recipe, verdict), encoding="utf-8")
    for runs in per_recipe.values():
        for r in runs:
            dest = out / "runs" / r["recipe"] / r["run_dir"].name
            dest.mkdir(parents=True, exist_ok=True)
            command = r["run_dir"] / "command.txt"
            checkout = checkout_of(shlex.split(command.read_text())) if command.exists() else None
            for name in RUN_FILES:
                src = r["run_dir"] / name
                if src.exists():
                    text = src.read_text(encoding="utf-8", errors="replace")
                    text = text.replace(str(work.resolve()), "<work>")
                    for repo in filter(None, (checkout, str(REPO))):
                        text = text.replace(f"{repo}/", "<repo>/")
                    (dest / name).write_text(text, encoding="utf-8")
    return verdict


def run_phase(work: Path, phase: str, methods: list[str] | None, seeds: list[int] | None,
              docs: Path | None = None) -> bool:  # fmt: skip
    """Runs ``phase`` if it is this study's; False otherwise."""
    if phase == "exit-training":
        ExitTraining(work, methods, seeds).run()
        return True
    if phase == "exit-training-report":
        out = docs if docs is not None else REPO / "docs" / "study" / FOLDER
        verdict = report(work.resolve(), out)
        print(f"wrote {out}; goal: {verdict['outcome']}", flush=True)
        return True
    return False
