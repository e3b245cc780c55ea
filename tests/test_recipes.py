"""The GLUE recipe, built once by ``acl_fairseq.experiment.recipe``: the commands of
scripts/glue/train.sh (``acl_fairseq.cli.glue``) for every task x method, compared with fairseq's
published table; the fairseq-hydra-train configs in configs/, composed with every method's
overrides and compared field by field with what fairseq reads from the same commands; and the
install script. test_recipes_run.py trains them for 2 updates on a tiny dataset.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from acl_fairseq.cli.glue import main as glue_main
from acl_fairseq.experiment.recipe import (
    METHODS as RECIPE_METHODS,
)
from acl_fairseq.experiment.recipe import glue_commands, glue_recipe, shell_command

from fairseq_helpers import BIN, REPO, USER_DIR

TRAIN_SH = REPO / "scripts" / "glue" / "train.sh"
CONFIGS = REPO / "configs" / "finetuning"
CONFIGS_README = REPO / "configs" / "README.md"

# fairseq's RoBERTa GLUE table (examples/roberta/config/finetuning/*.yaml):
# task -> (yaml name, num_classes, lr, batch size, total updates, warmup updates, best metric)
TASKS = {
    "CoLA": ("cola", 2, 1e-5, 16, 5336, 320, "mcc"),
    "SST-2": ("sst_2", 2, 1e-5, 32, 20935, 1256, "accuracy"),
    "MRPC": ("mrpc", 2, 1e-5, 16, 2296, 137, "acc_and_f1"),
    "STS-B": ("sts_b", 1, 2e-5, 16, 3598, 214, "loss"),
    "QQP": ("qqp", 2, 1e-5, 32, 113272, 28318, "acc_and_f1"),
    "MNLI": ("mnli", 3, 1e-5, 32, 123873, 7432, "accuracy"),
    "QNLI": ("qnli", 2, 1e-5, 32, 33112, 1986, "accuracy"),
    "RTE": ("rte", 2, 2e-5, 16, 2036, 122, "accuracy"),
}
METHODS = {
    # method -> (task, criterion, multi-exit arch) of its (last) stage
    "ce": ("acl_sentence_prediction", "sentence_prediction", False),
    "ce_scl": ("acl_sentence_prediction", "ce_scl", False),
    "acl": ("acl_sentence_prediction", "acl_embed", False),
    "multi_exit_joint": ("acl_sentence_prediction", "multi_exit_ce", True),
    "acl_cl": ("acl_sentence_prediction", "acl_cross_layer", True),
}
ENV = {
    "FAIRSEQ_TRAIN": str(BIN / "fairseq-train"),
    "FP16": "0",
    "PRETRAINED": "/pretrained/model.pt",
    "DATA_DIR": "/nonexistent/glue-bin",
}

# ----------------------------------------------------------------------------- helpers


def glue(*args: str, cwd: Path | None = None, **env: str | None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``train.sh ARGS`` (``acl_fairseq.cli.glue``) run here,
    with ``ENV`` and ``env`` as its environment (None unsets), in ``cwd``."""
    full = {k: v for k, v in {**ENV, **env}.items() if v is not None}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with contextlib.chdir(cwd or Path.cwd()):
            code = glue_main(list(args), full)
    return code, out.getvalue(), err.getvalue()


def parse_commands(text: str) -> list[list[str]]:
    """The command lines of a dry run's output (``#`` lines left out, `` \\`` lines joined)."""
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip()]


def dry_run_commands(*args: str, **env: str | None) -> list[list[str]]:
    """The fairseq-train command lines that ``train.sh ... --dry-run`` prints."""
    code, out, err = glue(*args, "--dry-run", **env)
    assert code == 0, err
    return parse_commands(out)


def train_sh(*args: str, **env: str) -> subprocess.CompletedProcess:
    """scripts/glue/train.sh itself, in a subprocess (PYTHON: this interpreter)."""
    full = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        ["bash", str(TRAIN_SH), *args], capture_output=True, text=True, env=full, timeout=600
    )


def parse_flags(argv: list[str]) -> dict[str, object]:
    """``--flag value`` / ``--flag`` pairs of a command line; the last occurrence wins, as in
    argparse. The executable and the data directory are under ``_exe`` and ``_data``."""
    flags: dict[str, object] = {"_exe": argv[0], "_data": argv[1]}
    i = 2
    while i < len(argv):
        arg = argv[i]
        assert arg.startswith("-"), f"unexpected positional {arg!r} in {argv}"
        if "=" in arg:
            key, value = arg.split("=", 1)
            flags[key] = value
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[arg] = argv[i + 1]
            i += 2
        else:
            flags[arg] = True
            i += 1
    return flags


# ----------------------------------------------------------------------------- the commands


def test_shell_command_reads_back_as_the_same_arguments():
    cmd = ["fairseq-train", "data dir", "--arch", "roberta", "--adam-betas", "(0.9,0.98)"]
    cmd += ["--valid-subset", "valid,valid1", "--extra", "it's"] + ["--flag"] * 30
    text = shell_command(cmd, width=42)
    assert all(len(line) <= 42 for line in text.splitlines())
    assert text.splitlines()[0] == "fairseq-train 'data dir' --arch roberta \\"
    assert parse_commands(text) == [cmd]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("task", list(TASKS))
def test_dry_run_every_task_and_method(task, method):
    _, num_classes, lr, bsz, updates, warmup, metric = TASKS[task]
    fs_task, criterion, multi_exit = METHODS[method]
    if task == "STS-B" and method != "ce":
        code, out, err = glue(task, method, "--dry-run")
        assert code == 2 and not out
        assert "STS-B is a regression task" in err
        assert f"method '{method}'" in err and "use method 'ce'" in err
        return

    commands = dry_run_commands(task, method, FP16="1", SAVE_DIR="/ck")
    assert len(commands) == (2 if multi_exit else 1)
    stage1_criterion = {"multi_exit_joint": "sentence_prediction", "acl_cl": "acl_embed"}
    for stage, argv in enumerate(commands, start=1):
        f = parse_flags(argv)
        last = stage == len(commands)
        assert f["_exe"] == str(BIN / "fairseq-train")
        assert f["_data"] == f"/nonexistent/glue-bin/{task}-bin"
        assert f["--user-dir"] == USER_DIR
        assert f["--task"] == (fs_task if last else "acl_sentence_prediction")
        assert f["--criterion"] == (criterion if last else stage1_criterion[method])
        assert f["--arch"] == ("multi_exit_roberta_base" if multi_exit else "roberta_base")
        # stage 1 of a multi-exit method: the multi-exit model without shallow exits
        assert ("--exit-layers" in f) == (multi_exit and not last)
        if multi_exit and not last:
            assert argv[-2:] == ["--exit-layers", "none"]
        assert int(f["--num-classes"]) == num_classes
        assert float(f["--lr"]) == lr
        assert int(f["--batch-size"]) == bsz
        assert int(f["--total-num-update"]) == updates
        assert int(f["--max-update"]) == updates
        assert int(f["--warmup-updates"]) == warmup
        assert f["--best-checkpoint-metric"] == metric
        assert ("--maximize-best-checkpoint-metric" in f) == (metric != "loss")
        assert ("--regression-target" in f) == (task == "STS-B")
        assert ("--report-mcc" in f) == (task == "CoLA")
        assert ("--report-acc-and-f1" in f) == (task in ("MRPC", "QQP"))
        assert f["--valid-subset"] == ("valid,valid1" if task == "MNLI" else "valid")
        # the recipe's fixed hyper-parameters
        expected = {
            "--optimizer": "adam",
            "--adam-betas": "(0.9,0.98)",
            "--adam-eps": "1e-6",
            "--weight-decay": "0.1",
            "--clip-norm": "0.0",
            "--lr-scheduler": "polynomial_decay",
            "--max-epoch": "10",
            "--dropout": "0.1",
            "--attention-dropout": "0.1",
            "--init-token": "0",
            "--separator-token": "2",
            "--max-positions": "512",
            "--max-tokens": "4400",
            "--required-batch-size-multiple": "1",
            "--seed": "1",
        }
        assert {k: f.get(k) for k in expected} == expected
        for flag in (
            "--reset-optimizer",
            "--reset-dataloader",
            "--reset-meters",
            "--find-unused-parameters",
            "--no-epoch-checkpoints",
            "--no-last-checkpoints",
            "--no-save-optimizer-state",
            "--fp16",
        ):
            assert f.get(flag) is True, flag
        assert f["--fp16-init-scale"] == "4" and f["--fp16-scale-window"] == "128"
        if multi_exit:
            assert f["--save-dir"] == f"/ck/stage{stage}"
            restore = "/ck/stage1/checkpoint_best.pt" if last else "/pretrained/model.pt"
            assert f["--restore-file"] == restore
        else:
            assert f["--save-dir"] == "/ck"
            assert f["--restore-file"] == "/pretrained/model.pt"


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("task", list(TASKS))
def test_train_sh_prints_the_recipe_builders_command(task, method):
    """What a dry run prints reads back as ``glue_commands``' command lines, flag for flag and
    in the same order, with the settings of the environment (extra and stage-2 arguments,
    seed, fp16) passed on."""
    extra = ["--contrastive-lambda", "0.3", "--arch", "roberta_large"]
    env = {"FP16": "1", "SAVE_DIR": "/ck", "SEED": "3", "STAGE2_ARGS": "--freeze-backbone"}
    if task == "STS-B" and method != "ce":
        with pytest.raises(ValueError, match="regression task"):
            glue_commands(task, method, "/nonexistent/glue-bin", "/pretrained/model.pt", "/ck")
        return
    multi_exit = method in ("multi_exit_joint", "acl_cl")
    built = glue_commands(
        task, method, "/nonexistent/glue-bin", "/pretrained/model.pt", "/ck", seed=3, fp16=True,
        extra=extra, stage2_extra=["--freeze-backbone"] if multi_exit else [],
        fairseq_train=BIN / "fairseq-train", user_dir=USER_DIR,
    )  # fmt: skip
    assert dry_run_commands(task, method, *extra, **env) == built


def test_dry_run_defaults_and_env():
    (argv,) = dry_run_commands("rte", "acl", DRY_RUN="1", SEED="7", FP16="0", FAIRSEQ_TRAIN=None)
    f = parse_flags(argv)
    assert f["_exe"] == "fairseq-train"  # the command on PATH, as a user would type it
    assert f["--save-dir"] == "checkpoints/RTE-acl"
    assert f["--seed"] == "7"
    assert "--fp16" not in f
    # DRY_RUN=1 works without --dry-run too
    code, out, _ = glue("rte", "acl", DRY_RUN="1")
    assert code == 0 and out.startswith("# acl_embed (RTE) -> checkpoints/RTE-acl\n")


def test_cpu_turns_fp16_off_without_gpu_check(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked for a GPU"))
    (argv,) = dry_run_commands("sst-2", "ce", "--cpu", FP16=None)
    f = parse_flags(argv)
    assert f["--cpu"] is True and "--fp16" not in f
    code, _, err = glue("sst-2", "ce", "--cpu", "--dry-run", FP16="1")
    assert code == 2 and "fp16 training needs a GPU" in err


@pytest.mark.parametrize("gpu", [True, False])
def test_fp16_default_follows_gpu(monkeypatch, gpu):
    """FP16 unset: fp16 when torch sees a CUDA GPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    code, out, err = glue("rte", "acl", "--dry-run", FP16=None)
    assert code == 0, err
    assert ("--fp16" in out.split()) == gpu
    assert ("no CUDA GPU visible" in err) != gpu


@pytest.mark.parametrize(
    "arch_args,plain,multi",
    [
        ("--arch roberta_large", "roberta_large", "multi_exit_roberta_large"),
        ("--arch roberta --encoder-layers 6", "roberta", "multi_exit_roberta"),
        ("--arch=roberta_base", "roberta_base", "multi_exit_roberta_base"),
        ("--arch multi_exit_roberta_tiny", "multi_exit_roberta_tiny", "multi_exit_roberta_tiny"),
    ],
)
def test_arch_switch_for_multi_exit_methods(arch_args, plain, multi):
    (ce,) = dry_run_commands("rte", "ce", ARCH_ARGS=arch_args)
    joint1, joint2 = dry_run_commands("rte", "multi_exit_joint", ARCH_ARGS=arch_args)
    stage1, stage2 = dry_run_commands("rte", "acl_cl", ARCH_ARGS=arch_args)
    assert parse_flags(ce)["--arch"] == plain
    for argv in (joint1, joint2, stage1, stage2):
        assert parse_flags(argv)["--arch"] == multi
    if "--encoder-layers" in arch_args:
        assert parse_flags(stage2)["--encoder-layers"] == "6"


def test_converted_bert_fairseq_args():
    """ARCH_ARGS from acl-fairseq-convert-bert's fairseq_args.txt overrides the defaults."""
    bert = (
        "--arch roberta --encoder-layers 6 --encoder-embed-dim 384 --encoder-ffn-embed-dim 1536 "
        "--encoder-attention-heads 12 --max-positions 512 --activation-fn gelu --dropout 0.1 "
        "--attention-dropout 0.1"
    )
    stage1, stage2 = dry_run_commands("mrpc", "acl_cl", ARCH_ARGS=bert)
    for argv in (stage1, stage2):
        f = parse_flags(argv)
        assert f["--arch"] == "multi_exit_roberta" and f["--encoder-embed-dim"] == "384"
        assert f["--activation-fn"] == "gelu"


def test_extra_args_override_and_stage2_args():
    stage1, stage2 = dry_run_commands(
        "qnli", "acl_cl", "--contrastive-lambda", "0.3", "--lr", "3e-05",
        STAGE2_ARGS="--freeze-backbone --cross-layer-lambda 0.2",
    )  # fmt: skip
    f1, f2 = parse_flags(stage1), parse_flags(stage2)
    assert f1["--contrastive-lambda"] == f2["--contrastive-lambda"] == "0.3"
    assert f1["--lr"] == f2["--lr"] == "3e-05"  # the last --lr wins in argparse
    assert "--freeze-backbone" not in f1 and f2["--freeze-backbone"] is True
    assert f2["--cross-layer-lambda"] == "0.2"
    # the contrastive hyper-parameters are left to the criterions' defaults otherwise
    (acl,) = dry_run_commands("qnli", "acl")
    assert "--contrastive-lambda" not in parse_flags(acl)
    assert "--temperature" not in parse_flags(acl)
    code, _, err = glue("qnli", "acl", "--dry-run", STAGE2_ARGS="--freeze-backbone")
    assert code == 0 and "STAGE2_ARGS is ignored: method acl has one stage" in err


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["WNLI", "acl", "--dry-run"], {}, "unknown task 'WNLI'"),
        (["rte", "scl", "--dry-run"], {}, "unknown method 'scl'"),
        (["rte", "acl_embed", "--dry-run"], {}, "unknown method 'acl_embed'"),
        (["rte"], {}, "expected TASK and METHOD"),
        (["sts-b", "multi_exit_joint", "--dry-run"], {}, "STS-B is a regression task"),
        (["rte", "acl"], {"DRY_RUN": "yes"}, "DRY_RUN must be 0 or 1, got 'yes'"),
        (["rte", "acl", "--dry-run"], {"FP16": "2"}, "FP16 must be 0 or 1, got '2'"),
        (["rte", "acl", "--dry-run"], {"SEED": "one"}, "SEED must be a whole number, got 'one'"),
        (["rte", "acl", "--dry-run"], {"ARCH_ARGS": "--encoder-layers 2"}, "no --arch in"),
        (["rte", "acl", "--dry-run"], {"USER_DIR": "/nonexistent"}, "USER_DIR=/nonexistent is"),
        (["rte", "multi_exit_joint", "--dry-run"], {"ARCH_ARGS": "--arch bert_base"},
         "--arch bert_base has no multi-exit variant"),
    ],
)  # fmt: skip
def test_bad_arguments(args, env, message):
    code, out, err = glue(*args, **env)
    assert code == 2 and not out
    assert f"scripts/glue/train.sh: error: {message}" in err


def test_missing_paths_fail_before_fairseq(tmp_path):
    # fairseq-train is replaced by a command that would leave a trace if it ran
    trace = tmp_path / "ran"
    fake = tmp_path / "fake-fairseq-train"
    fake.write_text(f'#!/bin/sh\necho "$@" > {trace}\n')
    fake.chmod(0o755)
    data = tmp_path / "glue"
    env = {"FAIRSEQ_TRAIN": str(fake), "DATA_DIR": str(data)}

    code, _, err = glue("rte", "acl", **env)
    assert code == 2 and f"{data}/RTE-bin not found" in err
    (data / "RTE-bin" / "input0").mkdir(parents=True)
    code, _, err = glue("rte", "acl", **env, PRETRAINED=str(tmp_path / "nope.pt"))
    assert code == 2 and "nope.pt: no such file" in err
    code, _, err = glue("rte", "acl", **env, PRETRAINED="")
    assert code == 2 and "PRETRAINED is not set" in err
    (data / "RTE-bin" / "prepare_glue.json").write_text('{\n  "num_classes": 3\n}\n')
    code, _, err = glue("rte", "acl", **env, PRETRAINED="none")
    assert code == 2 and "num_classes 3 but RTE has 2" in err
    (data / "RTE-bin" / "prepare_glue.json").write_text("num_classes: 2\n")
    code, _, err = glue("rte", "acl", **env, PRETRAINED="none")
    assert code == 2 and "prepare_glue.json: not the JSON object acl-fairseq-prepare" in err
    assert not trace.exists()
    # a dry run only warns about missing files
    code, _, err = glue("mnli", "acl", "--dry-run", **env)
    assert code == 0 and "(dry run: continuing)" in err
    # everything in place: the (fake) fairseq-train runs, without --restore-file
    (data / "RTE-bin" / "prepare_glue.json").write_text('{"num_classes": 2}')
    code, _, err = glue(
        "rte", "acl", **{**env, "FAIRSEQ_TRAIN": "no-such-train"}, PRETRAINED="none"
    )
    assert code == 2 and "FAIRSEQ_TRAIN=no-such-train: not found" in err
    code, _, err = glue("rte", "acl", **env, PRETRAINED="none")
    assert code == 0, err
    assert "--criterion acl_embed" in trace.read_text()
    assert "--restore-file" not in trace.read_text()


def test_mnli_without_mismatched_validates_on_matched(tmp_path):
    (tmp_path / "MNLI-bin" / "input0").mkdir(parents=True)
    (argv,) = dry_run_commands("mnli", "ce", DATA_DIR=str(tmp_path))
    assert parse_flags(argv)["--valid-subset"] == "valid"
    (tmp_path / "MNLI-bin" / "input0" / "valid1.idx").touch()
    (argv,) = dry_run_commands("mnli", "ce", DATA_DIR=str(tmp_path))
    assert parse_flags(argv)["--valid-subset"] == "valid,valid1"


def test_a_failed_stage_stops_the_next(tmp_path):
    (tmp_path / "glue" / "RTE-bin" / "input0").mkdir(parents=True)
    env = {"DATA_DIR": str(tmp_path / "glue"), "PRETRAINED": "none", "SAVE_DIR": str(tmp_path)}
    calls = tmp_path / "calls"
    for script, message in (
        ("exit 3", None),  # fairseq-train's own failure: its exit status
        ("exit 0", "stage 1 finished without writing"),  # no checkpoint_best.pt
    ):
        fake = tmp_path / "fake-fairseq-train"
        fake.write_text(f"#!/bin/sh\necho x >> {calls}\n{script}\n")
        fake.chmod(0o755)
        code, _, err = glue("rte", "acl_cl", **env, FAIRSEQ_TRAIN=str(fake))
        assert code == (3 if message is None else 2)
        assert message is None or f"{message} {tmp_path}/stage1/checkpoint_best.pt" in err
    assert calls.read_text() == "x\nx\n"  # stage 2 never ran


def test_train_sh_runs_the_glue_command(tmp_path):
    proc = train_sh("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: scripts/glue/train.sh TASK METHOD")
    proc = train_sh("rte", "acl_cl", "--dry-run", PRETRAINED="none", FP16="0")
    assert proc.returncode == 0, proc.stderr
    assert [parse_flags(c)["--criterion"] for c in parse_commands(proc.stdout)] == [
        "acl_embed",
        "acl_cross_layer",
    ]
    # without fairseq next to fairseq-train nor in PYTHON: said before anything else
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    proc = train_sh("rte", "acl", PYTHON=str(fake))
    assert proc.returncode == 2
    assert f"train.sh: error: no fairseq in PYTHON={fake}: activate" in proc.stderr


GLUE_README = REPO / "scripts" / "glue" / "README.md"


def test_the_glue_readme_shows_a_dry_run_as_it_prints():
    """scripts/glue/README.md's dry run (its ``console`` block) is what the command prints."""
    (block,) = re.findall(r"^```console\n\$ (.*?)\n(.*?)^```", GLUE_README.read_text(), re.M | re.S)
    words = shlex.split(block[0])
    env = dict(w.split("=", 1) for w in words[: words.index("scripts/glue/train.sh")])
    args = words[words.index("scripts/glue/train.sh") + 1 :]
    code, out, err = glue(*args, **{**env, "DATA_DIR": None, "FAIRSEQ_TRAIN": None}, cwd=REPO)
    assert code == 0, err
    assert out == block[1]


def test_the_glue_readme_table_is_the_recipe():
    rows = re.findall(r"^\| ([A-Za-z0-9-]+) \| (\S+) \| (\d+) \| (\d+) \| (\d+) \| (\d)",
                      GLUE_README.read_text(), re.M)  # fmt: skip
    assert sorted(r[0] for r in rows) == sorted(TASKS)
    for task, lr, batch, updates, warmup, classes in rows:
        recipe = glue_recipe(task)
        assert float(lr) == float(recipe.lr), task
        assert (int(batch), int(updates), int(warmup), int(classes)) == (
            recipe.batch_size,
            recipe.updates,
            recipe.warmup,
            recipe.num_classes,
        ), task


# ----------------------------------------------------------------------------- the configs


def readme_method_overrides() -> dict[str, list[list[str]]]:
    """method -> the hydra overrides of each of its stages, from configs/README.md's table."""
    rows = re.findall(
        r"^\| `(\w+)` \|\s*(\d?)\s*\| (.*) \|$", CONFIGS_README.read_text(encoding="utf-8"), re.M
    )
    stages: dict[str, list[list[str]]] = {}
    for method, _, cell in rows:
        stages.setdefault(method, []).append(" ".join(re.findall(r"`([^`]*)`", cell)).split())
    return stages


# configs/README.md's roberta.base name for the recipe's --arch (the same architecture)
HYDRA_ARCH = {"roberta_base": "roberta", "multi_exit_roberta_base": "multi_exit_roberta"}


def hydra_groups(cfg) -> dict[str, dict]:
    """A composed config's groups as fairseq reads them: the registries' defaults added,
    interpolations resolved."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
    from fairseq.dataclass.utils import merge_with_parent
    from fairseq.optim import OPTIMIZER_DATACLASS_REGISTRY
    from fairseq.optim.lr_scheduler import LR_SCHEDULER_DATACLASS_REGISTRY
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    registries = {
        "task": TASK_DATACLASS_REGISTRY,
        "criterion": CRITERION_DATACLASS_REGISTRY,
        "optimizer": OPTIMIZER_DATACLASS_REGISTRY,
        "lr_scheduler": LR_SCHEDULER_DATACLASS_REGISTRY,
    }
    full = OmegaConf.to_container(cfg, resolve=False)
    for group, registry in registries.items():
        merged = merge_with_parent(registry[cfg[group]._name](), cfg[group])
        full[group] = OmegaConf.to_container(merged, resolve=False)
    return OmegaConf.to_container(OmegaConf.create(full), resolve=True)


def command_groups(argv: list[str], groups: list[str]):
    """(``groups``, argparse namespace) of a fairseq-train command line as fairseq reads it."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
    cfg = convert_namespace_to_omegaconf(args)
    return {g: OmegaConf.to_container(cfg[g], resolve=True) for g in groups}, args


def compose_config(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    # version_base 1.1, as fairseq's own initialize() (convert_namespace_to_omegaconf) expects
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.1"):
        return compose(name, overrides)


def test_the_readme_lists_every_method_with_its_stages():
    stages = readme_method_overrides()
    assert list(stages) == list(RECIPE_METHODS)
    for method, overrides in stages.items():
        commands = glue_commands("rte", method, "D", "P", "S")
        assert len(overrides) == len(commands), method


def hydra_cases() -> list:
    """Every task x method; fast: every task's ``ce``, every method on RTE, STS-B's refusals."""
    return [
        pytest.param(task, method, marks=[] if fast else [pytest.mark.slow])
        for task in TASKS
        for method in METHODS
        for fast in [method == "ce" or task in ("RTE", "STS-B")]
    ]


@pytest.mark.parametrize("task,method", hydra_cases())
def test_hydra_config_trains_the_recipe(task, method):
    """Stage by stage: the task's yaml with the method's overrides of configs/README.md,
    composed as fairseq-hydra-train composes it, is the configuration fairseq reads from the
    recipe's fairseq-train command (fp16 on), field by field in every group the yaml writes;
    the model's architecture by its README name (stage 1 of a multi-exit method: the plain
    model for the recipe's multi-exit one with --exit-layers none)."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
    from fairseq.dataclass.initialize import hydra_init
    from fairseq.dataclass.utils import merge_with_parent

    import acl_fairseq  # noqa: F401  (registers the plugin)
    from acl_fairseq.criterions.base import validate_criterion_config

    name = TASKS[task][0]
    hydra_init(name)  # what fairseq-hydra-train does: the schema of the config
    groups = [g for g in OmegaConf.load(CONFIGS / f"{name}.yaml") if g not in ("hydra", "model")]
    stages = readme_method_overrides()[method]
    base = [f"task.data=/data/{task}-bin", "checkpoint.restore_file=/pretrained/model.pt",
            "checkpoint.save_dir=/ck", f"common.user_dir={USER_DIR}"]  # fmt: skip
    if task == "STS-B" and method != "ce":
        cfg = compose_config(name, [*base, *stages[-1]])
        crit = merge_with_parent(CRITERION_DATACLASS_REGISTRY[cfg.criterion._name](),
                                 cfg.criterion)  # fmt: skip
        with pytest.raises(ValueError, match="is for classification"):
            validate_criterion_config(crit, method)  # as the criterion is built
        return
    commands = glue_commands(task, method, "/data", "/pretrained/model.pt", "/ck",
                             fp16=True, user_dir=USER_DIR)  # fmt: skip
    for stage, (overrides, argv) in enumerate(zip(stages, commands, strict=True), start=1):
        cfg = compose_config(name, [*base, *(o.replace("DIR", "/ck") for o in overrides)])
        expected, args = command_groups(argv, groups)
        composed = hydra_groups(cfg)
        for group, fields in expected.items():
            assert composed[group] == fields, (stage, group)
        stage1_of_multi_exit = len(commands) == 2 and stage == 1
        arch = args.arch.removeprefix("multi_exit_") if stage1_of_multi_exit else args.arch
        assert cfg.model._name == HYDRA_ARCH.get(arch, arch), stage
        assert (getattr(args, "exit_layers", None) == "none") == stage1_of_multi_exit
        for key, value in cfg.model.items():
            assert key == "_name" or getattr(args, key) == value, (stage, key)


# the criterion hyper-parameters of configs/README.md, with the method they go with
README_HYPER_PARAMETERS = {
    "ce_scl": ["++criterion.acl_grad=true", "++criterion.temperature=0.1"],
    "acl": ["++criterion.contrastive_lambda=0.3", "++criterion.acl_grad_threshold=80",
            "++criterion.acl_grad_scope=head", "++task.acl_grad_log=angles.tsv"],
    "multi_exit_joint": ["++criterion.exit_weighting=uniform", "++model.exit_layers=[4,8]",
                         "++model.exit_pooling=mean"],
    "acl_cl": ["++criterion.cross_layer_lambda=0.2", "++criterion.acl_grad=false",
               "++model.freeze_backbone=true"],
}  # fmt: skip


def test_hydra_hyper_parameters_name_real_fields():
    from fairseq.dataclass.initialize import hydra_init

    import acl_fairseq  # noqa: F401  (registers the plugin)

    readme = CONFIGS_README.read_text(encoding="utf-8")
    hydra_init("rte")
    stages = readme_method_overrides()
    for method, extra in README_HYPER_PARAMETERS.items():
        for override in extra:
            assert override.split("=")[0] in readme, override
        cfg = compose_config("rte", ["task.data=D", "checkpoint.restore_file=x",
                                     *stages[method][-1], *extra])  # fmt: skip
        composed = hydra_groups(cfg)  # an unknown field stops the merge
        for override in extra:
            group, key = override[2:].split("=")[0].split(".")
            if group != "model":
                assert key in composed[group], override


CPU_OVERRIDES = "common.cpu=true common.fp16=false"


def test_configs_document_the_cpu_overrides():
    for path in sorted(CONFIGS.glob("*.yaml")):
        header = path.read_text().split("\nhydra:")[0]
        assert f"on a CPU-only machine add  {CPU_OVERRIDES}" in header, path
        assert "fp16: true" in path.read_text(), path  # still fp16 on a GPU
    assert CPU_OVERRIDES in CONFIGS_README.read_text()


# ----------------------------------------------------------------------------- install.sh


def test_install_sh_installs_fairseq_last_without_dependency_checks():
    """pip reports fairseq-fixed's missing torchaudio whenever a later install touches one of
    fairseq's dependencies; pip skips that report for --no-deps, so fairseq goes last."""
    text = (REPO / "scripts" / "install.sh").read_text().replace("\\\n", " ")
    lines = text.splitlines()  # a command continued over lines (\) on one line
    installs = [i for i, line in enumerate(lines) if "$PIP install" in line]
    fairseq = [i for i in installs if "fairseq-fixed" in lines[i]]
    assert len(fairseq) == 1 and fairseq[0] == installs[-1]
    assert "--no-deps" in lines[fairseq[0]] and "--no-build-isolation" in lines[fairseq[0]]
    assert not any("torchaudio" in lines[i] for i in installs)
    assert "tensorboardX" in "\n".join(lines[installs[0] :])
    # the extensions compile on every core and without debug information
    assert "build_ext -j" in lines[fairseq[0]] and "-g0" in lines[fairseq[0]]
