"""The second round of the study: the paper's central claims where they can be decided.

Phases (``python -m studies PHASE``; every run keeps its dev and test predictions for the
per-example tests of the report; same protocol as the first round: MiniLM-L6, mean pooling,
batch 32, grouped batches, checkpoints chosen on dev)::

    pair-converged-cap  CE, seed 1, on the sentence pairs with a 6-epoch cap, stopped after an
                        epoch without a better dev accuracy: the cap of the next phase is the
                        epoch of its best dev accuracy (at least the first round's 2)
    pair-converged      at that cap, 5 seeds of CE, ACL (ACL-Embed + ACL-Grad) and ACL-Embed
                        without ACL-Grad (``acl_embed``), in bf16: ACL-Grad's effect (2x2 with
                        CE+SCL and CE+SCL gated by ACL-Grad: pair-converged-scl)
    pair-converged-fp32 its precision check: CE and ACL, seed 1, in fp32 (``pair-converged/fp32``)
    lambda              movie sentences: CE, CE+SCL and ACL at lambda 0.1 / 0.5 / 1.0 (tau 0.3),
                        5 seeds; the lambda 0.5 ACL runs keep their checkpoints (the stage 1 of
                        acl-cl-same-start)
    fewshot-dev         16 and 64 sentences per class, 10 draws, each with a dev split drawn from
                        the pool with as many sentences as its training set (data: ``python -m
                        studies data --fewshot-dev``); the protocol of acl_fairseq.experiment.
                        fewshot (acl-fairseq-fewshot's): 60 updates validated every 5, the
                        learning rate chosen per method and draw on that small dev from 1e-4 /
                        2e-4 / 5e-4; in bf16
    acl-cl-same-start   joint CE and ACL-CL stage 2 from the same ACL stage-1 checkpoints (the
                        lambda phase's lambda 0.5 runs), 5 seeds, equal budgets; per seed, the
                        entropy threshold chosen on dev (at most 1 point below full depth) and
                        reported on test, with the oracle rows
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

from acl_fairseq.data.splits import count_examples
from acl_fairseq.experiment import commands, fewshot
from acl_fairseq.inference.saved_policy import POLICY_FILE
from studies.data import FEWSHOT_DEV_DRAWS, FEWSHOT_DEV_SIZES
from studies.phases import (
    ACL_EXTRA,
    BATCH,
    PATIENCE,
    TASKS,
    VALIDATIONS_PER_EPOCH,
    Study,
    dev_accuracy,
    lr_name,
)
from studies.runs import link_run

SEEDS = (1, 2, 3, 4, 5)
CAP_EPOCHS = 6  # the longest cap tried on the pairs
PAIR = {"lr": 1e-4, "lambda": 0.1, "tau": 0.3}  # the first round's choices on the pairs (dev)
MOVIE = {"lr": 2e-4, "tau": 0.3}  # the movie choices; lambda is what the phase varies
LAMBDAS = (0.1, 0.5, 1.0)
MAIN_LAMBDA = 0.5  # the first round's movie choice: its ACL runs are acl-cl-same-start's stage 1
STAGE2_VARIANT = ("frozen", "exit", 0.5)  # the first round's ACL-CL choice (teacher, weights, λcl)
MAX_ACCURACY_DROP = 1.0  # early exit: the threshold chosen on dev
EXIT_SPLITS = ("valid", "test")
# pair-converged and fewshot-dev train under the task's bf16 autocast: 2-3.5x faster on a CPU
# with bf16 instructions, with the demo protocol's accuracy unchanged (docs/results.md, "bf16
# mixed precision in training"). Every method of one comparison has one precision; the phases
# begun in fp32 (the pair cap, lambda, acl-cl-same-start) stay in fp32.
BF16 = "--autocast bf16"
PRECISION_CHECK = {"methods": ["ce", "acl"], "seeds": [1]}  # pair-converged-fp32's default part


def fewshot_dev_data(k: int, draw: int) -> str:
    """Data folder name of a draw (written by ``python -m studies data --fewshot-dev``)."""
    return f"fewshotdev{k}-d{draw}-bin"


def contrastive(method: str, lam: float, tau: float) -> list[str]:
    return ["--contrastive-lambda", f"{lam}", "--temperature", f"{tau}"] if method != "ce" else []


class Round2(Study):
    """The phases above; ``task`` is the phase family (the folder under ``WORK/runs``).

    ``methods`` / ``seeds``: the methods and seeds of a phase to run (``--methods``,
    ``--seeds``; default all), so that two processes can share a phase's runs. Phases run seed
    by seed: a study cut short has every method on its seeds.
    """

    def __init__(
        self,
        work: Path,
        task: str,
        methods: list[str] | None = None,
        seeds: list[int] | None = None,
    ):
        super().__init__(work, task)
        self.methods = methods
        self.given_seeds = seeds
        self.seeds = tuple(seeds) if seeds else SEEDS  # --seeds: a part of the phase

    def only(self, methods: list[str]) -> list[str]:
        if self.methods is None:
            return methods
        unknown = sorted(set(self.methods) - set(methods))
        if unknown:
            raise SystemExit(f"--methods: {unknown} not in this phase ({', '.join(methods)})")
        return [m for m in methods if m in self.methods]

    def stage1_on(self, data_name: str, epochs: int, method: str, extra: str = "") -> list[str]:
        data = self.data(data_name)
        updates_per_epoch = -(-count_examples(data) // BATCH)
        validate = updates_per_epoch // VALIDATIONS_PER_EPOCH
        extra = f"--patience {PATIENCE} {extra}" + (f" {ACL_EXTRA}" if method == "acl" else "")
        return self.common(data, epochs, validate, extra.strip())

    # ------------------------------------------------------------- pair-converged
    def pair_cap(self) -> None:
        out = self.root / "cap"
        args = [*self.stage1_on("pair-bin", CAP_EPOCHS, "ce"), "--lr", f"{PAIR['lr']}"]
        self.compare(out, [*args, "--methods", "ce", "--seeds", "1"])
        result = json.loads((out / "runs" / "ce-seed1" / "test.json").read_text("utf-8"))
        per_epoch = -(-count_examples(self.data("pair-bin")) // BATCH)
        best = int(result["dev"]["num_updates"])
        cap = min(CAP_EPOCHS, max(2, math.ceil(best / per_epoch)))
        scores = {"best_dev_update": best, "updates_per_epoch": per_epoch}
        self.choose("cap_epochs", scores, cap)

    def pair_main(self, with_scl: bool = False, fp32: bool = False) -> None:
        """The 5-seed comparison in bf16 (``main``); ``fp32``: its precision check (``fp32``:
        seed 1 of CE and ACL unless --seeds / --methods say otherwise)."""
        cap = int(self.chosen("cap_epochs"))
        out = self.root / ("fp32" if fp32 else "main")
        methods = ["ce", "acl", "acl_embed"] + (["ce_scl", "ce_scl_grad"] if with_scl else [])
        seeds = self.seeds
        if fp32:
            methods = self.methods or PRECISION_CHECK["methods"]
            seeds = tuple(self.given_seeds or PRECISION_CHECK["seeds"])
        for seed in seeds:
            for method in self.only(methods):
                extra = "" if fp32 else BF16
                args = [*self.stage1_on("pair-bin", cap, method, extra), "--lr", f"{PAIR['lr']}"]
                args += contrastive(method, PAIR["lambda"], PAIR["tau"])
                self.compare(out, [*args, "--methods", method, "--seeds", str(seed)])

    # ------------------------------------------------------------- lambda
    def lambda_study(self) -> None:
        out = self.root / "main"
        epochs = TASKS["movie"]["epochs"]
        lambdas = ",".join(f"{lam:g}" for lam in LAMBDAS)
        for seed in self.seeds:
            for method in self.only(["ce", "acl", "ce_scl"]):
                args = [*self.stage1_on("movie-bin", epochs, method), "--lr", f"{MOVIE['lr']}"]
                args += contrastive(method, MAIN_LAMBDA, MOVIE["tau"])
                if method == "ce_scl":
                    args.append("--ce-scl-plain")  # no angle measurement (the first round has it)
                if method != "ce":
                    args += ["--lambdas", lambdas]
                self.compare(out, [*args, "--methods", method, "--seeds", str(seed)])

    # ------------------------------------------------------------- fewshot-dev
    def fewshot_dev(self) -> None:
        for k in FEWSHOT_DEV_SIZES:
            for draw in FEWSHOT_DEV_DRAWS:
                data = self.data(fewshot_dev_data(k, draw))
                if not data.exists():
                    raise SystemExit(f"{data}: run python -m studies data --fewshot-dev first")
                per_epoch = -(-count_examples(data) // BATCH)
                epochs = -(-fewshot.UPDATES // per_epoch)
                extra = f"--validate-interval 1000 --save-interval 1000 {BF16}"
                args = self.common(data, epochs, fewshot.VALIDATE_EVERY, extra)
                args += ["--max-update", str(fewshot.UPDATES)]
                lam, tau = fewshot.CONTRASTIVE_LAMBDA, fewshot.TEMPERATURE
                for method in self.only(list(fewshot.METHODS)):
                    scores = {}
                    for lr in fewshot.LEARNING_RATES:
                        out = self.root / f"k{k}" / f"d{draw}" / lr_name(lr)
                        run = [*args, "--lr", f"{lr}", *contrastive(method, lam, tau)]
                        run += ["--methods", method, "--seeds", str(draw)]
                        if method == "ce_scl":
                            run.append("--ce-scl-plain")
                        self.compare(out, run)
                        scores[f"{lr:g}"] = dev_accuracy(out, f"{method}-seed{draw}")
                    chosen = float(fewshot.best_on_dev(scores))
                    self.choose(f"k{k}-d{draw}-{method}-lr", scores, chosen)

    # ------------------------------------------------------------- acl-cl-same-start
    def acl_cl_same_start(self) -> None:
        lambda_main = self.work / "runs" / "lambda" / "main"
        out = self.root / "main"
        teacher, weighting, lam_cl = STAGE2_VARIANT
        for seed in self.seeds:
            # the lambda phase's ACL run at lambda 0.5 (it keeps its checkpoint)
            link_run(lambda_main, out, f"acl-seed{seed}")
            for method in self.only(["joint_from_acl", "acl_cl"]):
                args = [*self.stage1_on("movie-bin", TASKS["movie"]["epochs"], "acl"), "--lr"]
                args += [f"{MOVIE['lr']}", *contrastive("acl", MAIN_LAMBDA, MOVIE["tau"])]
                args += ["--stage2-epochs", "1", "--acl-cl-teacher", teacher]
                args += ["--cross-layer-weighting", weighting]
                args += ["--cross-layer-lambda", f"{lam_cl}"]
                self.compare(out, [*args, "--methods", method, "--seeds", str(seed)])
                self.early_exit_on_dev(out, f"{method}-seed{seed}")

    def early_exit_on_dev(self, out: Path, run: str) -> None:
        """The entropy threshold chosen on dev (``--max-accuracy-drop``), then the whole curve
        and that threshold on test: ``earlyexit/RUN.{valid,test}.tsv``."""
        tables = self.root / "earlyexit"
        tables.mkdir(parents=True, exist_ok=True)
        checkpoint = out / "runs" / run / "checkpoint_best.pt"
        data = str(self.data("movie-bin"))
        common = ["--checkpoint", str(checkpoint), "--data", data, "--policy", "entropy"]
        common += ["--batch-sizes", "32", "--repeats", "0", "--cpu"]  # no timing
        dev_table, test_table = (tables / f"{run}.{split}.tsv" for split in EXIT_SPLITS)
        if not dev_table.exists():
            sweep(
                [*common, "--split", "valid", "--thresholds", "quantiles:20",
                 "--max-accuracy-drop", f"{MAX_ACCURACY_DROP:g}", "--out", str(dev_table)]
            )  # fmt: skip
        chosen = tables / f"{run}.policy.json"
        if not chosen.exists():  # the policy the dev sweep wrote next to the checkpoint
            shutil.copyfile(checkpoint.parent / POLICY_FILE, chosen)
        if not test_table.exists():
            policy = json.loads(chosen.read_text(encoding="utf-8"))["policy"]
            threshold = policy.split(":", 1)[1]
            sweep([*common, "--split", "test", "--thresholds", threshold, "--out", str(test_table)])


def sweep(args: list[str]) -> None:
    commands.run([sys.executable, "-m", "acl_fairseq.cli.sweep", *args], check=True)


ROUND2 = {
    "pair-converged-cap": ("pair-converged", Round2.pair_cap),
    "pair-converged": ("pair-converged", Round2.pair_main),
    "pair-converged-scl": ("pair-converged", lambda s: s.pair_main(with_scl=True)),
    "pair-converged-fp32": ("pair-converged", lambda s: s.pair_main(fp32=True)),
    "lambda": ("lambda", Round2.lambda_study),
    "fewshot-dev": ("fewshot-dev", Round2.fewshot_dev),
    "acl-cl-same-start": ("acl-cl-same-start", Round2.acl_cl_same_start),
}


def run_phase(
    work: Path, phase: str, methods: list[str] | None = None, seeds: list[int] | None = None
) -> bool:
    """Runs ``phase`` if it is one of this round's (only ``methods`` and ``seeds`` of it, if
    given); False otherwise."""
    if phase not in ROUND2:
        return False
    task, method = ROUND2[phase]
    method(Round2(work, task, methods, seeds))
    return True
