"""The data a checkpoint was trained on, recorded in it and compared with the folder it is used
with (``acl_fairseq.checkpoint.training_data``): no prediction is named by another folder's
labels, encoded with another vocabulary, or read as single sentences from a pair model, without
an error naming both folders; the same labels in another order are named by the checkpoint's
order; a checkpoint without the record is used with a note; the data folder is found wherever
the command runs."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from fork_server import ForkServer

from acl_fairseq.checkpoint.training_data import (
    KEY,
    DataMismatch,
    check_folder,
    describe_folder,
)
from acl_fairseq.cli import predict as predict
from acl_fairseq.inference.loader import CheckpointError, load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD

from fairseq_helpers import (
    TINY_MULTI_EXIT,
    fairseq_train,
    fairseq_validate,
    json_records,
    prepare_tsv_task,
    train_args,
    train_command,
)

MULTI_EXIT = train_args(
    TINY_MULTI_EXIT, criterion="multi_exit_ce", max_update=6, no_epoch_checkpoints=True
)
TEXT = "Good1 good2 w3.\nbad1 bad2 w4\n"


def folder(root: Path, labels: str, pair: bool = False, dictionary: str = "a 5\nb 3\n") -> Path:
    """A folder with just the dictionaries (``labels``: the lines of label/dict.txt)."""
    for key in ("input0", "label") + (("input1",) if pair else ()):
        (root / key).mkdir(parents=True)
    (root / "input0" / "dict.txt").write_text(dictionary)
    (root / "label" / "dict.txt").write_text(labels)
    return root


# ----------------------------------------------------------------------- the comparison
def test_describe_folder_labels_in_class_order_and_the_encoding(tmp_path):
    data = folder(tmp_path / "d", "pos 9\nneg 7\nmadeupword0000 0\n")
    found = describe_folder(data)
    assert found["labels"] == ["pos", "neg"] and found["num_inputs"] == 1
    assert found["data"] == str(data.resolve()) and found["tokenizer"] is None
    counts_only = folder(tmp_path / "e", "pos 1\nneg 1\n", dictionary="a 1\nb 1\n")
    assert describe_folder(counts_only)["dictionary"] == found["dictionary"]  # ids, not counts
    other = folder(tmp_path / "f", "pos 1\nneg 1\n", dictionary="b 5\na 3\n")
    assert describe_folder(other)["dictionary"] != found["dictionary"]


def test_check_folder_errors_name_both_folders(tmp_path):
    trained = describe_folder(folder(tmp_path / "trained", "pos 9\nneg 7\n"))
    ckpt = "run/checkpoint_best.pt"

    def fails(other: dict) -> str:
        with pytest.raises(DataMismatch) as info:
            check_folder(trained, other, ckpt)
        return str(info.value)

    renamed = describe_folder(folder(tmp_path / "glue", "1 9\n0 7\n"))
    assert fails(renamed) == (
        f"--data {renamed['data']} lists the labels 1, 0, but {ckpt} was trained on "
        f"{trained['data']}, whose labels are pos, neg: its predictions would be named "
        "wrongly. Give the prepared folder it was trained on"
    )
    three = describe_folder(folder(tmp_path / "three", "pos 9\nneg 7\nmeh 1\n"))
    assert "lists the labels pos, neg, meh, but" in fails(three)
    pairs = describe_folder(folder(tmp_path / "pairs", "pos 9\nneg 7\n", pair=True))
    assert fails(pairs).startswith(
        f"--data {pairs['data']} holds sentence pairs, but {ckpt} was trained on "
        f"{trained['data']}, which holds single sentences"
    )
    vocab = describe_folder(folder(tmp_path / "v", "pos 9\nneg 7\n", dictionary="x 1\n"))
    assert "has another input dictionary (input0/dict.txt) than the one" in fails(vocab)
    # the same labels in another order: the checkpoint's order names the classes
    swapped = describe_folder(folder(tmp_path / "swapped", "neg 9\npos 7\n"))
    found = check_folder(trained, swapped, ckpt)
    assert found.labels == ["pos", "neg"]
    assert (
        "lists the labels in another order (neg, pos) than the checkpoint (pos, neg)"
        in (found.notes[0])
    )
    assert check_folder(trained, trained, ckpt) == (["pos", "neg"], [])
    # no record (an older checkpoint): the folder's labels, with a note; the class count
    found = check_folder(None, swapped, ckpt, num_classes=2)
    assert found.labels == ["neg", "pos"] and "does not record the data" in found.notes[0]
    with pytest.raises(DataMismatch, match="lists 3 labels .* but .* classifies into 2"):
        check_folder(None, three, ckpt, num_classes=2)


def test_predict_names_a_raw_or_missing_folder_before_loading(tmp_path):
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"")  # never read: the folder is checked first
    (tmp_path / "glue" / "SST-2").mkdir(parents=True)
    (tmp_path / "glue" / "SST-2" / "train.tsv").write_text("sentence\tlabel\n")
    out, err = io.StringIO(), io.StringIO()
    code = predict.main([str(ckpt), "--data", str(tmp_path / "glue")], io.StringIO("x"), out, err)
    assert code == 2
    assert err.getvalue().startswith(
        f"acl-fairseq-predict: error: --data {tmp_path / 'glue'} holds raw files (SST-2/train.tsv)"
        ", not binarized data: give the folder acl-fairseq-prepare wrote"
    )


# ----------------------------------------------------------------------- trained checkpoints
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("recorded")
    data, rows = prepare_tsv_task(root)
    pair_data, _ = prepare_tsv_task(root / "pair", pair=True)
    fairseq_train(data, root / "multi", *MULTI_EXIT)
    return {
        "root": root,
        "data": data,
        "pair": pair_data,
        "ckpt": root / "multi/checkpoint_last.pt",
    }


def run_predict(*argv, stdin: str = TEXT, cwd: Path | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        code = predict.main([str(a) for a in argv], io.StringIO(stdin), out, err)
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def relabelled(trained: dict, tmp_path: Path, labels: str) -> Path:
    """A copy of the training folder with another label/dict.txt."""
    copy = tmp_path / "copy-bin"
    shutil.copytree(trained["data"], copy)
    (copy / "label" / "dict.txt").write_text(labels)
    return copy


@pytest.mark.slow
def test_the_checkpoint_records_its_data_and_fairseq_still_loads_it(trained):
    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=False)
    record = state["task_state"][KEY]
    assert record == describe_folder(trained["data"])
    assert record["labels"] == ["pos", "neg"] or record["labels"] == ["neg", "pos"]
    assert record["task"] == "sst" and record["tokenizer"] and record["num_inputs"] == 1
    for task in ("acl_sentence_prediction", "sentence_prediction"):  # fairseq's own task too
        out = fairseq_validate(
            trained["data"], trained["ckpt"], "--task", task, "--batch-size", "8",
            "--criterion", "sentence_prediction",
        )  # fmt: skip
        assert [r for r in json_records(out) if "valid_accuracy" in r], out[-2000:]


@pytest.mark.slow
def test_predict_refuses_a_folder_of_other_labels(trained, tmp_path):
    """The issue's case: a folder of the same class count whose labels are others (0/1)."""
    other = relabelled(trained, tmp_path, "1 82\n0 78\n")
    code, out, err = run_predict(trained["ckpt"], "--data", other)
    assert code == 2 and out == ""
    labels = ", ".join(describe_folder(trained["data"])["labels"])
    assert err == (
        f"acl-fairseq-predict: error: --data {other} lists the labels 1, 0, but "
        f"{trained['ckpt']} was trained on {trained['data']}, whose labels are {labels}: its "
        "predictions would be named wrongly. Give the prepared folder it was trained on\n"
    )


@pytest.mark.slow
def test_predict_with_three_labels_names_the_folder_not_a_training_flag(trained, tmp_path):
    three = relabelled(trained, tmp_path, "pos 82\nneg 78\nmeh 3\n")
    code, _, err = run_predict(trained["ckpt"], "--data", three)
    assert code == 2 and f"--data {three} lists the labels pos, neg, meh, but" in err
    assert "--num-classes" not in err


@pytest.mark.slow
def test_predict_with_a_pair_folder_on_a_single_sentence_model(trained):
    code, _, err = run_predict(trained["ckpt"], "--data", trained["pair"])
    assert code == 2
    assert err.startswith(
        f"acl-fairseq-predict: error: --data {trained['pair']} holds sentence pairs, but "
        f"{trained['ckpt']} was trained on {trained['data']}, which holds single sentences"
    )


@pytest.mark.slow
def test_labels_in_another_order_are_named_by_the_checkpoint(trained, tmp_path):
    own = describe_folder(trained["data"])["labels"]
    counts = {"pos": 82, "neg": 78}
    swapped = relabelled(trained, tmp_path, "".join(f"{x} {counts[x]}\n" for x in own[::-1]))
    code, expected, _ = run_predict(trained["ckpt"])
    assert code == 0
    code, out, err = run_predict(trained["ckpt"], "--data", swapped)
    assert code == 0 and out == expected  # the same names, not swapped
    assert err.startswith(
        f"acl-fairseq-predict: note: {swapped}/label/dict.txt lists the labels in another order"
    )
    # where the folder's targets are used (accuracy), another order is refused
    with pytest.raises(CheckpointError, match="lists the labels of .* in another order"):
        load_for_inference(trained["ckpt"], swapped)
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

    ckpt = trained["ckpt"]
    hub = MultiExitRobertaModel.from_pretrained(str(ckpt.parent), ckpt.name, str(swapped))
    assert hub.label_names == own


@pytest.mark.slow
def test_a_checkpoint_without_the_record_is_used_with_a_note(trained, tmp_path):
    state = torch.load(trained["ckpt"], map_location="cpu", weights_only=False)
    del state["task_state"][KEY]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    code, out, err = run_predict(old)
    assert code == 0 and len(out.splitlines()) == 2
    assert err.startswith(f"acl-fairseq-predict: note: {old} does not record the data")


@pytest.mark.slow
def test_the_data_folder_is_found_wherever_predict_runs(trained, tmp_path):
    """Trained with a relative data path, predicted from another folder without --data."""
    work = tmp_path / "work"
    shutil.copytree(trained["data"], work / "sst-bin")
    cmd = train_command(Path("sst-bin"), work / "rel", *MULTI_EXIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(ForkServer.served(cmd), cwd=work, env=env, check=True, capture_output=True)
    ckpt = work / "rel" / "checkpoint_last.pt"
    assert torch.load(ckpt, weights_only=False)["cfg"]["task"]["data"] == "sst-bin"
    code, out, err = run_predict(ckpt, cwd=tmp_path)
    assert code == 0 and len(out.splitlines()) == 2, err
    shutil.move(work / "sst-bin", tmp_path / "moved-bin")  # gone: --data names the new place
    code, _, err = run_predict(ckpt, cwd=tmp_path)
    assert code == 2 and f"trained on data folder '{work / 'sst-bin'}' or 'sst-bin'" in err
    assert "give the prepared folder with --data" in err
    assert run_predict(ckpt, "--data", tmp_path / "moved-bin", cwd=tmp_path)[0] == 0


@pytest.mark.slow
def test_hub_names_labels_and_refuses_other_folders(trained, tmp_path):
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

    ckpt = trained["ckpt"]
    hub = MultiExitRobertaModel.from_pretrained(str(ckpt.parent), ckpt.name, str(trained["data"]))
    assert hub.label_names == describe_folder(trained["data"])["labels"]
    tokens = hub.encode("Good1 good2 w3.")
    result = hub.predict_early_exit(DEFAULT_HEAD, tokens, "entropy:0.5")
    assert result.labels == [hub.label_names[int(result.predictions[0])]]
    _, out, _ = run_predict(ckpt, "--policy", "entropy:0.5", stdin="Good1 good2 w3.\n")
    assert out.split("\t")[0] == result.labels[0]
    # a single-sentence model: a pair is refused on every path of encode
    for kwargs in ({}, {"no_separator": True}):
        with pytest.raises(ValueError, match="hub.encode: 2 text.* single-sentence model"):
            hub.encode("first", "second", **kwargs)
    other = relabelled(trained, tmp_path, "1 82\n0 78\n")
    with pytest.raises(ValueError, match=f"data_name_or_path {other} lists the labels 1, 0"):
        MultiExitRobertaModel.from_pretrained(str(ckpt.parent), ckpt.name, str(other))
    three = tmp_path / "three-bin"
    shutil.copytree(trained["data"], three)
    (three / "label" / "dict.txt").write_text("pos 9\nneg 8\nmeh 1\n")
    with pytest.raises(ValueError, match=f"{three} lists the labels pos, neg, meh, but {ckpt} "):
        MultiExitRobertaModel.from_pretrained(str(ckpt.parent), ckpt.name, str(three))


@pytest.mark.slow
def test_hub_with_another_vocabulary_names_the_folder_not_a_training_flag(trained, tmp_path):
    """A folder binarized with another dictionary: the hub names the folder the checkpoint
    was trained on (with the record) or the folder given (without), never --restore-file."""
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

    ckpt = trained["ckpt"]
    vocab = tmp_path / "vocab-bin"
    shutil.copytree(trained["data"], vocab)
    with open(vocab / "input0" / "dict.txt", "a") as f:
        f.write("newword1 1\nnewword2 1\n")
    with pytest.raises(ValueError) as info:
        MultiExitRobertaModel.from_pretrained(str(ckpt.parent), ckpt.name, str(vocab))
    assert str(info.value) == (
        f"data_name_or_path {vocab} has another input dictionary (input0/dict.txt) than the "
        f"one {ckpt} was trained with (on {trained['data']}): new text would be encoded into "
        "other ids. Give the prepared folder it was trained on, or one prepared with the same "
        "tokenizer and --srcdict"
    )
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    del state["task_state"][KEY]
    old = tmp_path / "old" / "checkpoint.pt"
    old.parent.mkdir()
    torch.save(state, old)
    with pytest.raises(ValueError) as info:
        MultiExitRobertaModel.from_pretrained(str(old.parent), old.name, str(vocab))
    message = str(info.value)
    assert message.startswith(
        f"cannot use {old} with data_name_or_path {vocab}: its vocabulary has "
    ) and message.endswith(
        "That folder was binarized with another dictionary than the checkpoint's: give the "
        "prepared folder it was trained on"
    )
    assert "--restore-file" not in message


def test_fairseq_train_on_a_raw_glue_folder_names_the_preparation(tmp_path):
    from types import SimpleNamespace

    from acl_fairseq.tasks.input_checks import check_dictionaries

    (tmp_path / "SST-2").mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / "SST-2" / name).write_text("sentence\tlabel\n")
    with pytest.raises(FileNotFoundError) as info:
        check_dictionaries(SimpleNamespace(data=str(tmp_path), regression_target=False))
    assert str(info.value).startswith(
        f"{tmp_path} holds raw files (SST-2/dev.tsv, SST-2/train.tsv), not binarized data: "
        "prepare it first with acl-fairseq-prepare"
    )
    assert "prepare_glue.py" not in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="acl-fairseq-prepare writes this layout"):
        check_dictionaries(SimpleNamespace(data=str(tmp_path / "empty"), regression_target=False))
