"""The plan of a comparison: its runs, in training order, and the flags they share."""

from __future__ import annotations

import argparse
import math
import re
import shlex
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# in training order (a stage-1 method before the stage-2 methods restoring it)
METHODS = (
    "ce", "ce_scl", "ce_scl_grad", "acl", "acl_embed", "multi_exit_joint", "joint_from_acl",
    "acl_cl",
)  # fmt: skip
# the main comparison: each method of the paper and its baseline
DEFAULT_METHODS = ("ce", "ce_scl", "acl", "multi_exit_joint", "acl_cl")
MULTI_EXIT_METHODS = ("multi_exit_joint", "joint_from_acl", "acl_cl")
SWEEP_METHODS = ("ce_scl", "acl")
CONTRASTIVE_METHODS = ("ce_scl", "ce_scl_grad", "acl", "acl_embed", "acl_cl")
STAGE1 = {"multi_exit_joint": "ce", "joint_from_acl": "acl", "acl_cl": "acl"}
MULTI_EXIT_ARCH = {
    "roberta": "multi_exit_roberta",
    "roberta_base": "multi_exit_roberta_base",
    "roberta_large": "multi_exit_roberta_large",
}
RESET_FLAGS = ("--reset-optimizer", "--reset-dataloader", "--reset-meters", "--reset-lr-scheduler")
CE_SCL_ANGLE_THRESHOLD = 180.0  # the angle never exceeds 180 degrees: nothing is dropped
# metrics of test.json's "dev" / "test" that go into results.csv (losses are left out)
METRIC_RE = re.compile(r"^accuracy(_exit\d+)?$|^(f1|mcc|acc_and_f1)$")


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
            "(fairseq_args.txt of acl-fairseq-convert-bert) or --arch-args '--arch roberta_base'"
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


def flag_value(args: Sequence[str], flag: str) -> str | None:
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
    update_freq = int((flag_value(opts.extra_args, "--update-freq") or "1").split(",")[0])
    batches = math.ceil(opts.n_train / opts.batch_size)
    updates = run_epochs(run, opts) * math.ceil(batches / update_freq)
    if opts.max_update:
        updates = min(updates, opts.max_update)
    return max(1, updates)


def flag_groups(args: Sequence[str]) -> list[str]:
    """``args`` as one string per flag with its values (``--lr 5e-05``), in order."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return [shlex.join(g) for g in groups]
