"""A broken data folder fails fast through ``fairseq-train`` (``--task
acl_sentence_prediction``), at set-up or load time, with a message that names the flag or the
file and the fix: labels and their dictionary, missing or mismatched splits, over-long inputs.

The broken data directories are derived from the session's binarized dataset: files are
removed, copied, or re-binarized in-process from edited lines with the same dictionary (no
``fairseq-preprocess`` start-up per case).
"""

import re
import shutil
from types import SimpleNamespace

import pytest
from fairseq.data import Dictionary

from acl_fairseq.tasks.input_checks import check_lengths, check_split_files

from fairseq_helpers import (
    binarize,
    copy_data,
    fails_with,
    fairseq_train,
    preprocess,
    raw_lines,
    train_args,
    trained_updates,
    write_sentiment_split,
)

TRAIN = train_args(criterion="acl_embed", batch_size=8, max_update=2, no_epoch_checkpoints=True)


# ----------------------------------------------------------------------- set-up errors
@pytest.mark.slow
@pytest.mark.parametrize("criterion", ["sentence_prediction", "acl_embed"])
def test_wrong_num_classes(sentiment_data, tmp_path, criterion):
    """Checked at set-up for fairseq's own criterion too, before the first update."""
    out = fails_with(
        sentiment_data,
        tmp_path,
        *TRAIN,
        "--criterion",
        criterion,
        "--num-classes",
        "3",
        message=f"--num-classes 3 does not match {sentiment_data}/label/dict.txt, which lists "
        "2 labels (",
    )
    assert re.search(r"which lists 2 labels \((0, 1|1, 0)\); pass --num-classes 2", out)
    assert not trained_updates(out)


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


# ----------------------------------------------------------------------- unknown labels
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
    binarize(["a b"] * 5, words, data / "input0" / "valid")
    binarize(valid, labels, data / "label" / "valid")
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
    binarize(["pos", "neg", "pos", "pos", "neg"], labels, data / "label" / "valid")
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
@pytest.mark.parametrize("criterion", ["sentence_prediction", "acl_embed"])
def test_unknown_label_stops_at_load_time(unknown_label_data, tmp_path, criterion):
    data, raw = unknown_label_data
    out = fails_with(
        data,
        tmp_path,
        *TRAIN,
        "--criterion",
        criterion,
        message=f"fairseq-train: error: {data}/label/valid.bin: 1 of 32 labels are not in "
        f"{data}/label/dict.txt (binarized as <unk>): line 5 of {raw / 'valid.label'} "
        "(line 5: '2'). The dictionary lists ",
    )
    assert re.search(r"The dictionary lists (0, 1|1, 0)\. Fix the label if it is a typo", out)
    assert not trained_updates(out)
