"""End to end through the real ``fairseq-train`` / ``fairseq-validate`` entry points."""

import pytest

from fairseq_helpers import (
    fairseq_train,
    fairseq_validate,
    json_records,
    train_args,
)

TRAIN = train_args(
    max_epoch=4,
    no_epoch_checkpoints=True,
    best_checkpoint_metric="accuracy",
    maximize_best_checkpoint_metric=True,
)


def records(out, kind):
    prefix = {"train": "train_", "valid": "valid_"}[kind]
    return [r for r in json_records(out) if f"{prefix}accuracy" in r]


@pytest.mark.slow
@pytest.mark.parametrize(
    "criterion,extra,acl_grad",
    [
        pytest.param("acl_embed", [], True, marks=pytest.mark.server_off),
        ("ce_scl", [], False),
        ("ce_scl", ["--acl-grad"], True),
        ("acl_embed", ["--acl-grad-scope", "head", "--update-freq", "2"], True),
        ("acl_embed", ["--no-acl-grad", "--update-freq", "2", "--report-acc-and-f1"], False),
    ],
)
def test_train_then_validate(sentiment_data, tmp_path, criterion, extra, acl_grad):
    out = fairseq_train(sentiment_data, tmp_path, *TRAIN, "--criterion", criterion, *extra)
    train = records(out, "train")
    valid = records(out, "valid")
    assert len(train) == 4 and len(valid) == 4
    for key in ("loss", "ce_loss", "contrastive_loss", "accuracy"):
        assert f"train_{key}" in train[-1] and f"valid_{key}" in valid[-1]
    # the total is the sum of its terms (all in bits per sentence)
    last = train[-1]
    assert float(last["train_loss"]) == pytest.approx(
        float(last["train_ce_loss"]) + float(last["train_contrastive_loss"]), abs=2e-3
    )
    if acl_grad:
        angles = [float(r["train_acl_grad_angle"]) for r in train]
        drops = [float(r["train_acl_grad_drop"]) for r in train]
        assert all(0.0 <= a <= 180.0 for a in angles)
        assert all(0.0 <= d <= 1.0 for d in drops)
    else:
        assert "train_acl_grad_angle" not in last
    # a learnable task: training accuracy rises well above chance
    first_acc = float(train[0]["train_accuracy"])
    last_acc = float(train[-1]["train_accuracy"])
    assert last_acc > 75.0 and last_acc > first_acc + 10.0
    assert float(valid[-1]["valid_accuracy"]) > 70.0
    if "--report-acc-and-f1" in extra:
        assert "valid_f1" in valid[-1]

    # fairseq-validate reproduces the training run's last validation accuracy
    vout = fairseq_validate(
        sentiment_data,
        tmp_path / "checkpoint_last.pt",
        "--task",
        "acl_sentence_prediction",
        "--criterion",
        criterion,
        "--batch-size",
        "16",
    )
    (vrec,) = [r for r in json_records(vout) if "valid_accuracy" in r]
    assert float(vrec["valid_accuracy"]) == pytest.approx(float(valid[-1]["valid_accuracy"]))


@pytest.mark.slow
def test_angle_log_and_restore_file(sentiment_data, tmp_path):
    """--acl-grad-log writes one row per update (one decision per update, with 2 micro-batches
    each); the checkpoint restores into a new run."""
    log = tmp_path / "angles.tsv"
    stage1 = tmp_path / "stage1"
    out = fairseq_train(
        sentiment_data,
        stage1,
        *TRAIN,
        "--criterion",
        "acl_embed",
        "--max-epoch",
        "1",
        "--update-freq",
        "2",
        "--acl-grad-log",
        str(log),
    )
    updates = int(records(out, "train")[-1]["train_num_updates"])
    rows = log.read_text().splitlines()
    assert [int(r.split("\t")[0]) for r in rows] == list(range(updates))
    kept = [int(r.split("\t")[2]) for r in rows]
    angles = [float(r.split("\t")[1]) for r in rows]
    assert all(k == (a <= 90.0) for k, a in zip(kept, angles))
    head_angles = [float(r.split("\t")[3]) for r in rows]  # the heads' share, for comparison
    assert all(0.0 <= a <= 180.0 for a in head_angles) and head_angles != angles
    out = fairseq_train(
        sentiment_data,
        tmp_path / "stage2",
        *TRAIN,
        "--criterion",
        "ce_scl",
        "--max-epoch",
        "1",
        "--restore-file",
        str(stage1 / "checkpoint_last.pt"),
        "--reset-optimizer",
        "--reset-dataloader",
        "--reset-meters",
    )
    assert "Loaded checkpoint" in out


def test_import_twice_registers_once():
    from fairseq import checkpoint_utils
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.tasks import TASK_REGISTRY

    import acl_fairseq

    loader = checkpoint_utils.load_checkpoint_to_cpu
    acl_fairseq.fairseq_patches.install()  # a second install: every patch once
    assert checkpoint_utils.load_checkpoint_to_cpu is loader
    import acl_fairseq.criterions  # noqa: F401  (second import is a no-op)

    assert {"acl_embed", "ce_scl"} <= set(CRITERION_REGISTRY)
    assert "acl_sentence_prediction" in TASK_REGISTRY


def test_a_bad_flag_fails_through_the_command_line_before_training(sentiment_data, tmp_path):
    """One case through fairseq-train itself; every flag check has an in-process test in
    tests/test_criterion_settings.py."""
    with pytest.raises(AssertionError, match="--acl-grad-threshold is an angle") as failure:
        fairseq_train(
            sentiment_data, tmp_path, *TRAIN, "--criterion", "acl_embed",
            "--acl-grad-threshold", "200",
        )  # fmt: skip
    assert "begin training epoch" not in str(failure.value)


STOCK_CE = ["--task", "sentence_prediction", "--criterion", "sentence_prediction"]
ACL_CE = ["--task", "acl_sentence_prediction", "--criterion", "sentence_prediction"]


@pytest.mark.slow
def test_ce_trains_the_same_on_the_plugins_task(sentiment_data, tmp_path):
    """The task runs fairseq's own train_step for a criterion without loss terms: the same
    losses, update by update, as fairseq's sentence_prediction task."""
    args = [*train_args(task=None), "--max-update", "4", "--dropout", "0.1", "--no-save"]
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
