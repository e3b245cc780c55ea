"""Two-stage multi-exit training through the real CLIs, per-exit validation, early exit."""

import struct
from pathlib import Path

import pytest
import torch

from fairseq_helpers import fairseq_train, fairseq_validate, json_records, train_args

TINY = [
    "--encoder-layers", "3", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--max-positions", "64",
]  # fmt: skip
COMMON = train_args(
    [],
    seed=2,
    no_epoch_checkpoints=True,
    best_checkpoint_metric="accuracy",
    maximize_best_checkpoint_metric=True,
    exit_pooling="mean",
)


@pytest.mark.slow
@pytest.mark.server_off
def test_two_stage_acl_then_acl_cl(sentiment_data, tmp_path):
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    fairseq_train(
        sentiment_data, stage1, "--arch", "multi_exit_roberta", *TINY, "--exit-layers", "none",
        "--criterion", "acl_embed", "--max-epoch", "3", *COMMON,
    )  # fmt: skip
    out = fairseq_train(
        sentiment_data, stage2, "--arch", "multi_exit_roberta", *TINY,
        "--criterion", "acl_cross_layer", "--max-epoch", "3", *COMMON,
        "--restore-file", str(stage1 / "checkpoint_best.pt"),
        "--reset-optimizer", "--reset-dataloader", "--reset-meters",
    )  # fmt: skip
    assert "Loaded checkpoint" in out
    valid = [r for r in json_records(out) if "valid_accuracy_exit1" in r]
    train = [r for r in json_records(out) if "train_accuracy_exit1" in r]
    assert valid and train
    assert {"train_acl_grad_angle", "train_acl_grad_drop"} <= set(train[-1])
    # the layer-score curve is in the training log; exits learn (chance is 50%)
    last = valid[-1]
    for layer in (1, 2, 3):
        assert f"valid_accuracy_exit{layer}" in last
        assert float(last[f"valid_accuracy_exit{layer}"]) > 60.0
    assert last["valid_accuracy"] == last["valid_accuracy_exit3"]  # `accuracy` = final exit

    # fairseq-validate reports every exit of the checkpoint in one pass, identically
    vout = fairseq_validate(
        sentiment_data, stage2 / "checkpoint_last.pt", "--task", "acl_sentence_prediction",
        "--criterion", "multi_exit_ce", "--batch-size", "16",
    )  # fmt: skip
    (rec,) = [r for r in json_records(vout) if "valid_accuracy_exit1" in r]
    for layer in (1, 2, 3):
        key = f"valid_accuracy_exit{layer}"
        assert float(rec[key]) == pytest.approx(float(last[key]))

    # the hub interface loads every exit and early exit agrees with the full forward
    from acl_fairseq.models import MultiExitRobertaModel

    hub = MultiExitRobertaModel.from_pretrained(
        str(stage2), "checkpoint_last.pt", data_name_or_path=str(sentiment_data), bpe=None
    )
    ds = hub.task.load_dataset("valid")
    tokens = ds[0]["net_input.src_tokens"]
    full = hub.exit_logits("sentence_classification_head", tokens)
    assert sorted(full) == [1, 2, 3]
    never = hub.predict_early_exit("sentence_classification_head", tokens, "maxprob:1.0")
    assert never.exit_layers.tolist() == [3]
    assert torch.allclose(never.logits, full[3], atol=1e-5)
    always = hub.predict_early_exit("sentence_classification_head", tokens, "maxprob:0.0")
    assert always.exit_layers.tolist() == [1]
    assert torch.allclose(always.logits, full[1], atol=1e-5)


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
        *train_args(task=None, max_update=2),
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


@pytest.mark.slow
@pytest.mark.parametrize("criterion", ["multi_exit_ce", "acl_cross_layer"])
def test_self_distillation_through_fairseq_train(sentiment_data, tmp_path, criterion):
    out = fairseq_train(
        sentiment_data, tmp_path / "ck", *train_args(task=None, max_update=3),
        "--arch", "multi_exit_roberta_tiny", "--encoder-layers", "2",
        "--task", "acl_sentence_prediction", "--criterion", criterion, "--no-save",
        "--self-distill-weight", "0.5", "--self-distill-temperature", "2",
        "--validate-interval-updates", "3",
    )  # fmt: skip
    train = json_records(out, kind="train_inner")
    valid = [r for r in json_records(out) if "valid_self_distill_loss" in r]
    assert len(train) == 3 and valid
    for r in train:
        assert float(r["self_distill_loss"]) > 0
        parts = sum(float(r[k]) for k in ("ce_loss", "contrastive_loss", "self_distill_loss"))
        assert float(r["loss"]) == pytest.approx(parts, abs=3e-3)
    if criterion == "acl_cross_layer":  # ACL-Grad's train_step ran with the term
        assert "acl_grad_angle" in train[-1]


@pytest.mark.slow
@pytest.mark.parametrize("criterion", ["multi_exit_ce", "acl_cross_layer"])
def test_alternate_exits_through_fairseq_train(sentiment_data, tmp_path, criterion):
    """--alternate-exits through the trainer (and ACL-Grad's train_step for acl_cross_layer):
    the 1st and 3rd updates' CE is the final exit's alone, the 2nd and 4th the uniform mean."""
    out = fairseq_train(
        sentiment_data, tmp_path / "ck", *train_args(task=None, max_update=4),
        "--arch", "multi_exit_roberta_tiny", "--encoder-layers", "2",
        "--task", "acl_sentence_prediction", "--criterion", criterion, "--no-save",
        "--exit-weighting", "uniform", "--alternate-exits", "--log-interval", "1",
        "--log-format", "json",
    )  # fmt: skip
    train = json_records(out, kind="train_inner")
    assert [int(r["num_updates"]) for r in train] == [1, 2, 3, 4]
    gaps = []  # how far the uniform mean is from the final exit's CE, per update
    for r in train:
        exits = [float(r["loss_exit1"]), float(r["loss_exit2"])]
        final_only = int(r["num_updates"]) % 2 == 1
        expected = exits[1] if final_only else sum(exits) / 2
        assert float(r["ce_loss"]) == pytest.approx(expected, abs=1.5e-3)  # logged to 3 places
        gaps.append(abs(exits[0] - exits[1]) / 2)
    assert max(gaps) > 5e-3  # the two readings are told apart on some update
