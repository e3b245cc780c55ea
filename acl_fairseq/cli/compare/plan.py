"""The plan of a comparison: its runs, in training order, and the flags they share."""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from acl_fairseq.errors import AclValueError
from acl_fairseq.experiment.recipe import (
    ABLATIONS,
    CONTRASTIVE_METHODS,
    METHODS,
    MULTI_EXIT_METHODS,
    STAGE1,
    flag_value,
    model_flags,
)
from acl_fairseq.experiment.results import SWEEP_METHODS

# every method compare runs, in training order (a stage-1 method before the stage-2 methods
# restoring it); by default the main comparison, METHODS
COMPARE_METHODS = (
    "ce", "ce_scl", "ce_scl_grad", "acl", "acl_embed", "joint_from_start", "multi_exit_joint",
    "joint_from_acl", "acl_cl",
)  # fmt: skip
assert set(COMPARE_METHODS) == {*METHODS, *ABLATIONS}
CE_SCL_ANGLE_THRESHOLD = 180.0  # the angle never exceeds 180 degrees: nothing is dropped


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
    def stage2(self) -> bool:
        """Whether the run restores a stage-1 run (a multi-exit method other than
        ``joint_from_start``, which trains every exit from the pretrained model)."""
        return self.method in STAGE1

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
    seed by seed, all methods of a seed in ``COMPARE_METHODS`` order; then the lambda sweep."""
    unknown = [m for m in methods if m not in COMPARE_METHODS]
    if unknown:
        raise AclValueError(
            f"unknown method(s) {unknown}; expected some of {list(COMPARE_METHODS)}"
        )
    wanted = set(methods) | {STAGE1[m] for m in methods if m in STAGE1}
    runs: list[Run] = []
    for seed in seeds:
        for method in COMPARE_METHODS:
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


def read_arch_args(file: str | None, text: str | None) -> list[str]:
    """The model flags (``--arch ...``) without ``--restore-file`` and ``--reset-*``."""
    if file:
        args = shlex.split(Path(file).read_text(encoding="utf-8"))
    else:
        args = shlex.split(text or "")
    out = model_flags(args)
    if not any(a in ("--arch", "-a") or a.startswith("--arch=") for a in out):
        raise AclValueError(
            f"no --arch in the model flags {' '.join(out)!r}: pass --arch-args-file "
            "(fairseq_args.txt of acl-fairseq-convert-bert) or --arch-args '--arch roberta_base'"
        )
    return out


def run_epochs(run: Run | None, opts: argparse.Namespace) -> int:
    """Epochs of a run: ``--stage2-epochs`` for the stage-2 runs, else ``--epochs``."""
    if run is not None and run.stage2 and opts.stage2_epochs:
        return opts.stage2_epochs
    return opts.epochs


def run_extra_args(run: Run, opts: argparse.Namespace) -> list[str]:
    """``--extra`` of a run, then ``--stage2-extra`` for a stage-2 run; stage-2 runs with
    ``--stage2-epochs`` drop ``--patience`` (a fixed budget, equal for both multi-exit
    methods)."""
    args = list(opts.extra_args)
    if run.stage2:
        args += list(getattr(opts, "stage2_extra_args", []))
    if run.stage2 and opts.stage2_epochs:
        while "--patience" in args:
            i = args.index("--patience")
            del args[i : i + 2]
        args = [a for a in args if not a.startswith("--patience=")]
    return args


def updates_per_epoch(opts: argparse.Namespace) -> int:
    """Optimizer updates of one epoch (``--batch-size``, ``--update-freq`` in ``--extra``)."""
    update_freq = int((flag_value(opts.extra_args, "--update-freq") or "1").split(",")[0])
    return math.ceil(math.ceil(opts.n_train / opts.batch_size) / update_freq)


def plan_epochs(opts: argparse.Namespace) -> str | None:
    """Sets ``opts.epochs`` when it was not given: enough epochs for ``--max-update`` updates,
    else 1. Returns a line to print when ``--epochs`` stops the runs before ``--max-update``."""
    per_epoch = updates_per_epoch(opts)
    if opts.epochs is None:
        opts.epochs = math.ceil(opts.max_update / per_epoch) if opts.max_update else 1
        return None
    if opts.max_update and opts.epochs * per_epoch < opts.max_update:
        return (
            f"note: --epochs {opts.epochs} ends every run after {opts.epochs * per_epoch} "
            f"updates ({per_epoch} per epoch), before --max-update {opts.max_update}; leave "
            "--epochs out to train the --max-update updates"
        )
    return None


def total_updates(opts: argparse.Namespace, run: Run | None = None) -> int:
    """Optimizer updates of one run (for the polynomial schedule and the progress)."""
    updates = run_epochs(run, opts) * updates_per_epoch(opts)
    if opts.max_update:
        updates = min(updates, opts.max_update)
    return max(1, updates)
