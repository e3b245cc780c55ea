"""The GLUE recipes: scripts/glue/train.sh and the fairseq-hydra-train configs in configs/,
and the install script.

``train.sh --dry-run`` is parsed for every task x method (and compared with the recipe's
builder, ``acl_fairseq.experiment.recipe``) and the yaml files are composed;
test_recipes_run.py runs the recipes for 2 updates on a tiny generated dataset with a tiny model.
"""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from omegaconf import OmegaConf

from acl_fairseq.experiment.recipe import glue_commands

from fairseq_helpers import BIN, REPO, USER_DIR

TRAIN_SH = REPO / "scripts" / "glue" / "train.sh"
CONFIGS = REPO / "configs" / "finetuning"

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
FP16_FLAGS = ["--fp16", "--fp16-init-scale", "4", "--threshold-loss-scale", "1"]

# ----------------------------------------------------------------------------- helpers


def train_sh(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Runs scripts/glue/train.sh (without a GPU check unless FP16 is left unset)."""
    full_env = {
        **os.environ,
        "FAIRSEQ_TRAIN": str(BIN / "fairseq-train"),
        "FP16": "0",
        "PRETRAINED": "/pretrained/model.pt",
        "DATA_DIR": "/nonexistent/glue-bin",
        "OMP_NUM_THREADS": "1",
    }
    full_env.pop("DRY_RUN", None)
    full_env.update(env)
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run(
        ["bash", str(TRAIN_SH), *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=str(REPO),
        timeout=600,
    )


def dry_run_commands(*args: str, **env: str) -> list[list[str]]:
    """The fairseq-train command lines that ``train.sh ... --dry-run`` prints."""
    proc = train_sh(*args, "--dry-run", **env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    return [shlex.split(line) for line in lines]


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


# ----------------------------------------------------------------------------- fast: train.sh


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("task", list(TASKS))
def test_dry_run_every_task_and_method(task, method):
    _, num_classes, lr, bsz, updates, warmup, metric = TASKS[task]
    fs_task, criterion, multi_exit = METHODS[method]
    if task == "STS-B" and method != "ce":
        proc = train_sh(task, method, "--dry-run")
        assert proc.returncode != 0 and not proc.stdout
        assert "STS-B is a regression task" in proc.stderr
        assert f"method '{method}'" in proc.stderr and "use method 'ce'" in proc.stderr
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
def test_train_sh_is_the_recipe_builders_command(task, method):
    """train.sh writes in bash what ``acl_fairseq.experiment.recipe.glue_commands`` builds: the same
    command lines, flag for flag and in the same order (extra and stage-2 arguments too)."""
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
    (argv,) = dry_run_commands("rte", "acl", DRY_RUN="1", SEED="7", FP16="0")
    f = parse_flags(argv)
    assert f["--save-dir"] == "checkpoints/RTE-acl"
    assert f["--seed"] == "7"
    assert "--fp16" not in f
    # DRY_RUN=1 works without --dry-run too
    proc = train_sh("rte", "acl", DRY_RUN="1")
    assert proc.returncode == 0 and "fairseq-train" in proc.stdout


def test_cpu_turns_fp16_off_without_gpu_check():
    (argv,) = dry_run_commands("sst-2", "ce", "--cpu", FP16=None)
    f = parse_flags(argv)
    assert f["--cpu"] is True and "--fp16" not in f
    proc = train_sh("sst-2", "ce", "--cpu", "--dry-run", FP16="1")
    assert proc.returncode != 0 and "fp16 training needs a GPU" in proc.stderr


@pytest.mark.parametrize("gpu", [True, False])
def test_fp16_default_follows_gpu(tmp_path, gpu):
    """FP16 unset: the script asks PYTHON whether torch sees a CUDA GPU."""
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nexit {0 if gpu else 1}\n")
    fake_python.chmod(0o755)
    proc = train_sh("rte", "acl", "--dry-run", FP16=None, PYTHON=str(fake_python))
    assert proc.returncode == 0, proc.stderr
    assert ("--fp16" in proc.stdout.split()) == gpu
    assert ("no CUDA GPU visible" in proc.stderr) != gpu


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
    """ARCH_ARGS from convert_hf_bert.py's fairseq_args.txt overrides the recipe's defaults."""
    bert = (
        "--arch roberta --encoder-layers 6 --encoder-embed-dim 384 --encoder-ffn-embed-dim 1536 "
        "--encoder-attention-heads 12 --max-positions 512 --activation-fn gelu --dropout 0.1 "
        "--attention-dropout 0.1"
    )
    stage1, stage2 = dry_run_commands("mrpc", "acl_cl", ARCH_ARGS=bert)
    for argv, arch in ((stage1, "multi_exit_roberta"), (stage2, "multi_exit_roberta")):
        f = parse_flags(argv)
        assert f["--arch"] == arch and f["--encoder-embed-dim"] == "384"
        assert f["--activation-fn"] == "gelu"


def test_extra_args_override_and_stage2_args():
    stage1, stage2 = dry_run_commands(
        "qnli",
        "acl_cl",
        "--contrastive-lambda",
        "0.3",
        "--lr",
        "3e-05",
        STAGE2_ARGS="--freeze-backbone --cross-layer-lambda 0.2",
    )
    f1, f2 = parse_flags(stage1), parse_flags(stage2)
    assert f1["--contrastive-lambda"] == f2["--contrastive-lambda"] == "0.3"
    assert f1["--lr"] == f2["--lr"] == "3e-05"  # the last --lr wins in argparse
    assert "--freeze-backbone" not in f1 and f2["--freeze-backbone"] is True
    assert f2["--cross-layer-lambda"] == "0.2"
    # the contrastive hyper-parameters are left to the criterions' defaults otherwise
    (acl,) = dry_run_commands("qnli", "acl")
    assert "--contrastive-lambda" not in parse_flags(acl)
    assert "--temperature" not in parse_flags(acl)


@pytest.mark.parametrize(
    "args,message",
    [
        (["WNLI", "acl", "--dry-run"], "unknown task 'WNLI'"),
        (["rte", "scl", "--dry-run"], "unknown method 'scl'"),
        (["rte"], "expected TASK and METHOD"),
        (["sts-b", "multi_exit_joint", "--dry-run"], "STS-B is a regression task"),
    ],
)
def test_bad_arguments(args, message):
    proc = train_sh(*args)
    assert proc.returncode == 2 and not proc.stdout
    assert message in proc.stderr


def test_bad_arch_for_multi_exit():
    proc = train_sh("rte", "multi_exit_joint", "--dry-run", ARCH_ARGS="--arch bert_base")
    assert proc.returncode == 2 and "--arch bert_base has no multi-exit variant" in proc.stderr


def test_missing_paths_fail_before_fairseq(tmp_path):
    # fairseq-train is replaced by a command that would leave a trace if it ran
    trace = tmp_path / "ran"
    fake = tmp_path / "fake-fairseq-train"
    fake.write_text(f"#!/bin/sh\ntouch {trace}\n")
    fake.chmod(0o755)
    data = tmp_path / "glue"
    env = {"FAIRSEQ_TRAIN": str(fake), "DATA_DIR": str(data)}

    proc = train_sh("rte", "acl", **env)
    assert proc.returncode == 2 and f"{data}/RTE-bin not found" in proc.stderr
    (data / "RTE-bin" / "input0").mkdir(parents=True)
    proc = train_sh("rte", "acl", **env, PRETRAINED=str(tmp_path / "nope.pt"))
    assert proc.returncode == 2 and "nope.pt: no such file" in proc.stderr
    proc = train_sh("rte", "acl", **env, PRETRAINED="")
    assert proc.returncode == 2 and "PRETRAINED is not set" in proc.stderr
    (data / "RTE-bin" / "prepare_glue.json").write_text('{\n  "num_classes": 3\n}\n')
    proc = train_sh("rte", "acl", **env, PRETRAINED="none")
    assert proc.returncode == 2 and "num_classes 3 but RTE has 2" in proc.stderr
    assert not trace.exists()
    # a dry run only warns about missing files
    proc = train_sh("mnli", "acl", "--dry-run", **env)
    assert proc.returncode == 0 and "(dry run: continuing)" in proc.stderr
    # everything in place: the (fake) fairseq-train runs
    (data / "RTE-bin" / "prepare_glue.json").write_text('{"num_classes": 2}')
    proc = train_sh("rte", "acl", **env, PRETRAINED="none")
    assert proc.returncode == 0, proc.stderr
    assert trace.exists()


def test_help():
    proc = train_sh("--help")
    assert proc.returncode == 0 and "Usage: scripts/glue/train.sh TASK METHOD" in proc.stdout


# ----------------------------------------------------------------------------- fast: configs


@pytest.mark.parametrize("task", list(TASKS))
def test_hydra_config_matches_recipe(task):
    name, num_classes, lr, bsz, updates, warmup, metric = TASKS[task]
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{name}.yaml"))  # as hydra reads it
    assert cfg["task"]["_name"] == "acl_sentence_prediction"
    assert cfg["criterion"]["_name"] == "sentence_prediction"
    assert cfg["model"]["_name"] == "roberta"
    assert cfg["task"]["num_classes"] == num_classes
    assert cfg["optimization"]["lr"] == [lr]
    assert cfg["optimization"]["max_update"] == updates
    assert cfg["optimization"]["max_epoch"] == 10
    assert cfg["dataset"]["batch_size"] == bsz
    assert cfg["lr_scheduler"]["warmup_updates"] == warmup
    assert cfg["checkpoint"]["best_checkpoint_metric"] == metric
    assert cfg["checkpoint"]["maximize_best_checkpoint_metric"] == (metric != "loss")
    assert cfg["checkpoint"]["restore_file"] == "???"
    assert bool(cfg["criterion"].get("regression_target")) == (task == "STS-B")
    assert bool(cfg["criterion"].get("report_mcc")) == (task == "CoLA")
    assert bool(cfg["criterion"].get("report_acc_and_f1")) == (task in ("MRPC", "QQP"))
    assert cfg["common"]["user_dir"] == "acl_fairseq"
    assert cfg["optimizer"] == {
        "_name": "adam",
        "weight_decay": 0.1,
        "adam_betas": "(0.9,0.98)",
        "adam_eps": 1e-06,
    }


# the method overrides of configs/README.md, with some of the hyper-parameters it lists
README_OVERRIDES = {
    "ce": [],
    "ce_scl": [
        "criterion._name=ce_scl",
        "++criterion.acl_grad=true",
        "++criterion.temperature=0.1",
    ],
    "acl": [
        "criterion._name=acl_embed",
        "++criterion.contrastive_lambda=0.3",
        "++criterion.acl_grad_threshold=80",
        "++task.acl_grad_log=angles.tsv",
    ],
    "multi_exit_joint": [
        "criterion._name=multi_exit_ce",
        "model._name=multi_exit_roberta",
        "++criterion.exit_weighting=uniform",
        "++model.exit_layers=[4,8]",
        "++model.exit_pooling=mean",
    ],
    "acl_cl": [
        "criterion._name=acl_cross_layer",
        "model._name=multi_exit_roberta",
        "++criterion.cross_layer_lambda=0.2",
        "++criterion.acl_grad=false",
        "++model.freeze_backbone=true",
    ],
}


@pytest.mark.parametrize("task", list(TASKS))
def test_hydra_overrides_compose(task):
    """Every method's overrides compose with every task config, and name real fields."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
    from fairseq.dataclass.initialize import hydra_init
    from fairseq.dataclass.utils import merge_with_parent
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.tasks import TASK_DATACLASS_REGISTRY
    from hydra import compose, initialize_config_dir

    import acl_fairseq  # noqa: F401  (registers the plugin)
    from acl_fairseq.criterions.base import validate_criterion_config

    name = TASKS[task][0]
    hydra_init(name)  # what fairseq-hydra-train does: the schema of the config
    # every method on two configs; the others (same keys, other values) with one method
    methods = list(README_OVERRIDES) if task in ("RTE", "STS-B") else ["acl_cl"]
    for method in methods:
        overrides = README_OVERRIDES[method]
        with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
            cfg = compose(name, [f"task.data={task}-bin", "checkpoint.restore_file=x", *overrides])
        crit = merge_with_parent(CRITERION_DATACLASS_REGISTRY[cfg.criterion._name](), cfg.criterion)
        merge_with_parent(TASK_DATACLASS_REGISTRY[cfg.task._name](), cfg.task)
        assert cfg.model._name in ARCH_MODEL_REGISTRY
        assert cfg.task.num_classes == TASKS[task][1]
        assert cfg.optimization.lr == [TASKS[task][2]]
        assert crit.regression_target == (task == "STS-B")
        if task == "STS-B" and method != "ce":
            # the criterions refuse regression when they are built
            if hasattr(crit, "temperature"):
                with pytest.raises(ValueError, match="is for classification"):
                    validate_criterion_config(crit, method)


CPU_OVERRIDES = "common.cpu=true common.fp16=false"


def test_configs_document_the_cpu_overrides():
    for path in sorted(CONFIGS.glob("*.yaml")):
        header = path.read_text().split("\nhydra:")[0]
        assert f"on a CPU-only machine add  {CPU_OVERRIDES}" in header, path
        assert "fp16: true" in path.read_text(), path  # still fp16 on a GPU
    assert CPU_OVERRIDES in (REPO / "configs" / "README.md").read_text()


# ----------------------------------------------------------------------------- fast: install.sh


def test_install_sh_installs_fairseq_last_without_dependency_checks():
    """pip reports fairseq-fixed's missing torchaudio whenever a later install touches one of
    fairseq's dependencies; pip skips that report for --no-deps, so fairseq goes last."""
    lines = (REPO / "scripts" / "install.sh").read_text().splitlines()
    installs = [i for i, line in enumerate(lines) if "$PIP install" in line]
    fairseq = [i for i in installs if "fairseq-fixed" in lines[i]]
    assert len(fairseq) == 1 and fairseq[0] == installs[-1]
    assert "--no-deps" in lines[fairseq[0]] and "--no-build-isolation" in lines[fairseq[0]]
    assert not any("torchaudio" in lines[i] for i in installs)
    assert "tensorboardX" in "\n".join(lines[installs[0] :])
