"""``scripts/glue/train.sh TASK METHOD``: the fairseq-train command(s) of one GLUE task and one
method, built by ``acl_fairseq.experiment.recipe.glue_commands``, printed (``--dry-run``) or run.

Settings come from the environment, as a shell recipe's do; the data folder, the pretrained
model and the flags are checked before anything runs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from acl_fairseq.data.prepared import META_FILE, read_num_classes
from acl_fairseq.errors import AclFairseqError, run_tool
from acl_fairseq.experiment import commands
from acl_fairseq.experiment.paths import USER_DIR
from acl_fairseq.experiment.recipe import (
    CRITERIA,
    FP16_FLAGS,
    STAGE1,
    flag_value,
    glue_commands,
    glue_recipe,
    shell_command,
)

PROG = "scripts/glue/train.sh"
USAGE = f"""\
Usage: {PROG} TASK METHOD [extra fairseq-train args...] [--dry-run]
       (the same as: python -m acl_fairseq.cli.glue TASK METHOD ...)

Fine-tune on one GLUE task with one method, with fairseq's published RoBERTa GLUE
hyper-parameters (examples/roberta/README.glue.md and config/finetuning/*.yaml), as
acl_fairseq/experiment/recipe.py builds them.

  TASK    CoLA SST-2 MRPC STS-B QQP MNLI QNLI RTE (case, '-' and '_' do not matter)
  METHOD  ce                fairseq's sentence_prediction criterion (the baseline), run by
                            --task acl_sentence_prediction: fairseq's own training step,
                            plus the plugin's checks of --num-classes, data and checkpoint
          ce_scl            CE + supervised contrastive loss (Gunel et al.)
          acl               CE + ACL-Embed, ACL-Grad on (--criterion acl_embed)
          multi_exit_joint  two stages: ce (SAVE_DIR/stage1), then the multi-exit model
                            restored from stage 1's best checkpoint trained with joint
                            weighted CE over the exits (--criterion multi_exit_ce,
                            SAVE_DIR/stage2)
          acl_cl            two stages: acl (SAVE_DIR/stage1), then the multi-exit model
                            restored from stage 1's best checkpoint trained with
                            --criterion acl_cross_layer (SAVE_DIR/stage2)
        The two multi-exit methods get equal budgets: the same stage 1 recipe (ce or acl,
        on the multi-exit model with --exit-layers none) and the same number of updates in
        stage 2.

Extra arguments go to fairseq-train after the recipe's own (so they override them), e.g.
--contrastive-lambda 0.3 --temperature 0.1 --update-freq 2 --exit-layers 4,8. In the two-stage
methods they go to both stages; STAGE2_ARGS adds arguments to stage 2 only (e.g.
--freeze-backbone).
--dry-run (or DRY_RUN=1) prints the fairseq-train command(s) and runs nothing.

Environment:
  DATA_DIR      folder with TASK-bin/ from acl-fairseq-prepare (default: glue-bin)
  PRETRAINED    fairseq RoBERTa model.pt (roberta.base, or OUTDIR/model.pt of
                acl-fairseq-convert-bert); required. 'none' trains from scratch (tests).
  ARCH_ARGS     model flags (default: --arch roberta_base); for a converted BERT the contents
                of OUTDIR/fairseq_args.txt. Multi-exit methods switch the --arch value
                roberta -> multi_exit_roberta, roberta_base -> multi_exit_roberta_base,
                roberta_large -> multi_exit_roberta_large.
  SAVE_DIR      checkpoint folder (default: checkpoints/TASK-METHOD)
  SEED          random seed (default: 1)
  FP16          1: {" ".join(FP16_FLAGS)}
                0: fp32. Default: 1 when a CUDA GPU is visible and --cpu is not given.
                For bf16 mixed precision (GPU or CPU): FP16=0 and the extra argument
                --autocast bf16 (fairseq's own --bf16 means TPU).
  USER_DIR      the plugin (default: the acl_fairseq package this command runs)
  STAGE2_ARGS   extra arguments for stage 2 of multi_exit_joint and acl_cl only
  FAIRSEQ_TRAIN the fairseq-train executable (default: fairseq-train on PATH)
  PYTHON        (train.sh) the Python with fairseq and this package (default: the one next
                to fairseq-train, else python3)"""


class RecipeError(AclFairseqError):
    """A setting that stops the recipe before anything runs; the message names it."""


@dataclass(frozen=True)
class Stage:
    title: str  # what the stage trains, shown above its command in a dry run
    command: list[str]


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _setting(env: Mapping[str, str], name: str, default: str) -> str:
    """``env[name]``, or ``default`` when it is unset or empty (``${NAME:-default}``)."""
    return env.get(name) or default


def _choice(env: Mapping[str, str], name: str, default: str) -> str:
    value = _setting(env, name, default)
    if value not in ("0", "1"):
        raise RecipeError(f"{name} must be 0 or 1, got '{value}'")
    return value


def _check_data(
    data: Path, task: str, num_classes: int, problem: Callable[[str], None]
) -> str | None:
    """Problems with the data folder; returns the valid subset to use in place of the
    recipe's, if any (MNLI without its mismatched split)."""
    if not data.is_dir():
        problem(
            f"{data} not found: set DATA_DIR to the --out-dir of acl-fairseq-prepare "
            f"(it holds {data.name}/)"
        )
        return None
    if not (data / "input0").is_dir():
        problem(f"{data} has no input0/: not binarized data from acl-fairseq-prepare")
        return None
    recorded = read_num_classes(data)
    if recorded is not None and recorded != num_classes:
        raise RecipeError(
            f"{data / META_FILE} says num_classes {recorded} but {task} has {num_classes}: "
            f"is {data} really {task}?"
        )
    if task == "MNLI" and not (data / "input0" / "valid1.idx").is_file():
        _warn(f"{data}/input0/valid1.* (MNLI mismatched) not found: validating on valid only")
        return "valid"
    return None


def _fp16(env: Mapping[str, str], cpu: bool) -> bool:
    if not env.get("FP16"):
        if cpu:
            return False
        import torch

        if torch.cuda.is_available():
            return True
        _warn("no CUDA GPU visible: training in fp32 (FP16=1 forces fp16)")
        return False
    fp16 = _choice(env, "FP16", "0") == "1"
    if fp16 and cpu:
        raise RecipeError("--cpu with FP16=1: fp16 training needs a GPU")
    return fp16


def _has_arch(args: Sequence[str]) -> bool:
    return any(a in ("--arch", "-a") or a.startswith("--arch=") for a in args)


def plan(
    task: str, method: str, args: Sequence[str], env: Mapping[str, str], dry_run: bool
) -> list[Stage]:
    """The stages of ``method`` on ``task`` with the fairseq-train ``args`` and the settings
    of ``env``, checked; problems with files are warnings in a dry run."""
    recipe = glue_recipe(task, method)

    def problem(message: str) -> None:
        if not dry_run:
            raise RecipeError(message)
        _warn(f"{message} (dry run: continuing)")

    data_dir = _setting(env, "DATA_DIR", "glue-bin")
    valid_subset = _check_data(
        Path(data_dir) / f"{recipe.folder}-bin", recipe.folder, recipe.num_classes, problem
    )
    pretrained = env.get("PRETRAINED")
    if not pretrained:
        raise RecipeError(
            "PRETRAINED is not set: point it to a fairseq RoBERTa model.pt (roberta.base/model.pt, "
            "or OUTDIR/model.pt written by acl-fairseq-convert-bert); PRETRAINED=none trains "
            "from scratch (for tests only)"
        )
    if pretrained == "none":
        _warn("PRETRAINED=none: training from randomly initialised weights (for tests only)")
    elif not Path(pretrained).is_file():
        problem(f"PRETRAINED={pretrained}: no such file (expected a fairseq model.pt)")
    user_dir = _setting(env, "USER_DIR", str(USER_DIR))
    if not Path(user_dir).is_dir():
        raise RecipeError(f"USER_DIR={user_dir} is not a directory (the acl_fairseq package)")
    seed = _setting(env, "SEED", "1")
    if not seed.isdigit():
        raise RecipeError(f"SEED must be a whole number, got '{seed}'")
    fp16 = _fp16(env, cpu="--cpu" in args)
    arch = _setting(env, "ARCH_ARGS", "--arch roberta_base").split()
    if not _has_arch([*arch, *args]):
        raise RecipeError(
            f"no --arch in ARCH_ARGS='{env.get('ARCH_ARGS', '')}' nor in the extra arguments"
        )
    stage2_extra = env.get("STAGE2_ARGS", "").split()
    save_dir = _setting(env, "SAVE_DIR", f"checkpoints/{recipe.folder}-{method}")
    commands = glue_commands(
        task, method, data_dir, None if pretrained == "none" else pretrained, save_dir,
        arch=arch, seed=int(seed), fp16=fp16, extra=args, stage2_extra=stage2_extra,
        fairseq_train=_setting(env, "FAIRSEQ_TRAIN", "fairseq-train"), user_dir=user_dir,
        valid_subset=valid_subset,
    )  # fmt: skip
    if len(commands) == 1:
        if stage2_extra:
            _warn(f"STAGE2_ARGS is ignored: method {method} has one stage")
        return [Stage(f"{CRITERIA[method]} ({recipe.folder}) -> {save_dir}", commands[0])]
    stage1, stage2 = commands
    return [
        Stage(
            f"stage 1: {CRITERIA[STAGE1[method]]} ({recipe.folder}) -> "
            f"{flag_value(stage1, '--save-dir')}",
            stage1,
        ),
        Stage(
            f"stage 2: {CRITERIA[method]} on the multi-exit model -> "
            f"{flag_value(stage2, '--save-dir')}",
            stage2,
        ),
    ]


def run(stages: Sequence[Stage]) -> int:
    """Runs the stages in order; a stage that fails (or a stage 1 without its best
    checkpoint) stops the rest. Returns the exit status."""
    exe = stages[0].command[0]
    if shutil.which(exe) is None:
        raise RecipeError(
            f"FAIRSEQ_TRAIN={exe}: not found; activate the virtual environment that has fairseq "
            "(scripts/install.sh) or set FAIRSEQ_TRAIN to its fairseq-train"
        )
    for i, stage in enumerate(stages):
        print(f"+ {shlex.join(stage.command)}", file=sys.stderr, flush=True)
        code = commands.run(stage.command).returncode
        if code != 0:
            return code
        if i + 1 < len(stages):
            best = Path(flag_value(stages[i + 1].command, "--restore-file") or "")
            if not best.is_file():
                raise RecipeError(f"stage 1 finished without writing {best}")
    return 0


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    return run_tool(PROG, train, argv, env)


def train(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """``TASK METHOD [args...]``: the stages printed (a dry run) or run; the exit status."""
    if len(argv) < 2:
        print(USAGE, file=sys.stderr)
        raise RecipeError("expected TASK and METHOD")
    dry_run = _choice(env, "DRY_RUN", "0") == "1" or "--dry-run" in argv[2:]
    args = [a for a in argv[2:] if a != "--dry-run"]
    stages = plan(argv[0], argv[1], args, env, dry_run)
    if not dry_run:
        return run(stages)
    for stage in stages:
        print(f"# {stage.title}\n{shell_command(stage.command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
