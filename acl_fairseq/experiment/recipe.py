"""The fine-tuning recipe as ``fairseq-train`` command lines: the one builder of every tool.

A method's criterion flags (``criterion_flags``), the model flags switched to the multi-exit
architecture (``multi_exit_arch``), one run's command (``train_command``), fairseq's RoBERTa
GLUE recipe per task (``GLUE_RECIPES``, ``glue_commands``; ``configs/`` is tested against it)
and a command as a shell shows it (``shell_command``).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import AclValueError
from .paths import BIN, USER_DIR

__all__ = [
    "ABLATIONS",
    "CONTRASTIVE_METHODS",
    "CRITERIA",
    "GLUE_RECIPES",
    "METHODS",
    "MULTI_EXIT_METHODS",
    "STAGE1",
    "criterion_flags",
    "flag_groups",
    "flag_value",
    "glue_commands",
    "glue_recipe",
    "model_flags",
    "multi_exit_arch",
    "shell_command",
    "train_command",
]

METHODS = ("ce", "ce_scl", "acl", "multi_exit_joint", "acl_cl")
ABLATIONS = ("ce_scl_grad", "acl_embed", "joint_from_acl", "joint_from_start")
"""The study's ablations: CE+SCL gated by ACL-Grad (``--acl-grad``), ACL-Embed without
ACL-Grad (``--no-acl-grad``), joint CE stage 2 restored from the ACL run (the same start as
ACL-CL), and joint CE over every exit from the pretrained model (no stage 1)."""
MULTI_EXIT_METHODS = ("multi_exit_joint", "joint_from_acl", "joint_from_start", "acl_cl")
CONTRASTIVE_METHODS = ("ce_scl", "ce_scl_grad", "acl", "acl_embed", "acl_cl")
STAGE1 = {"multi_exit_joint": "ce", "joint_from_acl": "acl", "acl_cl": "acl"}
"""The single-exit method whose best checkpoint a multi-exit method's stage 2 restores."""
CRITERIA = {
    "ce": "sentence_prediction",
    "ce_scl": "ce_scl",
    "ce_scl_grad": "ce_scl",
    "acl": "acl_embed",
    "acl_embed": "acl_embed",
    "multi_exit_joint": "multi_exit_ce",
    "joint_from_acl": "multi_exit_ce",
    "joint_from_start": "multi_exit_ce",
    "acl_cl": "acl_cross_layer",
}
MULTI_EXIT_ARCH = {
    "roberta": "multi_exit_roberta",
    "roberta_base": "multi_exit_roberta_base",
    "roberta_large": "multi_exit_roberta_large",
}
RESET_FLAGS = ("--reset-optimizer", "--reset-dataloader", "--reset-meters", "--reset-lr-scheduler")
ADAM = ["--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6"]
WEIGHT_DECAY = "0.1"


def _flag(name: str, value: object | None) -> list[str]:
    return [] if value is None else [name, str(value)]


def criterion_flags(
    method: str,
    lam: str | None = None,
    temperature: str | None = None,
    acl_grad: bool | None = None,
    acl_grad_threshold: str | None = None,
    cross_layer_lambda: str | None = None,
    exit_layers: str | None = None,
    exit_weighting: str | None = None,
    multi_exit_model: bool = True,
) -> list[str]:
    """``--criterion`` of ``method`` and its hyper-parameters (those given; the criterion's
    defaults otherwise). On the multi-exit architecture (``multi_exit_model``) single-exit
    methods get ``--exit-layers none``: they train the final exit only."""
    if method not in CRITERIA:
        known = ", ".join((*METHODS, *ABLATIONS))
        raise AclValueError(f"unknown method {method!r}; expected one of {known}")
    flags = ["--criterion", CRITERIA[method]]
    if method in CONTRASTIVE_METHODS:
        flags += _flag("--contrastive-lambda", lam)
        if method == "acl_cl":
            flags += _flag("--cross-layer-lambda", cross_layer_lambda)
        flags += _flag("--temperature", temperature)
        flags += ["--acl-grad"] if acl_grad else ["--no-acl-grad"] if acl_grad is False else []
        flags += _flag("--acl-grad-threshold", acl_grad_threshold)
    if method not in MULTI_EXIT_METHODS:
        return flags + (["--exit-layers", "none"] if multi_exit_model else [])
    return flags + _flag("--exit-layers", exit_layers) + _flag("--exit-weighting", exit_weighting)


def _multi_exit_name(arch: str) -> str:
    if arch.startswith("multi_exit_roberta"):
        return arch
    if arch in MULTI_EXIT_ARCH:
        return MULTI_EXIT_ARCH[arch]
    raise AclValueError(
        f"--arch {arch} has no multi-exit variant: use roberta, roberta_base, roberta_large "
        "or a multi_exit_roberta* arch"
    )


def multi_exit_arch(args: Sequence[str]) -> list[str]:
    """``args`` with the ``--arch`` value replaced by its multi-exit variant (``ValueError``
    for an architecture without one)."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg.startswith("--arch="):
            out[i] = "--arch=" + _multi_exit_name(arg[len("--arch=") :])
        elif arg in ("--arch", "-a") and i + 1 < len(out):
            out[i + 1] = _multi_exit_name(out[i + 1])
    return out


def model_flags(args: Sequence[str]) -> list[str]:
    """The model flags of ``args`` (e.g. ``fairseq_args.txt``), without ``--restore-file`` and
    the ``--reset-*`` flags (each run sets those itself)."""
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
    return out


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag`` in a command line (``--flag V`` or ``--flag=V``)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def flag_groups(args: Sequence[str]) -> list[str]:
    """``args`` as one string per flag with its values (``--lr 5e-05``), in order."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return [shlex.join(g) for g in groups]


def shell_command(args: Sequence[str], width: int = 88) -> str:
    """``args`` as a shell command to read and copy: the executable and its positional
    arguments, then the flags (each with its values) packed into lines of at most ``width``
    characters, continued with `` \\``."""
    groups = flag_groups(args)
    lines = groups[:1]
    for group in groups[1:]:
        if len(lines[-1]) + 1 + len(group) <= width - 2:
            lines[-1] += " " + group
        else:
            lines.append("  " + group)
    return " \\\n".join(lines)


def train_command(
    data: str | Path,
    save_dir: str | Path,
    *,
    task: str | None = "acl_sentence_prediction",
    arch: Sequence[str] = (),
    criterion: Sequence[str] = (),
    exit_pooling: str | None = None,
    restore: str | Path | None = None,
    num_classes: int | None = None,
    separator_token: bool = False,
    batch_size: int | None = None,
    required_batch_size_multiple: int | None = None,
    max_epoch: int | None = None,
    max_update: int | None = None,
    lr: str | None = None,
    total_updates: int | None = None,
    warmup_updates: int | None = None,
    valid_subset: str | None = None,
    best_metric: str | None = None,
    maximize: bool = True,
    seed: int | None = None,
    cpu: bool = False,
    num_workers: int | None = None,
    log_format: str | None = None,
    log_interval: int | None = None,
    validate_interval_updates: int | None = None,
    extra: Sequence[str] = (),
    fairseq_train: str | Path = BIN / "fairseq-train",
    user_dir: str | Path = USER_DIR,
) -> list[str]:
    """The ``fairseq-train`` command of one run; a part left at ``None`` is not on it.
    ``restore`` resets the optimizer, data loader and meters; ``lr`` is Adam with fairseq's
    RoBERTa settings and polynomial decay; ``best_metric`` keeps the checkpoint best on dev
    only; ``extra`` comes last, so it overrides the rest."""
    cmd = [str(fairseq_train), str(data), "--user-dir", str(user_dir)]
    cmd += _flag("--task", task) + list(arch) + list(criterion)
    cmd += _flag("--exit-pooling", exit_pooling)
    if restore is not None:
        cmd += ["--restore-file", str(restore), *RESET_FLAGS[:3]]
    if num_classes is not None:
        cmd += ["--num-classes", str(num_classes), "--init-token", "0"]
        cmd += ["--separator-token", "2"] if separator_token else []
    cmd += _flag("--batch-size", batch_size)
    cmd += _flag("--required-batch-size-multiple", required_batch_size_multiple)
    cmd += _flag("--max-epoch", max_epoch) + _flag("--max-update", max_update)
    if lr is not None:
        cmd += [*ADAM, "--weight-decay", WEIGHT_DECAY, "--lr", lr]
        cmd += ["--lr-scheduler", "polynomial_decay"]
        cmd += _flag("--total-num-update", total_updates)
        cmd += _flag("--warmup-updates", warmup_updates)
    cmd += _flag("--valid-subset", valid_subset)
    if best_metric is not None:
        cmd += ["--best-checkpoint-metric", best_metric]
        cmd += ["--maximize-best-checkpoint-metric"] if maximize else []
        cmd += ["--no-epoch-checkpoints", "--no-last-checkpoints", "--no-save-optimizer-state"]
    cmd += ["--save-dir", str(save_dir)] + _flag("--seed", seed) + (["--cpu"] if cpu else [])
    cmd += _flag("--num-workers", num_workers)
    cmd += _flag("--log-format", log_format) + _flag("--log-interval", log_interval)
    if validate_interval_updates is not None:
        # fairseq writes checkpoint_best.pt only where it saves: at every validation
        every = str(validate_interval_updates)
        cmd += ["--validate-interval-updates", every, "--save-interval-updates", every]
        cmd += ["--keep-interval-updates", "1"]
    return cmd + list(extra)


@dataclass(frozen=True)
class GlueRecipe:
    """fairseq's RoBERTa settings of one GLUE task (examples/roberta/README.glue.md)."""

    folder: str  # DATA_DIR/FOLDER-bin
    lr: str
    batch_size: int
    updates: int
    warmup: int
    num_classes: int
    metric: str = "accuracy"
    metric_flags: tuple[str, ...] = ()
    valid_subset: str = "valid"

    @property
    def regression(self) -> bool:
        return "--regression-target" in self.metric_flags


ACC_F1 = ("--report-acc-and-f1",)
GLUE_RECIPES = {
    "mnli": GlueRecipe("MNLI", "1e-05", 32, 123873, 7432, 3, valid_subset="valid,valid1"),
    "qnli": GlueRecipe("QNLI", "1e-05", 32, 33112, 1986, 2),
    "qqp": GlueRecipe("QQP", "1e-05", 32, 113272, 28318, 2, "acc_and_f1", ACC_F1),
    "rte": GlueRecipe("RTE", "2e-05", 16, 2036, 122, 2),
    "sst2": GlueRecipe("SST-2", "1e-05", 32, 20935, 1256, 2),
    "mrpc": GlueRecipe("MRPC", "1e-05", 16, 2296, 137, 2, "acc_and_f1", ACC_F1),
    "cola": GlueRecipe("CoLA", "1e-05", 16, 5336, 320, 2, "mcc", ("--report-mcc",)),
    "stsb": GlueRecipe(
        "STS-B",
        "2e-05",
        16,
        3598,
        214,
        1,
        "loss",
        ("--regression-target", "--report-pearson-and-spearman"),
    ),  # fmt: skip
}
"""By task key: the name lowercased without ``-`` and ``_`` (``SST-2`` -> ``sst2``)."""
GLUE_FLAGS = [
    "--max-positions", "512", "--max-tokens", "4400", "--dropout", "0.1",
    "--attention-dropout", "0.1", "--clip-norm", "0.0", "--find-unused-parameters",
]  # fmt: skip
FP16_FLAGS = ["--fp16", "--fp16-init-scale", "4", "--threshold-loss-scale", "1"]
FP16_FLAGS += ["--fp16-scale-window", "128"]


def glue_recipe(task: str, method: str | None = None) -> GlueRecipe:
    """The recipe of GLUE ``task`` (case, ``-`` and ``_`` do not matter: ``sst_2``, ``SST-2``);
    ``ValueError`` names an unknown task, an unknown ``method`` or one the task cannot train."""
    recipe = GLUE_RECIPES.get(task.lower().replace("-", "").replace("_", ""))
    if recipe is None:
        known = " ".join(r.folder for r in GLUE_RECIPES.values())
        raise AclValueError(f"unknown task '{task}'; expected one of {known}")
    if method is not None and method not in METHODS:
        raise AclValueError(f"unknown method '{method}'; expected one of {' '.join(METHODS)}")
    if method not in (None, "ce") and recipe.regression:
        raise AclValueError(
            f"{recipe.folder} is a regression task (--regression-target) and method '{method}' "
            "uses a classification criterion (contrastive losses and per-exit CE need class "
            f"labels); use method 'ce' for {recipe.folder}"
        )
    return recipe


def glue_commands(
    task: str,
    method: str,
    data_dir: str | Path,
    pretrained: str | Path | None,
    save_dir: str | Path,
    arch: Sequence[str] = ("--arch", "roberta_base"),
    seed: int = 1,
    fp16: bool = False,
    extra: Sequence[str] = (),
    stage2_extra: Sequence[str] = (),
    fairseq_train: str | Path = BIN / "fairseq-train",
    user_dir: str | Path = USER_DIR,
    valid_subset: str | None = None,
) -> list[list[str]]:
    """The ``fairseq-train`` command(s) of ``method`` on GLUE ``task`` (``scripts/glue/
    train.sh``): two for a multi-exit method (``SAVE_DIR/stage1``, then ``stage2`` restoring
    its best). ``pretrained`` None: random weights. Bad names: see :func:`glue_recipe`."""
    recipe = glue_recipe(task, method)
    data = Path(data_dir) / f"{recipe.folder}-bin"
    multi_exit = method in MULTI_EXIT_METHODS

    model = multi_exit_arch(arch) if multi_exit else list(arch)
    more = [*GLUE_FLAGS, *recipe.metric_flags, *(FP16_FLAGS if fp16 else [])]
    more += multi_exit_arch(extra) if multi_exit else list(extra)

    def stage(method: str, save: str | Path, restore, last: Sequence[str]) -> list[str]:
        return train_command(
            data,
            save,
            arch=model,
            criterion=criterion_flags(method, multi_exit_model=False),
            restore=restore,
            num_classes=recipe.num_classes,
            separator_token=True,
            batch_size=recipe.batch_size,
            required_batch_size_multiple=1,
            max_epoch=10,
            max_update=recipe.updates,
            lr=recipe.lr,
            total_updates=recipe.updates,
            warmup_updates=recipe.warmup,
            valid_subset=valid_subset or recipe.valid_subset,
            best_metric=recipe.metric,
            maximize=recipe.metric != "loss",
            seed=seed,
            log_format="json",
            log_interval=200,
            extra=[*more, *last],
            fairseq_train=fairseq_train,
            user_dir=user_dir,
        )

    if not multi_exit:
        return [stage(method, save_dir, pretrained, [])]
    stage1 = Path(save_dir) / "stage1"
    return [
        stage(STAGE1[method], stage1, pretrained, ["--exit-layers", "none"]),
        stage(method, Path(save_dir) / "stage2", stage1 / "checkpoint_best.pt", stage2_extra),
    ]
