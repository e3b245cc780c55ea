"""Checkpoints that fairseq would train through (or fail on late) stop before training.

Each with a message that names the flag or file and the fix: a ``--restore-file`` that does
not exist or is a folder, a Hugging Face or non-fairseq file passed as a checkpoint, a
checkpoint of another vocabulary or architecture; and resuming keeps working.
"""

import argparse
import io
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fairseq import checkpoint_utils

import acl_fairseq  # noqa: F401  (installs the checkpoint checks)
from acl_fairseq.checkpoint.fits import check_checkpoint_fits
from acl_fairseq.checkpoint.safe_loading import check_restore_file

from fairseq_helpers import copy_data, fails_with, fairseq_train, train_args, trained_updates

TRAIN = train_args(task=None, max_update=2, no_epoch_checkpoints=True)
STOCK_CE = ["--task", "sentence_prediction", "--criterion", "sentence_prediction"]
ACL = ["--task", "acl_sentence_prediction", "--criterion", "acl_embed"]
PLUGIN_CE = ["--task", "acl_sentence_prediction", "--criterion", "sentence_prediction"]
ACL_TRAIN = train_args(criterion="acl_embed", batch_size=8, max_update=2, no_epoch_checkpoints=True)
CONVERTER = "acl-fairseq-convert-bert HF_DIR OUTDIR"
NOT_FAIRSEQ = "A fairseq checkpoint is a torch file holding a dict with 'model'"

# fairseq's functions called in this process act as in a plugin run (the other runs are
# fairseq-train commands, stock or plugin, in their own process)
pytestmark = pytest.mark.usefixtures("plugin_run")


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
    # the converter's own output folder (model.pt next to its config.json and vocab.txt)
    for name in ("model.pt", "fairseq_args.txt", "vocab.txt"):
        (tmp_path / name).write_text("")
    with pytest.raises(IsADirectoryError) as info:
        check_restore_file(restore_cfg(tmp_path / "ck", str(tmp_path)))
    assert str(info.value) == (
        f"--restore-file (checkpoint.restore_file) {tmp_path} is a folder: pass the checkpoint "
        f"file inside it, --restore-file {tmp_path / 'model.pt'} with the model flags in "
        f"{tmp_path / 'fairseq_args.txt'}"
    )


def test_restore_file_with_a_model_parallel_suffix(tmp_path):
    (tmp_path / "model-model_part-0.pt").write_bytes(b"")
    path = str(tmp_path / "model.pt")
    suffix = "-model_part-0"
    expected = path.replace(".pt", suffix + ".pt")
    assert check_restore_file(restore_cfg(tmp_path, path), suffix) == expected
    with pytest.raises(FileNotFoundError, match=re.escape("(read as ")):
        check_restore_file(restore_cfg(tmp_path, path), "-model_part-1")


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, guard_rails",
    [(PLUGIN_CE, None), (ACL, None), (STOCK_CE, "all")],
    ids=["plugin_task", "acl_embed", "stock_opted_in"],
)
def test_missing_restore_file_stops_fairseq_train(sentiment_data, tmp_path, method, guard_rails):
    """A run of the plugin's task or criterion (or a stock run that opts in with
    ACL_FAIRSEQ_GUARD_RAILS=all) stops before the first update."""
    missing = tmp_path / "no-such-model.pt"
    out = fails_with(
        sentiment_data,
        tmp_path / "ck",
        *TRAIN,
        *method,
        "--restore-file",
        str(missing),
        message=f"fairseq-train: error: --restore-file (checkpoint.restore_file) {missing}: "
        "no such file",
        env={"ACL_FAIRSEQ_GUARD_RAILS": guard_rails} if guard_rails else None,
    )
    assert not trained_updates(out)
    assert not list((tmp_path / "ck").glob("*.pt"))


@pytest.mark.slow
def test_a_stock_run_with_a_missing_restore_file_goes_as_in_fairseq(sentiment_data, tmp_path):
    """fairseq's own task and criterion with the plugin loaded: fairseq's own line, and
    training from scratch (fairseq's idiom for "never resume")."""
    missing = tmp_path / "no-such-model.pt"
    out = fairseq_train(
        sentiment_data, tmp_path / "ck", *TRAIN, *STOCK_CE, "--restore-file", str(missing)
    )
    assert f"No existing checkpoint found {missing}" in out
    assert trained_updates(out)[-1] == 2


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
    assert trained_updates(out) == [4]


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


def test_an_empty_truncated_or_foreign_file_is_named(tmp_path, tiny_state):
    """No torch traceback, no bare EOFError, no advice to turn the safe loading off."""
    whole = tmp_path / "whole.pt"
    torch.save(tiny_state, whole)
    cases = {
        "empty.pt": (b"", "is empty (0 bytes)"),
        "truncated.pt": (whole.read_bytes()[:3000], "is truncated: an incomplete torch archive "
                         "of 3,000 bytes"),
        "random.pt": (bytes(range(256)) * 20, "is not a torch file (5,120 bytes that are "
                      "neither a torch archive nor a pickle)"),
        "page.pt": (b"<!DOCTYPE html><html>Not Found</html>", "is a text file (37 bytes; a "
                    "failed download?), not a torch file"),
    }  # fmt: skip
    for name, (content, what) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        assert load_fails(path) == (
            "the checkpoint (--restore-file, --finetune-from-model, --path or from_pretrained): "
            f"{path} {what}, so it cannot be loaded: copy or download it again (or train it "
            "again)"
        )
    # the same through acl-fairseq-predict, before any data folder is needed
    from acl_fairseq.cli import predict as predict

    err = io.StringIO()
    assert predict.main([str(tmp_path / "empty.pt")], io.StringIO("x"), io.StringIO(), err) == 2
    assert err.getvalue() == (
        f"acl-fairseq-predict: error: checkpoint: {tmp_path / 'empty.pt'} is empty (0 bytes), so "
        "it cannot be loaded: copy or download it again (or train it again)\n"
    )


@pytest.fixture
def tiny_state():
    """A dict shaped like a fairseq checkpoint, big enough to be cut."""
    return {"model": {"w": torch.randn(64, 64)}, "cfg": None, "args": None}


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
        *PLUGIN_CE,
        "--restore-file",
        str(path),
        message=f"fairseq-train: error: --restore-file (checkpoint.restore_file): {expected}",
    )
    assert not trained_updates(out)


# ------------------------------------------------------- 3. a checkpoint of another model
@pytest.fixture(scope="module")
def tiny_checkpoint(sentiment_data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("tiny_checkpoint")
    fairseq_train(sentiment_data, save_dir, *ACL_TRAIN, "--max-update", "1", "--disable-validation")
    return save_dir / "checkpoint_last.pt"


RESTORE = ["--reset-optimizer", "--reset-dataloader", "--reset-meters", "--reset-lr-scheduler"]


@pytest.mark.slow
def test_restore_file_with_another_vocabulary(sentiment_data, tmp_path, tiny_checkpoint):
    # fairseq alone: "size mismatch for encoder.sentence_encoder.embed_tokens.weight ...
    # Cannot load model parameters from checkpoint ...; please ensure that the architectures
    # match" - but the architecture is the same: the dictionary differs
    data = copy_data(sentiment_data, tmp_path / "data")
    with open(data / "input0" / "dict.txt", "a") as f:
        f.writelines(f"extra{i} 1\n" for i in range(5))
    out = fails_with(
        data,
        tmp_path / "save",
        *ACL_TRAIN,
        "--restore-file",
        str(tiny_checkpoint),
        *RESTORE,
        message="cannot load the checkpoint (--restore-file, --finetune-from-model or --path): "
        "its vocabulary has 73 entries, this model's 78 (from "
        f"{data}/input0/dict.txt). The data was binarized with another dictionary than the "
        "checkpoint's: binarize it again with fairseq-preprocess --srcdict",
    )
    assert (
        out.rstrip().splitlines()[-1].startswith("fairseq-train: error: cannot load the checkpoint")
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--encoder-layers", "3"],
            "it has 2 encoder layers, this model 3 (--encoder-layers / --arch must match",
        ),
        (
            ["--encoder-embed-dim", "16"],
            "its embeddings have 32 dimensions, this model's 16 (--encoder-embed-dim",
        ),
        (
            ["--encoder-ffn-embed-dim", "48"],
            "encoder.sentence_encoder.layers.0.fc1.weight is (64, 32) in the checkpoint but "
            "(48, 32) in this model (--arch and the --encoder-* sizes must match",
        ),
    ],
)
def test_restore_file_of_another_architecture(
    sentiment_data, tmp_path, tiny_checkpoint, args, message
):
    out = fails_with(
        sentiment_data,
        tmp_path,
        *ACL_TRAIN,
        "--restore-file",
        str(tiny_checkpoint),
        *RESTORE,
        *args,
        message="cannot load the checkpoint (--restore-file, --finetune-from-model or --path): "
        + message,
    )
    # fairseq's "Cannot load model parameters ... architectures match" does not end the output
    assert out.rstrip().splitlines()[-1].startswith("fairseq-train: error: cannot load the")


def test_checkpoint_check_leaves_classification_heads_and_legacy_names_alone():
    own = {
        "encoder.sentence_encoder.embed_tokens.weight": torch.zeros(10, 4),
        "encoder.sentence_encoder.layers.0.fc1.weight": torch.zeros(8, 4),
        "classification_heads.h.out_proj.weight": torch.zeros(2, 4),
    }
    ckpt = {
        "decoder.sentence_encoder.embed_tokens.weight": torch.zeros(10, 4),  # old RoBERTa
        "decoder.sentence_encoder.layers.0.fc1.weight": torch.zeros(8, 4),
        "classification_heads.h.out_proj.weight": torch.zeros(3, 4),  # RoBERTa replaces it
    }
    check_checkpoint_fits(ckpt, own, "DATA")
    ckpt["decoder.sentence_encoder.embed_tokens.weight"] = torch.zeros(11, 4)
    with pytest.raises(ValueError, match="its vocabulary has 11 entries, this model's 10"):
        check_checkpoint_fits(ckpt, own, "DATA")
    # EMA restores with strict=False: extra layers are torch's business, not an error here
    ckpt["decoder.sentence_encoder.embed_tokens.weight"] = torch.zeros(10, 4)
    ckpt["decoder.sentence_encoder.layers.1.fc1.weight"] = torch.zeros(8, 4)
    check_checkpoint_fits(ckpt, own, "DATA", strict=False)
    with pytest.raises(ValueError, match="it has 2 encoder layers, this model 1"):
        check_checkpoint_fits(ckpt, own, "DATA")


# ------------------------------------------------------- 4. a reused --save-dir
def run_cfg(criterion="acl_embed", lr=1e-3, data="DATA", **criterion_fields) -> dict:
    """The parts of a fairseq config (as a checkpoint saves it) that make a run another run."""
    return {
        "criterion": {"_name": criterion, "contrastive_lambda": 0.5, **criterion_fields},
        "optimizer": {"_name": "adam"},
        "optimization": {"lr": [lr], "max_update": 2},
        "lr_scheduler": {"_name": "fixed"},
        "model": argparse.Namespace(arch="roberta", encoder_layers=2),  # a legacy model's
        "task": {"_name": "acl_sentence_prediction", "data": data, "num_classes": 2},
    }


def resume_cfg(save_dir: Path, restore="checkpoint_last.pt", reset_optimizer=False):
    return SimpleNamespace(save_dir=str(save_dir), restore_file=restore,
                           reset_optimizer=reset_optimizer)  # fmt: skip


def test_a_save_dir_of_another_run_is_refused(tmp_path):
    from acl_fairseq.checkpoint.resume import check_resume

    last = tmp_path / "checkpoint_last.pt"
    check_resume(run_cfg(), resume_cfg(tmp_path))  # nothing saved yet
    torch.save({"cfg": run_cfg(), "model": {}}, last)
    same = run_cfg()
    same["optimization"]["max_update"] = 10  # training longer is resuming
    check_resume(same, resume_cfg(tmp_path))
    other = run_cfg("ce_scl", lr=5e-5, contrastive_lambda=0.1)
    with pytest.raises(ValueError) as info:
        check_resume(other, resume_cfg(tmp_path))
    assert str(info.value) == (
        f"--save-dir {tmp_path} holds {last}, saved by an earlier run with other settings "
        "(--criterion acl_embed -> ce_scl; --contrastive-lambda 0.5 -> 0.1; --lr [0.001] -> "
        "[5e-05]), and the default --restore-file would resume that run: its optimizer state and "
        f"updates, not the run asked for. Pass --restore-file {last} to resume it anyway, "
        "--reset-optimizer to start a new optimization from its weights, or another --save-dir "
        "to start afresh"
    )
    with pytest.raises(ValueError, match=r"other settings \(DATA .*DATA -> .*elsewhere\)"):
        check_resume(run_cfg(data=str(tmp_path / "elsewhere")), resume_cfg(tmp_path))
    # the command says what is meant: resume it as it is, or a new optimization from it
    check_resume(other, resume_cfg(tmp_path, restore=str(last)))
    check_resume(other, resume_cfg(tmp_path, reset_optimizer=True))


@pytest.mark.slow
def test_reusing_a_save_dir_through_fairseq_train(sentiment_data, tmp_path):
    save_dir = tmp_path / "ck"
    fairseq_train(sentiment_data, save_dir, *TRAIN, *ACL)
    other = [*TRAIN, *PLUGIN_CE, "--lr", "5e-4", "--max-update", "3"]
    out = fails_with(
        sentiment_data,
        save_dir,
        *other,
        message=f"fairseq-train: error: --save-dir {save_dir} holds "
        f"{save_dir / 'checkpoint_last.pt'}, saved by an earlier run with other settings "
        "(--criterion acl_embed -> sentence_prediction",
    )
    assert not trained_updates(out)
    out = fairseq_train(sentiment_data, save_dir, *other, "--reset-optimizer")
    assert f"Loaded checkpoint {save_dir / 'checkpoint_last.pt'}" in out  # its weights,
    assert trained_updates(out) == [1, 2, 3]  # a new optimization with the new settings
    last = save_dir / "checkpoint_last.pt"  # named: resumed as it is, another lr or not
    out = fairseq_train(sentiment_data, save_dir, *TRAIN, *PLUGIN_CE, "--lr", "1e-4",
                        "--restore-file", str(last), "--max-update", "4")  # fmt: skip
    assert f"Loaded checkpoint {last} (epoch 1 @ 3 updates)" in out
    assert trained_updates(out) == [4]


@pytest.mark.slow
def test_hydra_names_the_model_flags_last(sentiment_data, tmp_path, tiny_checkpoint):
    """fairseq-hydra-train without the model's overrides: the last line says what differs."""
    from fairseq_helpers import BIN, REPO, run

    cmd = [
        str(BIN / "fairseq-hydra-train"), "--config-dir", str(REPO / "configs" / "finetuning"),
        "--config-name", "sst_2", f"task.data={sentiment_data}",
        f"checkpoint.save_dir={tmp_path / 'ck'}", f"checkpoint.restore_file={tiny_checkpoint}",
        "common.cpu=true", "common.fp16=false", "dataset.num_workers=0",
        "optimization.max_update=1", f"common.user_dir={REPO / 'acl_fairseq'}",
    ]  # fmt: skip
    with pytest.raises(AssertionError, match="command failed") as info:
        run(cmd)
    lines = [x for x in str(info.value).splitlines() if x.strip()]
    last = next(x for x in reversed(lines) if not x.startswith("Set the environment variable"))
    assert last == (
        "acl_fairseq.checkpoint.fits.CheckpointMismatch: cannot load the checkpoint "
        "(--restore-file, --finetune-from-model or --path): its embeddings have 32 dimensions, "
        "this model's 768 (--encoder-embed-dim / --arch must match the checkpoint's). With "
        "fairseq-hydra-train the model flags are overrides (model._name=..., "
        "++model.encoder_layers=..., task.max_positions=...): configs/README.md turns a "
        "converted BERT's fairseq_args.txt into them"
    )
