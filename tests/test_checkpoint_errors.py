"""Mistakes that fairseq would train through (or fail on late) stop before training.

Each with a message that names the flag or file and the fix: a ``--restore-file`` that does
not exist, a Hugging Face or non-fairseq file passed as a checkpoint, a label that is not in
the label dictionary, ``--num-classes`` with fairseq's own criterion; and what makes configs
and logs usable: the hydra configs on CPU, ``--tensorboard-logdir``, a quiet install.
"""

import logging
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary, indexed_dataset

import acl_fairseq  # noqa: F401  (installs the checkpoint checks)
from acl_fairseq.checkpoint.safe_loading import check_restore_file
from acl_fairseq.input_checks import check_split_files

from fairseq_helpers import (
    BIN,
    REPO,
    fairseq_train,
    json_records,
    preprocess,
    run,
    train_args,
    write_sentiment_split,
)

TRAIN = train_args(task=None, max_update=2, no_epoch_checkpoints=True)
STOCK_CE = ["--task", "sentence_prediction", "--criterion", "sentence_prediction"]
ACL_CE = ["--task", "acl_sentence_prediction", "--criterion", "sentence_prediction"]
ACL = ["--task", "acl_sentence_prediction", "--criterion", "acl_embed"]
CONVERTER = "acl-fairseq-convert-bert HF_DIR OUTDIR"
NOT_FAIRSEQ = "A fairseq checkpoint is a torch file holding a dict with 'model'"


def fails_with(data, save_dir, *args, message: str) -> str:
    """Runs fairseq-train, expects it to fail with ``message``; returns its output."""
    with pytest.raises(AssertionError, match=r"command failed") as info:
        fairseq_train(data, save_dir, *args)
    out = str(info.value)
    assert message in out, out[-3000:]
    return out


def trained_updates(out: str) -> list[int]:
    return [int(r["num_updates"]) for r in json_records(out) if "num_updates" in r]


# ------------------------------------------------------- 1. --restore-file that does not exist
def restore_cfg(save_dir: Path, restore_file: str) -> SimpleNamespace:
    return SimpleNamespace(save_dir=str(save_dir), restore_file=restore_file)


def test_missing_restore_file_is_an_error(tmp_path):
    missing = tmp_path / "roberta.base" / "model.pt"
    with pytest.raises(FileNotFoundError) as info:
        check_restore_file(restore_cfg(tmp_path / "ck", str(missing)))
    message = str(info.value)
    assert message.startswith(f"--restore-file (checkpoint.restore_file) {missing}: no such file")
    assert "would train from randomly initialised weights" in message
    assert f"resume from {tmp_path / 'ck' / 'checkpoint_last.pt'} if it exists" in message


def test_default_restore_file_resumes_or_starts_fresh(tmp_path):
    cfg = restore_cfg(tmp_path, "checkpoint_last.pt")
    assert check_restore_file(cfg) is None  # nothing to resume: fairseq starts fresh
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    assert check_restore_file(cfg) is None  # fairseq resumes from SAVE_DIR/checkpoint_last.pt


def test_save_dirs_checkpoint_last_named_explicitly_may_be_missing(tmp_path):
    last = str(tmp_path / "ck" / "checkpoint_last.pt")
    assert check_restore_file(restore_cfg(tmp_path / "ck", last)) == last
    other_last = str(tmp_path / "elsewhere" / "checkpoint_last.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_restore_file(restore_cfg(tmp_path / "ck", other_last))


def test_explicit_restore_file_over_a_resumable_save_dir_is_warned_about(tmp_path, caplog):
    pretrained = tmp_path / "model.pt"
    pretrained.write_bytes(b"")
    cfg = restore_cfg(tmp_path / "ck", str(pretrained))
    with caplog.at_level(logging.WARNING, logger="acl_fairseq.checkpoint.safe_loading"):
        assert check_restore_file(cfg) == str(pretrained)
    assert not caplog.records  # no checkpoint_last.pt: nothing to say
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "checkpoint_last.pt").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="acl_fairseq.checkpoint.safe_loading"):
        assert check_restore_file(cfg) == str(pretrained)
    last = tmp_path / "ck" / "checkpoint_last.pt"
    assert f"this run starts over from {pretrained}" in caplog.text
    assert f"To resume instead, pass --restore-file {last}" in caplog.text


def test_restore_file_that_is_a_folder(tmp_path):
    with pytest.raises(IsADirectoryError, match="pass the checkpoint file inside it"):
        check_restore_file(restore_cfg(tmp_path / "ck", str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(IsADirectoryError, match=re.escape(CONVERTER)):
        check_restore_file(restore_cfg(tmp_path / "ck", str(tmp_path)))


def test_restore_file_with_a_model_parallel_suffix(tmp_path):
    (tmp_path / "model-model_part-0.pt").write_bytes(b"")
    path = str(tmp_path / "model.pt")
    suffix = "-model_part-0"
    expected = path.replace(".pt", suffix + ".pt")
    assert check_restore_file(restore_cfg(tmp_path, path), suffix) == expected
    with pytest.raises(FileNotFoundError, match=re.escape("(read as ")):
        check_restore_file(restore_cfg(tmp_path, path), "-model_part-1")


@pytest.mark.slow
@pytest.mark.parametrize("method", [STOCK_CE, ACL], ids=["stock_ce", "acl_embed"])
def test_missing_restore_file_stops_fairseq_train(sentiment_data, tmp_path, method):
    """For fairseq's own task and criterion too, before the first update."""
    missing = tmp_path / "no-such-model.pt"
    out = fails_with(
        sentiment_data,
        tmp_path / "ck",
        *TRAIN,
        *method,
        "--restore-file",
        str(missing),
        message=f"FileNotFoundError: --restore-file (checkpoint.restore_file) {missing}: "
        "no such file",
    )
    assert not trained_updates(out)
    assert not list((tmp_path / "ck").glob("*.pt"))


@pytest.mark.slow
def test_resuming_keeps_working(sentiment_data, tmp_path):
    """The default resumes from SAVE_DIR/checkpoint_last.pt; naming it explicitly works on
    the first launch (nothing to resume) and resumes on the next."""
    save_dir = tmp_path / "ck"
    last = save_dir / "checkpoint_last.pt"
    out = fairseq_train(sentiment_data, save_dir, *TRAIN, *STOCK_CE, "--restore-file", str(last))
    assert trained_updates(out)[-1] == 2 and last.is_file()
    args = [*TRAIN, *STOCK_CE, "--max-update", "3"]
    out = fairseq_train(sentiment_data, save_dir, *args)
    assert f"Loaded checkpoint {last} (epoch 1 @ 2 updates)" in out
    assert trained_updates(out)[-1] == 3
    out = fairseq_train(sentiment_data, save_dir, *args[:-1], "4", "--restore-file", str(last))
    assert f"Loaded checkpoint {last} (epoch 1 @ 3 updates)" in out


# ------------------------------------------------------- 2. not a fairseq checkpoint
HF_BERT = {
    "bert.embeddings.word_embeddings.weight": torch.zeros(10, 4),
    "bert.encoder.layer.0.attention.self.query.weight": torch.zeros(4, 4),
}


def load_fails(path: Path, exc=ValueError) -> str:
    with pytest.raises(exc) as info:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    message = str(info.value)
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in message
    return message


@pytest.mark.parametrize(
    "state", [HF_BERT, {k[len("bert.") :]: v for k, v in HF_BERT.items()}], ids=["bert", "model"]
)
def test_hugging_face_state_dict(tmp_path, state):
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    message = load_fails(path)
    key = next(iter(state))
    assert f"{path} is a Hugging Face BERT checkpoint (a state dict with keys such as '{key}')" in (
        message
    )
    assert f"`{CONVERTER}`" in message and "--restore-file OUTDIR/model.pt" in message


@pytest.mark.parametrize("name", ["model.safetensors", "weights.bin"])
def test_safetensors_file(tmp_path, name):
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file({k[len("bert.") :]: v for k, v in HF_BERT.items()}, str(path))
    message = load_fails(path)
    assert f"{path} is a Hugging Face BERT checkpoint (a .safetensors file)" in message
    assert f"`{CONVERTER}`" in message


def test_plain_tensor_dict_is_not_a_fairseq_checkpoint(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(3), "b": torch.zeros(1)}, path)
    message = load_fails(path)
    assert f"{path} is not a fairseq checkpoint (a dict without a 'model' key; its keys: 'w', " in (
        message
    )
    assert NOT_FAIRSEQ in message and "best_loss" not in message
    torch.save(torch.zeros(3), path)
    assert "it holds a Tensor, not a dict" in load_fails(path)


def test_a_broken_file_keeps_torchs_error(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a torch file at all")
    with pytest.raises(Exception) as info:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert "Hugging Face" not in str(info.value) and NOT_FAIRSEQ not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hugging_face", "tensor_dict"])
def test_wrong_kind_of_checkpoint_through_fairseq_train(sentiment_data, tmp_path, kind):
    path = tmp_path / "pytorch_model.bin"
    torch.save(HF_BERT if kind == "hugging_face" else {"w": torch.zeros(3)}, path)
    expected = (
        f"{path} is a Hugging Face BERT checkpoint"
        if kind == "hugging_face"
        else f"{path} is not a fairseq checkpoint"
    )
    out = fails_with(
        sentiment_data,
        tmp_path / "ck",
        *TRAIN,
        *STOCK_CE,
        "--restore-file",
        str(path),
        message=f"ValueError: --restore-file (checkpoint.restore_file): {expected}",
    )
    assert not trained_updates(out)


# ------------------------------------------------------- 3. a label outside label/dict.txt
def write_binarized(lines: list[str], dictionary: Dictionary, prefix: Path) -> None:
    builder = indexed_dataset.make_builder(f"{prefix}.bin", "mmap", vocab_size=len(dictionary))
    for line in lines:
        builder.add_item(dictionary.encode_line(line, add_if_not_exist=False, append_eos=True))
    builder.finalize(f"{prefix}.idx")


def test_unknown_label_is_named_with_its_raw_line(tmp_path):
    """In-process, with a preprocess.log line as fairseq-preprocess writes it."""
    data, raw = tmp_path / "bin", tmp_path / "raw"
    for d in (data / "input0", data / "label", raw):
        d.mkdir(parents=True)
    words, labels = Dictionary(), Dictionary()
    for w in ("a", "b"):
        words.add_symbol(w)
    for label in ("neg", "pos"):
        labels.add_symbol(label)
    valid = ["pos", "neg", "positive", "pos", "Neg"]
    (raw / "valid.label").write_text("\n".join(valid) + "\n")
    (data / "label" / "preprocess.log").write_text(
        f"[None] {raw / 'valid.label'}: 5 sents, 10 tokens, 40.0% replaced (by <unk>)\n"
    )
    write_binarized(["a b"] * 5, words, data / "input0" / "valid")
    write_binarized(valid, labels, data / "label" / "valid")
    cfg = SimpleNamespace(data=str(data), regression_target=False, separator_token=None)
    with pytest.raises(ValueError) as info:
        check_split_files(cfg, "valid", words, labels)
    assert str(info.value).startswith(
        f"{data}/label/valid.bin: 2 of 5 labels are not in {data}/label/dict.txt (binarized as "
        f"<unk>): lines 3, 5 of {raw / 'valid.label'} (line 3: 'positive', line 5: 'Neg'). "
        "The dictionary lists neg, pos."
    )
    assert "re-run the data preparation" in str(info.value)
    (raw / "valid.label").unlink()  # raw file gone: the lines are still named
    with pytest.raises(ValueError, match=r"\(binarized as <unk>\): lines 3, 5\. The dictionary"):
        check_split_files(cfg, "valid", words, labels)
    write_binarized(["pos", "neg", "pos", "pos", "neg"], labels, data / "label" / "valid")
    check_split_files(cfg, "valid", words, labels)  # every label known: no error


@pytest.fixture(scope="module")
def unknown_label_data(tmp_path_factory):
    """Binarized by fairseq-preprocess: valid has a label ('2') that train does not have."""
    root = tmp_path_factory.mktemp("unknown_label")
    raw = root / "raw"
    raw.mkdir()
    write_sentiment_split(raw / "train", 96, seed=0)
    write_sentiment_split(raw / "valid", 32, seed=1)
    lines = (raw / "valid.label").read_text().splitlines()
    lines[4] = "2"
    (raw / "valid.label").write_text("\n".join(lines) + "\n")
    return preprocess(raw, root / "bin"), raw


@pytest.mark.slow
@pytest.mark.parametrize("method", [ACL_CE, ACL], ids=["sentence_prediction", "acl_embed"])
def test_unknown_label_stops_at_load_time(unknown_label_data, tmp_path, method):
    data, raw = unknown_label_data
    out = fails_with(
        data,
        tmp_path,
        *TRAIN,
        *method,
        message=f"ValueError: {data}/label/valid.bin: 1 of 32 labels are not in "
        f"{data}/label/dict.txt (binarized as <unk>): line 5 of {raw / 'valid.label'} "
        "(line 5: '2'). The dictionary lists ",
    )
    assert re.search(r"The dictionary lists (0, 1|1, 0)\. Fix the label if it is a typo", out)
    assert not trained_updates(out)


# ------------------------------------------------------- 4. --num-classes with fairseq's criterion
@pytest.mark.slow
def test_num_classes_is_checked_for_fairseqs_criterion(sentiment_data, tmp_path):
    out = fails_with(
        sentiment_data,
        tmp_path,
        *TRAIN,
        *ACL_CE,
        "--num-classes",
        "3",
        message=f"ValueError: --num-classes 3 does not match {sentiment_data}/label/dict.txt, "
        "which lists 2 labels (",
    )
    assert re.search(r"which lists 2 labels \((0, 1|1, 0)\); pass --num-classes 2", out)
    assert not trained_updates(out)


@pytest.mark.slow
def test_ce_trains_the_same_on_the_plugins_task(sentiment_data, tmp_path):
    """The task runs fairseq's own train_step for a criterion without loss terms: the same
    losses, update by update, as fairseq's sentence_prediction task."""
    args = [*TRAIN, "--max-update", "4", "--dropout", "0.1", "--no-save"]
    stock = fairseq_train(sentiment_data, tmp_path / "stock", *args, *STOCK_CE)
    plugin = fairseq_train(sentiment_data, tmp_path / "plugin", *args, *ACL_CE)

    def losses(out):
        return [
            (r["num_updates"], r["loss"], r["accuracy"])
            for r in json_records(out)
            if "num_updates" in r and "epoch" in r
        ]

    assert len(losses(stock)) == 4
    assert losses(plugin) == losses(stock)


def test_train_sh_runs_every_method_on_the_plugins_task():
    for task, method in [("RTE", "ce"), ("STS-B", "ce"), ("RTE", "acl")]:
        proc = run(
            ["bash", str(REPO / "scripts/glue/train.sh"), task, method, "--dry-run"],
            env={"DATA_DIR": "/nonexistent", "PRETRAINED": "none", "FP16": "0"},
        )
        command = [line for line in proc.splitlines() if "fairseq-train" in line]
        assert len(command) == 1 and " --task acl_sentence_prediction " in command[0], proc


# ------------------------------------------------------- 5. the hydra configs on CPU
CONFIGS = REPO / "configs" / "finetuning"
CPU_OVERRIDES = "common.cpu=true common.fp16=false"


def test_configs_document_the_cpu_overrides():
    for path in sorted(CONFIGS.glob("*.yaml")):
        header = path.read_text().split("\nhydra:")[0]
        assert f"on a CPU-only machine add  {CPU_OVERRIDES}" in header, path
        assert "fp16: true" in path.read_text(), path  # still fp16 on a GPU
    assert CPU_OVERRIDES in (REPO / "configs" / "README.md").read_text()


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


# ------------------------------------------------------- 6. --tensorboard-logdir
def scalar_tags(folder: Path) -> set[str]:
    """The scalar tags in the TensorBoard event files of ``folder`` (TFRecord framing:
    u64 length, u32 crc, an Event message, u32 crc)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in folder.glob("events.out.tfevents.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12 : i + 12 + n])
            tags |= {v.tag for v in event.summary.value if v.HasField("simple_value")}
            i += 12 + n + 4
    return tags


@pytest.mark.slow
def test_tensorboard_logdir_writes_the_acl_scalars(sentiment_data, tmp_path):
    logdir = tmp_path / "tb"
    fairseq_train(
        sentiment_data,
        tmp_path / "ck",
        *TRAIN,
        "--arch",
        "multi_exit_roberta_tiny",
        "--encoder-layers",
        "2",
        "--task",
        "acl_sentence_prediction",
        "--criterion",
        "acl_cross_layer",
        "--no-save",
        "--tensorboard-logdir",
        str(logdir),
    )
    per_exit = {"accuracy_exit1", "accuracy_exit2"}
    acl = {"acl_grad_angle", "acl_grad_drop", "ce_loss", "contrastive_loss"}
    assert acl | per_exit | {"loss", "accuracy"} <= scalar_tags(logdir / "train_inner")
    assert per_exit | {"ce_loss", "contrastive_loss"} <= scalar_tags(logdir / "valid")


# ------------------------------------------------------- 7. the install prints no false alarm
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


def test_fairseq_writes_tensorboard_files_with_an_installed_writer():
    from fairseq.logging import progress_bar

    assert progress_bar.SummaryWriter is not None, "pip install tensorboardX"
