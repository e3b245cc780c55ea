"""Bad input fails fast through ``fairseq-train``, with a message that names the flag or the
file and the fix.

The broken data directories are derived from the session's binarized dataset: files are
removed, copied, or re-binarized in-process from edited lines with the same dictionary (no
``fairseq-preprocess`` start-up per case). Criterion flags are checked at fairseq-train's
set-up run in-process (tests/test_e2e_single_exit.py checks that such an error reaches the
command line before training).
"""

import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from fairseq import options, tasks
from fairseq.data import Dictionary, indexed_dataset
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import OmegaConf

from acl_fairseq.acl_grad import AclGradSettings
from acl_fairseq.input_checks import check_checkpoint_fits, check_lengths
from acl_fairseq.tasks.acl_sentence_prediction import (
    AclSentencePredictionConfig,
    AclSentencePredictionTask,
)

from fairseq_helpers import TINY_MULTI_EXIT, fairseq_train, train_args

TRAIN = train_args(criterion="acl_embed", batch_size=8, max_update=2, no_epoch_checkpoints=True)
MULTI_EXIT = train_args(TINY_MULTI_EXIT, batch_size=8, max_update=2)


def fails_with(data, save_dir, *args, message: str) -> str:
    """Runs fairseq-train, expects it to fail, and returns its output, which must hold
    ``message`` (a plain string)."""
    with pytest.raises(AssertionError, match=r"command failed") as info:
        fairseq_train(data, save_dir, *args)
    out = str(info.value)
    assert re.search(re.escape(message), out), out[-3000:]
    return out


def copy_data(src, dst, keep=("input0", "label")):
    for key in keep:
        shutil.copytree(src / key, dst / key)
    return dst


def binarize(lines: list[str], dictionary: Dictionary, prefix) -> None:
    """Writes lines as fairseq-preprocess would (mmap, </s> appended), with a fixed dict."""
    builder = indexed_dataset.make_builder(f"{prefix}.bin", "mmap", vocab_size=len(dictionary))
    for line in lines:
        builder.add_item(dictionary.encode_line(line, add_if_not_exist=False, append_eos=True))
    builder.finalize(f"{prefix}.idx")


def raw_lines(data, key, split) -> list[str]:
    d = Dictionary.load(str(data / key / "dict.txt"))
    ds = indexed_dataset.make_dataset(str(data / key / split), impl="mmap")
    return [d.string(ds[i][:-1]) for i in range(len(ds))]


# ----------------------------------------------------------------------- set-up errors
@pytest.mark.slow
def test_wrong_num_classes(sentiment_data, tmp_path):
    fails_with(
        sentiment_data,
        tmp_path,
        *TRAIN,
        "--num-classes",
        "3",
        message=f"--num-classes 3 does not match {sentiment_data}/label/dict.txt, which lists "
        "2 labels (0, 1); pass --num-classes 2",
    )


@pytest.mark.slow
def test_missing_label_folder(sentiment_data, tmp_path):
    data = copy_data(sentiment_data, tmp_path / "data", keep=("input0",))
    fails_with(
        data,
        tmp_path,
        *TRAIN,
        message=f"{data}/label/dict.txt not found: --task acl_sentence_prediction reads "
        "DATA/input0/ (the inputs), DATA/label/ (the labels)",
    )


@pytest.mark.slow
def test_missing_label_split(sentiment_data, tmp_path):
    # fairseq alone trains, then fails at the first validation with KeyError: 'target'
    data = copy_data(sentiment_data, tmp_path / "data")
    for f in (data / "label").glob("valid.*"):
        f.unlink()
    fails_with(
        data,
        tmp_path,
        *TRAIN,
        message=f"{data}/label/valid.bin/.idx not found: binarize the labels of split 'valid'",
    )


@pytest.mark.slow
def test_pair_task_with_input1_missing_for_one_split(sentiment_data, tmp_path):
    # A pair dataset (input1 = a copy of input0) whose valid split lacks input1: fairseq
    # alone would validate on single sentences without a word.
    data = copy_data(sentiment_data, tmp_path / "data")
    shutil.copytree(sentiment_data / "input0", data / "input1")
    for f in (data / "input1").glob("valid.*"):
        f.unlink()
    fails_with(
        data,
        tmp_path,
        *TRAIN,
        "--separator-token",
        "2",
        message=f"{data}/input1/valid.bin/.idx not found, but {data}/input1/ holds the second "
        "sentences of other splits (a sentence-pair task): split 'valid' would be read as "
        "single sentences",
    )


@pytest.mark.slow
def test_files_with_different_numbers_of_examples(sentiment_data, tmp_path):
    data = copy_data(sentiment_data, tmp_path / "data")
    (data / "input1").mkdir()
    shutil.copy(data / "input0" / "dict.txt", data / "input1" / "dict.txt")
    for ext in ("bin", "idx"):  # 128 second sentences for 384 examples
        shutil.copy(data / "input0" / f"valid.{ext}", data / "input1" / f"train.{ext}")
        shutil.copy(data / "input0" / f"valid.{ext}", data / "input1" / f"valid.{ext}")
    fails_with(
        data,
        tmp_path,
        *TRAIN,
        "--separator-token",
        "2",
        message=f"split 'train' has different numbers of examples: 384 in {data}/input0/train, "
        f"128 in {data}/input1/train, 384 in {data}/label/train",
    )


@pytest.mark.slow
def test_empty_label_line(sentiment_data, tmp_path):
    # fairseq alone fails on the first batch holding it: "stack expects each tensor to be
    # equal size"
    data = copy_data(sentiment_data, tmp_path / "data")
    labels = raw_lines(data, "label", "train")
    labels[5] = ""
    labels[9] = "0 1"
    binarize(labels, Dictionary.load(str(data / "label" / "dict.txt")), data / "label" / "train")
    fails_with(
        data,
        tmp_path,
        *TRAIN,
        message=f"{data}/label/train: 1 empty (line 6) and 1 with more than one token (line 10) "
        "of 384 label lines; every line of the raw train.label must hold exactly one label",
    )


@pytest.fixture
def long_and_empty_inputs(sentiment_data, tmp_path):
    """Train inputs with two lines over --max-positions 64 and one empty line."""
    data = copy_data(sentiment_data, tmp_path / "data")
    lines = raw_lines(data, "input0", "train")
    lines[3] = " ".join(["w1"] * 100)
    lines[7] = " ".join(["w2"] * 70)
    lines[10] = ""
    binarize(lines, Dictionary.load(str(data / "input0" / "dict.txt")), data / "input0" / "train")
    return data


@pytest.mark.slow
def test_over_long_inputs_fail_at_load_time(long_and_empty_inputs, tmp_path):
    # fairseq alone skips them in training with a warning (and would stop at validation)
    fails_with(
        long_and_empty_inputs,
        tmp_path,
        *TRAIN,
        message="split 'train': 2 of 384 examples are longer than --max-positions 64 tokens "
        "(the longest has 102, counting <s> and separators); pass --shorten-method truncate",
    )


@pytest.mark.slow
def test_truncate_trains_on_long_and_empty_inputs(long_and_empty_inputs, tmp_path):
    data = long_and_empty_inputs
    out = fairseq_train(data, tmp_path, *TRAIN, "--shorten-method", "truncate")
    # the empty line is only a warning: it is a valid example "<s></s>"
    assert f"split 'train': 1 of 384 lines of {data}/input0 are empty (line 11)" in out
    assert "done training" in out


def test_shorten_split_list_that_leaves_a_split_out_is_named():
    cfg = SimpleNamespace(
        max_positions=8, shorten_method="truncate", shorten_data_split_list="train"
    )
    check_lengths(cfg, "valid", [[3, 8, 2]])
    with pytest.raises(ValueError, match=r"--shorten-method truncate is not applied to 'valid'"):
        check_lengths(cfg, "valid", [[3, 9, 2]])


# ------------------------------------------------------------------------- criterions
# Flag checks run where fairseq-train runs them, in-process: the command line is parsed by
# fairseq's parser, and the task, model and criterion are built from it (set-up, no training).
def set_up(data, *args: str):
    """fairseq-train's set-up of ``args``: returns (task, model, criterion)."""
    parsed = options.parse_args_and_arch(
        options.get_training_parser(), [str(data), "--num-classes", "2", *args]
    )
    cfg = convert_namespace_to_omegaconf(parsed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
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
    ],
)
def test_the_criterion_constructors_check_their_config(config, message):
    """The same checks without fairseq's parser (e.g. a config built in Python)."""
    from acl_fairseq.criterions.acl_cross_layer import AclCrossLayerConfig, AclCrossLayerCriterion
    from acl_fairseq.criterions.acl_embed import AclEmbedConfig, AclEmbedCriterion

    d = Dictionary()
    task = AclSentencePredictionTask(AclSentencePredictionConfig(data="-", num_classes=2), d, d)
    builds = [(AclCrossLayerConfig, AclCrossLayerCriterion)]
    if "cross_layer_lambda" not in config:
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
    assert "build_criterion" in out and "begin training epoch" not in out  # at set-up


# ------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def tiny_checkpoint(sentiment_data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("tiny_checkpoint")
    fairseq_train(sentiment_data, save_dir, *TRAIN, "--max-update", "1", "--disable-validation")
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
        *TRAIN,
        "--restore-file",
        str(tiny_checkpoint),
        *RESTORE,
        message="cannot load the checkpoint (--restore-file, --finetune-from-model or --path): "
        "its vocabulary has 73 entries, this model's 78 (from "
        f"{data}/input0/dict.txt). The data was binarized with another dictionary than the "
        "checkpoint's: binarize it again with fairseq-preprocess --srcdict",
    )
    assert f"Cannot load model parameters from checkpoint {tiny_checkpoint}" in out


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
        *TRAIN,
        "--restore-file",
        str(tiny_checkpoint),
        *RESTORE,
        *args,
        message="cannot load the checkpoint (--restore-file, --finetune-from-model or --path): "
        + message,
    )
    assert f"Cannot load model parameters from checkpoint {tiny_checkpoint}" in out


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
