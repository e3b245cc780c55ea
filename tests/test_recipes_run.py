"""The GLUE recipes run for 2 updates on a tiny generated dataset with a tiny model: the
fairseq-hydra-train configs of configs/ and scripts/glue/train.sh (every test trains;
test_recipes.py checks every task x method without training)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairseq_helpers import BIN, REPO, USER_DIR, json_records, run

TRAIN_SH = REPO / "scripts" / "glue" / "train.sh"
CONFIGS = REPO / "configs" / "finetuning"
CPU_OVERRIDES = "common.cpu=true common.fp16=false"
TINY_MODEL = {
    "encoder_layers": 2,
    "encoder_embed_dim": 32,
    "encoder_ffn_embed_dim": 64,
    "encoder_attention_heads": 2,
}
TINY_FLAGS = [f"--{k.replace('_', '-')} {v}" for k, v in TINY_MODEL.items()]
TINY_FLAGS = " ".join(TINY_FLAGS).split() + ["--max-positions", "64"]


@pytest.fixture(scope="module")
def glue_dir(sentiment_data, tmp_path_factory) -> Path:
    """DATA_DIR whose RTE-bin is the session's tiny generated dataset (conftest.py)."""
    glue = tmp_path_factory.mktemp("glue")
    (glue / "RTE-bin").symlink_to(sentiment_data, target_is_directory=True)
    return glue


HYDRA_TINY = [
    "common.cpu=true",
    "common.fp16=false",
    "common.log_interval=1",
    f"common.user_dir={USER_DIR}",
    "dataset.num_workers=0",
    "optimization.max_update=2",
    "task.max_positions=64",
    *[f"++model.{k}={v}" for k, v in TINY_MODEL.items()],
]
# the method overrides of configs/README.md (the last stage's, without its checkpoint paths)
HYDRA_METHOD = {
    "acl": ["criterion._name=acl_embed"],
    "multi_exit_joint": [
        "criterion._name=multi_exit_ce",
        "model._name=multi_exit_roberta",
    ],
    "acl_cl_stage2": [
        "criterion._name=acl_cross_layer",
        "model._name=multi_exit_roberta",
    ],
}


def hydra_train(data: Path, save_dir: Path, restore: str, *overrides: str) -> str:
    return run(
        [
            str(BIN / "fairseq-hydra-train"),
            "--config-dir",
            str(CONFIGS),
            "--config-name",
            "rte",
            f"task.data={data}",
            f"checkpoint.save_dir={save_dir}",
            f"checkpoint.restore_file={restore}",
            *HYDRA_TINY,
            *overrides,
        ],
        timeout=300,
    )


def last_record(out: str, key: str) -> dict:
    records = [r for r in json_records(out) if key in r]
    assert records, f"no {key} in the output:\n{out[-3000:]}"
    return records[-1]


@pytest.fixture(scope="module")
def hydra_acl(glue_dir, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("hydra_acl")
    out = hydra_train(
        glue_dir / "RTE-bin",
        save_dir,
        "checkpoint_last.pt",  # fairseq's default: none saved, so from scratch
        *HYDRA_METHOD["acl"],
        "++criterion.temperature=0.1",
    )
    return save_dir, out


@pytest.mark.slow
def test_hydra_acl(hydra_acl):
    save_dir, out = hydra_acl
    assert (save_dir / "checkpoint_best.pt").is_file()
    assert (save_dir / "hydra_train.log").is_file()  # hydra.run.dir = checkpoint.save_dir
    train = last_record(out, "train_num_updates")
    assert int(train["train_num_updates"]) == 2
    assert "train_acl_grad_angle" in train and "train_contrastive_loss" in train
    assert "'temperature': 0.1" in out


@pytest.mark.slow
def test_hydra_acl_cl_stage2_restores_stage1(glue_dir, hydra_acl, tmp_path):
    stage1, _ = hydra_acl
    out = hydra_train(
        glue_dir / "RTE-bin",
        tmp_path,
        str(stage1 / "checkpoint_best.pt"),
        *HYDRA_METHOD["acl_cl_stage2"],
        "++model.exit_layers=[1]",
    )
    assert f"Loaded checkpoint {stage1 / 'checkpoint_best.pt'}" in out
    assert (tmp_path / "checkpoint_best.pt").is_file()
    valid = last_record(out, "valid_accuracy")
    assert {"valid_accuracy_exit1", "valid_accuracy_exit2"} <= set(valid)
    assert "train_acl_grad_angle" in last_record(out, "train_num_updates")


@pytest.mark.slow
def test_hydra_multi_exit_joint(glue_dir, tmp_path):
    out = hydra_train(
        glue_dir / "RTE-bin", tmp_path, "checkpoint_last.pt", *HYDRA_METHOD["multi_exit_joint"]
    )
    assert (tmp_path / "checkpoint_best.pt").is_file()
    valid = last_record(out, "valid_accuracy")
    assert {"valid_accuracy_exit1", "valid_accuracy_exit2"} <= set(valid)
    assert int(last_record(out, "train_num_updates")["train_num_updates"]) == 2


TRAIN_SH_TINY = ["--cpu", "--num-workers", "0", "--max-update", "2", "--log-interval", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["acl_cl", "multi_exit_joint"])
def test_train_sh_two_stage_methods_run_both_stages(glue_dir, tmp_path, method):
    """Both multi-exit methods: stage 1 (acl or ce), then stage 2 restored from its best
    checkpoint, with the same number of updates."""
    env = {
        "DATA_DIR": str(glue_dir),
        "PRETRAINED": "none",
        "ARCH_ARGS": "--arch roberta",
        "SAVE_DIR": str(tmp_path / "ck"),
        "FAIRSEQ_TRAIN": str(BIN / "fairseq-train"),
        "FP16": "0",
    }
    out = run(["bash", str(TRAIN_SH), "RTE", method, *TRAIN_SH_TINY, *TINY_FLAGS], env=env)
    stage1 = tmp_path / "ck" / "stage1" / "checkpoint_best.pt"
    assert stage1.is_file()
    assert (tmp_path / "ck" / "stage2" / "checkpoint_best.pt").is_file()
    assert f"Loaded checkpoint {stage1}" in out
    valid = last_record(out, "valid_accuracy_exit1")
    assert int(valid["valid_num_updates"]) == 2


@pytest.mark.slow
def test_train_sh_ce_restores_pretrained(glue_dir, hydra_acl, tmp_path):
    """PRETRAINED: a real model.pt (here the tiny hydra run's checkpoint) is restored."""
    pretrained = hydra_acl[0] / "checkpoint_best.pt"
    env = {
        "DATA_DIR": str(glue_dir),
        "PRETRAINED": str(pretrained),
        "ARCH_ARGS": "--arch roberta",
        "SAVE_DIR": str(tmp_path),
        "FAIRSEQ_TRAIN": str(BIN / "fairseq-train"),
    }
    out = run(["bash", str(TRAIN_SH), "rte", "ce", *TRAIN_SH_TINY, *TINY_FLAGS], env=env)
    assert f"Loaded checkpoint {pretrained}" in out
    assert (tmp_path / "checkpoint_best.pt").is_file()
    train = last_record(out, "train_num_updates")
    assert "train_contrastive_loss" not in train  # fairseq's own criterion


@pytest.mark.slow
def test_hydra_config_trains_on_cpu_with_the_documented_overrides(sentiment_data, tmp_path):
    save_dir = tmp_path / "ck"
    out = run(
        [
            str(BIN / "fairseq-hydra-train"),
            "--config-dir",
            str(CONFIGS),
            "--config-name",
            "sst_2",
            f"task.data={sentiment_data}",
            f"checkpoint.save_dir={save_dir}",
            "checkpoint.restore_file=checkpoint_last.pt",
            *CPU_OVERRIDES.split(),
            "dataset.num_workers=0",
            "optimization.max_update=3",
            "common.log_interval=1",
            "task.max_positions=64",
            "++model.encoder_layers=2",
            "++model.encoder_embed_dim=32",
            "++model.encoder_ffn_embed_dim=64",
            "++model.encoder_attention_heads=2",
        ],
        timeout=300,
    )
    assert (save_dir / "checkpoint_best.pt").is_file()
    assert "'fp16': False" in out and "'cpu': True" in out
    assert max(int(r.get("train_num_updates", 0)) for r in json_records(out)) == 3
