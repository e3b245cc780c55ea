"""Criterion flags that cannot work stop fairseq-train's set-up with a message naming the flag.

Flag checks run where fairseq-train runs them, in-process: the command line is parsed by
fairseq's parser, and the task, model and criterion are built from it (set-up, no training;
tests/test_e2e_single_exit.py checks that such an error reaches the command line before
training).
"""

import re

import pytest
from fairseq.data import Dictionary
from omegaconf import OmegaConf

from acl_fairseq.acl_grad import AclGradSettings
from acl_fairseq.tasks.acl_sentence_prediction import (
    AclSentencePredictionConfig,
    AclSentencePredictionTask,
)

from fairseq_helpers import TINY_MULTI_EXIT, fails_with, fairseq_setup, train_args

TRAIN = train_args(criterion="acl_embed", batch_size=8, max_update=2, no_epoch_checkpoints=True)
MULTI_EXIT = train_args(TINY_MULTI_EXIT, batch_size=8, max_update=2)


def set_up(data, *args: str):
    """fairseq-train's set-up of ``args``: returns (task, model, criterion)."""
    cfg, task, model = fairseq_setup([data, "--num-classes", "2", *args])
    return task, model, task.build_criterion(cfg.criterion)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--criterion", "ce_scl", "--regression-target"],
            "--criterion ce_scl is for classification: a contrastive loss needs class labels, "
            "but --regression-target is set",
        ),
        (["--criterion", "ce_scl", "--temperature", "-0.1"], "--temperature must be > 0"),
        (["--criterion", "acl_embed", "--temperature", "0"], "--temperature must be > 0"),
        (["--criterion", "ce_scl", "--acl-grad-threshold", "-1"], "--acl-grad-threshold is an"),
        (["--criterion", "acl_embed", "--acl-grad-threshold", "200"], "angle in degrees in"),
        (["--criterion", "ce_scl", "--contrastive-lambda", "nan"], "--contrastive-lambda must"),
        (["--criterion", "acl_embed", "--contrastive-lambda", "-1"], "finite number >= 0"),
        (
            ["--criterion", "acl_embed", "--task", "sentence_prediction"],
            "--criterion acl_embed with ACL-Grad needs --task acl_sentence_prediction (its "
            "train_step compares the gradients); got --task sentence_prediction",
        ),
        (
            ["--criterion", "ce_scl", "--acl-grad", "--task", "sentence_prediction"],
            "--criterion ce_scl with ACL-Grad needs --task acl_sentence_prediction",
        ),
    ],
)
def test_bad_single_exit_criterion_settings(sentiment_data, args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        set_up(sentiment_data, *TRAIN, *args)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--regression-target"],
            "--criterion acl_cross_layer is for classification: a contrastive loss needs class "
            "labels, but --regression-target is set",
        ),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--cross-layer-lambda", "-1"], "--cross-layer-lambda must be a finite number >= 0"),
        (["--acl-grad-threshold", "181"], "--acl-grad-threshold is an angle in degrees"),
        (
            ["--task", "sentence_prediction"],
            "--criterion acl_cross_layer with ACL-Grad needs --task acl_sentence_prediction",
        ),
        (
            ["--exit-layers", "2,4"],
            "--exit-layers: layer 4 is outside 1..3; the model has 4 layers",
        ),
        (
            ["--exit-layers", "none"],
            "needs shallow exits, but the model has only the final exit (--exit-layers none)",
        ),
    ],
)
def test_bad_cross_layer_settings(sentiment_data, args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        set_up(sentiment_data, *MULTI_EXIT, "--criterion", "acl_cross_layer", *args)


@pytest.mark.parametrize("criterion", ["multi_exit_ce", "acl_cross_layer"])
@pytest.mark.parametrize(
    "args,message",
    [
        (["--self-distill-weight", "-0.5"], "--self-distill-weight must be a finite number >= 0"),
        (["--self-distill-weight", "inf"], "--self-distill-weight must be a finite number >= 0"),
        (["--self-distill-temperature", "0"], "--self-distill-temperature must be a finite"),
        (["--self-distill-temperature", "-2"], "--self-distill-temperature must be a finite"),
    ],
)
def test_bad_self_distillation_settings(sentiment_data, criterion, args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        set_up(sentiment_data, *MULTI_EXIT, "--criterion", criterion, *args)


@pytest.mark.parametrize(
    "criterion,flags,on",
    [
        ("acl_embed", [], True),
        ("acl_embed", ["--no-acl-grad"], False),
        ("acl_embed", ["--acl-grad"], True),
        ("ce_scl", [], False),
        ("ce_scl", ["--acl-grad"], True),
        ("ce_scl", ["--no-acl-grad"], False),
        ("acl_cross_layer", [], True),
        ("acl_cross_layer", ["--no-acl-grad"], False),
        ("acl_cross_layer", ["--acl-grad", "--no-acl-grad"], False),  # the last one wins
    ],
)
def test_acl_grad_switch_has_one_polarity_for_every_criterion(sentiment_data, criterion, flags, on):
    model_args = MULTI_EXIT if criterion == "acl_cross_layer" else TRAIN
    _, _, crit = set_up(
        sentiment_data, *model_args, "--criterion", criterion, "--acl-grad-threshold", "45", *flags
    )
    assert crit.acl_grad == (AclGradSettings(45.0, "all") if on else None)


def test_acl_grad_switch_in_a_hydra_config():
    from fairseq.dataclass.utils import merge_with_parent

    from acl_fairseq.criterions.acl_embed import AclEmbedConfig
    from acl_fairseq.criterions.ce_scl import CeSclConfig

    assert (
        merge_with_parent(AclEmbedConfig(), OmegaConf.create({"acl_grad": False})).acl_grad is False
    )
    assert merge_with_parent(CeSclConfig(), OmegaConf.create({})).acl_grad is False
    with pytest.raises(Exception, match="no_acl_grad"):  # the old key is not silently ignored
        merge_with_parent(AclEmbedConfig(), OmegaConf.create({"no_acl_grad": True}))


@pytest.mark.parametrize(
    "config,message",
    [
        ({"temperature": 0.0}, "--temperature must be > 0"),
        ({"temperature": float("inf")}, "--temperature must be > 0"),
        ({"contrastive_lambda": -0.5}, "--contrastive-lambda must be a finite number >= 0"),
        ({"acl_grad_threshold": -1.0}, "--acl-grad-threshold is an angle in degrees"),
        ({"cross_layer_lambda": float("nan")}, "--cross-layer-lambda must be"),
        ({"self_distill_weight": -1.0}, "--self-distill-weight must be a finite number >= 0"),
        ({"self_distill_temperature": 0.0}, "--self-distill-temperature must be a finite"),
    ],
)
def test_the_criterion_constructors_check_their_config(config, message):
    """The same checks without fairseq's parser (e.g. a config built in Python)."""
    from acl_fairseq.criterions.acl_cross_layer import AclCrossLayerConfig, AclCrossLayerCriterion
    from acl_fairseq.criterions.acl_embed import AclEmbedConfig, AclEmbedCriterion

    d = Dictionary()
    task = AclSentencePredictionTask(AclSentencePredictionConfig(data="-", num_classes=2), d, d)
    builds = [(AclCrossLayerConfig, AclCrossLayerCriterion)]
    if not {"cross_layer_lambda", "self_distill_weight", "self_distill_temperature"} & set(config):
        builds.append((AclEmbedConfig, AclEmbedCriterion))
    for config_class, criterion_class in builds:
        with pytest.raises(ValueError, match=re.escape(message)):
            criterion_class(config_class(**config), task)
    criterion = AclEmbedCriterion(AclEmbedConfig(acl_grad_scope="head"), task)
    assert criterion.acl_grad == AclGradSettings(90.0, "head")


@pytest.mark.slow
@pytest.mark.parametrize("criterion", ["acl_cross_layer", "multi_exit_ce"])
def test_multi_exit_criterion_on_a_model_without_exits(sentiment_data, tmp_path, criterion):
    out = fails_with(
        sentiment_data,
        tmp_path,
        *TRAIN,
        "--criterion",
        criterion,
        message=f"--criterion {criterion} needs a multi-exit model (--arch "
        "multi_exit_roberta, multi_exit_roberta_base, ...); this model has no exits",
    )
    assert "begin training epoch" not in out  # at set-up, one line without a traceback
    last = out.rstrip().splitlines()[-1]
    assert last.startswith(f"fairseq-train: error: --criterion {criterion}")
    assert "Traceback" not in out


@pytest.mark.parametrize("batch_size", [1, 2])
def test_ce_scl_with_a_batch_too_small_for_scl_is_refused(sentiment_data, batch_size):
    """A batch of 1 has no pair; in a batch of 2 SCL is 0 (the positive is the whole
    denominator): plain CE, without a word, on fairseq's code."""
    args = train_args(criterion="ce_scl", batch_size=batch_size, max_update=2)
    with pytest.raises(ValueError) as info:
        set_up(sentiment_data, *args)
    assert str(info.value) == (
        f"--criterion ce_scl with --batch-size {batch_size}: SCL needs, in one batch of a "
        "worker, an example with another of its label and a third to compare them with, which "
        f"a batch of {batch_size} never has, so every update would be plain CE (no contrastive "
        "term, no ACL-Grad angle). Use --criterion acl_embed (its label embeddings give every "
        "example a positive, even at --batch-size 1) or --batch-size 3 or more (several times "
        "--num-classes)"
    )


def test_scl_at_batch_size_2_is_zero():
    """Why 2 is refused: the loss and its gradient are 0 whatever the features."""
    import torch

    from acl_fairseq.criterions.losses import supervised_contrastive_loss

    features = torch.randn(2, 8, requires_grad=True)
    for labels in ([0, 0], [0, 1]):
        loss = supervised_contrastive_loss(features, torch.tensor(labels), 0.3)
        assert float(loss) == 0.0
        (grad,) = torch.autograd.grad(loss, features, allow_unused=True)
        assert grad is None or not grad.any()


def test_ce_scl_with_few_positives_per_batch_is_warned_about(sentiment_data, caplog):
    with caplog.at_level("WARNING", logger="acl_fairseq.criterions.ce_scl"):
        set_up(sentiment_data, *train_args(criterion="ce_scl", batch_size=3, max_update=2))
        assert not caplog.records  # 2 classes: a quarter of the examples alone
        set_up(sentiment_data, *train_args(criterion="acl_embed", batch_size=1, max_update=2))
        assert not caplog.records  # ACL-Embed: every example has its label embedding
    _, _, criterion = set_up(
        sentiment_data, *train_args(criterion="ce_scl", batch_size=3, max_update=2)
    )
    with caplog.at_level("WARNING", logger="acl_fairseq.criterions.ce_scl"):
        criterion.check_batch_size(3, 5)
    assert (
        "--criterion ce_scl with --batch-size 3 and 5 classes: with balanced labels about 64% "
        "of the examples have no other example of their label in their batch" in caplog.text
    )


def test_ce_scl_batch_size_is_not_checked_when_loading_a_checkpoint(sentiment_data):
    """fairseq-validate builds the criterion with its own --batch-size (1 is fine there)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parsed = options.parse_args_and_arch(
        options.get_training_parser(),
        [str(sentiment_data), "--num-classes", "2",
         *train_args(criterion="ce_scl", batch_size=1, max_update=2)],
    )  # fmt: skip
    cfg = convert_namespace_to_omegaconf(parsed)
    task = tasks.setup_task(cfg.task, from_checkpoint=True)
    model = task.build_model(cfg.model)
    assert model is not None and task.build_criterion(cfg.criterion) is not None


@pytest.mark.parametrize(
    "where,message",
    [
        ("missing_dir/a.tsv", "the folder {tmp}/missing_dir does not exist; create it first "
         "(mkdir -p {tmp}/missing_dir) or give a file in an existing folder"),
        ("", "is a folder: give a file for the angle log, e.g. {tmp}/angles.tsv"),
    ],
)  # fmt: skip
def test_an_angle_log_that_cannot_be_written_stops_the_set_up(
    sentiment_data, tmp_path, where, message
):
    path = str(tmp_path / where) if where else str(tmp_path)
    with pytest.raises(OSError) as info:
        set_up(sentiment_data, *TRAIN, "--acl-grad-log", path)
    assert str(info.value) == f"--acl-grad-log {path}" + (": " if where else " ") + (
        message.format(tmp=tmp_path)
    )
    set_up(sentiment_data, *TRAIN, "--acl-grad-log", str(tmp_path / "angles.{rank}.tsv"))
