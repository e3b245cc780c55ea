"""acl-fairseq-predict (and the hub interface): raw text in, predictions out, on checkpoints
trained by ``fairseq-train``. The encoding itself is tested in test_text_encoder.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from acl_fairseq.cli import predict as predict
from acl_fairseq.data.text_encoder import ExampleEncoder
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD

from fairseq_helpers import NEUTRAL, fairseq_train
from predict_helpers import (  # noqa: F401  (trained, timing_guard: fixtures)
    MULTI_EXIT,
    PLAIN,
    STAGE1,
    _model_predictions,
    run_predict,
    timing_guard,
    trained,
)

pytestmark = pytest.mark.slow  # every test trains a model (the module's fixture)


@pytest.mark.parametrize("policy", [None, "entropy:0.68", "patience:0"])
def test_predictions_equal_the_models_on_the_binarized_split(trained, policy) -> None:
    text = "".join(f"{row[0]}\n" for row in trained["rows"])
    flags = ["--policy", policy] if policy else []
    code, out, err = run_predict(trained["ckpt"], "--batch-size", "5", *flags, stdin=text)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == len(trained["rows"])
    assert sorted(f"{a}\t{c}" for a, _, c in (x.split("\t") for x in lines)) == sorted(
        _model_predictions(trained, policy)
    )
    layers = [int(line.split("\t")[2]) for line in lines]
    probs = [float(line.split("\t")[1]) for line in lines]
    assert all(0.5 <= p <= 1.0 for p in probs)
    assert set(layers) <= {1, 2, 3, 4}
    if policy in (None, "patience:0"):  # full depth; patience 0 leaves at the first exit
        assert set(layers) == ({4} if policy is None else {1})
    mean = sum(layers) / len(layers)
    assert f"{len(lines)} sentences, " in err
    assert "sentences/s (timed after one warm-up forward)" in err
    assert f"mean exit layer {mean:.2f} of 4" in err
    # input order: one sentence alone gives the line it got in the batch (same prediction)
    for i in (0, 17, len(lines) - 1):
        code, single, _ = run_predict(trained["ckpt"], *flags, stdin=trained["rows"][i][0])
        assert single.strip().split("\t")[::2] == lines[i].split("\t")[::2], i


def test_tsv_file_header_and_errors(trained, tmp_path: Path) -> None:
    ckpt = trained["ckpt"]
    tsv = tmp_path / "in.tsv"
    tsv.write_text("id\ttext\n" + "".join(f"{i}\t{r[0]}\n" for i, r in enumerate(trained["rows"])))
    code, out, err = run_predict("--path", ckpt, "--input", tsv, "--text-columns", "2", "--header")
    assert code == 0, err
    _, plain, _ = run_predict(ckpt, stdin="".join(f"{r[0]}\n" for r in trained["rows"]))
    assert out == plain

    code, _, err = run_predict(ckpt, "--input", tsv, "--text-columns", "2,1", "--header")
    assert code == 2 and "line 2: 2 text column(s) for a single-sentence model" in err
    code, _, err = run_predict(ckpt, "--input", tsv, "--text-columns", "3")
    assert code == 2
    assert "line 1: 2 tab-separated column(s), but --text-columns asks for column 3" in err
    code, _, err = run_predict(ckpt, "--policy", "maxprob:90", stdin="x")
    assert code == 2 and "--policy: bad exit policy 'maxprob:90'" in err
    code, _, err = run_predict(ckpt, "--data", tmp_path / "nowhere", stdin="x")
    assert code == 2 and "--data" in err and "no such folder" in err
    code, _, err = run_predict(ckpt, "--head", "other", stdin="x")
    assert code == 2 and "--head other: not in" in err
    long_text = "x\n" + " ".join(NEUTRAL * 3) + "\n"
    code, _, err = run_predict(ckpt, stdin=long_text)
    assert code == 2 and "stdin line 2:" in err and "--shorten-method truncate" in err

    # the checkpoint's data folder moved: --data names the new place
    moved = tmp_path / "moved"
    shutil.copytree(trained["data"], moved)
    old = trained["data"].with_name("sst-bin.away")
    trained["data"].rename(old)
    try:
        code, _, err = run_predict(ckpt, stdin="x")
        assert code == 2
        assert "which does not exist here: give the prepared folder with --data" in err
        code, out, err = run_predict(ckpt, "--data", moved, stdin=trained["rows"][0][0])
        assert code == 0 and out.split("\t")[0] == plain.split("\t")[0]
    finally:
        old.rename(trained["data"])


def test_blank_and_cut_lines_are_said(trained, monkeypatch) -> None:
    """A blank line got a label; now it gets '-' on its output line and a note counts them.
    A line cut at the model's positions (a checkpoint trained with --shorten-method
    truncate, here its encoder as such a checkpoint makes it) was cut without a word."""
    ckpt, rows = trained["ckpt"], trained["rows"]
    text = f"{rows[0][0]}\n\n   \n{rows[1][0]}\n"
    code, out, err = run_predict(ckpt, stdin=text)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 4 and lines[1] == lines[2] == "-\t-\t-"
    _, alone, _ = run_predict(ckpt, stdin=f"{rows[0][0]}\n{rows[1][0]}\n")
    assert [lines[0], lines[3]] == alone.splitlines()
    assert (
        "acl-fairseq-predict: note: 2 blank input lines (lines 2, 3): not classified, '-' on "
        "their output lines" in err
    )
    assert "2 sentences," in err

    real = ExampleEncoder.from_task

    def truncating(*args, **kwargs):
        encoder = real(*args, **kwargs)
        encoder.truncate, encoder.max_positions = True, 12
        return encoder

    monkeypatch.setattr(ExampleEncoder, "from_task", truncating)
    long_text = " ".join(NEUTRAL[:30])
    code, out, err = run_predict(ckpt, stdin=f"w1\n{long_text}\nw2\n{long_text}\n")
    assert code == 0, err
    assert (
        "acl-fairseq-predict: note: 2 input lines (lines 2, 4) cut at the model's 12 positions "
        "(the checkpoint was trained with --shorten-method truncate)" in err
    ), err


def test_onnx_cache_flags_are_checked_before_loading(trained, tmp_path, monkeypatch) -> None:
    """--onnx-cache without the ONNX Runtime backend was ignored; a cache that cannot be made
    (under a file, in /proc) was a traceback after the model loaded."""
    from acl_fairseq.cli import predict as predict_cli

    ckpt = trained["ckpt"]
    code, _, err = run_predict(ckpt, "--onnx-cache", tmp_path / "c", "--backend", "fairseq",
                               stdin="x")  # fmt: skip
    assert code == 2 and err.endswith(
        f"acl-fairseq-predict: error: --onnx-cache {tmp_path / 'c'}: only the ONNX Runtime "
        "backend uses it, and this run is on --backend fairseq: add --backend onnxruntime, or "
        "drop --onnx-cache\n"
    ), err
    code, _, err = run_predict(ckpt, "--onnx-cache", tmp_path / "c", stdin="x")  # no saved policy
    assert code == 2 and "this run is on the fairseq backend: add --backend onnxruntime" in err
    (tmp_path / "file").write_text("")
    loads = []
    monkeypatch.setattr(predict_cli, "load_for_inference", lambda *a, **k: loads.append(a))
    for folder, why in ((tmp_path / "file" / "cache", "a file is in the way"),
                        ("/proc/acl_fairseq_cache", "no such file or directory")):  # fmt: skip
        code, _, err = run_predict(ckpt, "--backend", "onnxruntime", "--onnx-cache", folder,
                                   stdin="x")  # fmt: skip
        assert code == 2 and err == (
            f"acl-fairseq-predict: error: --onnx-cache {folder}: cannot create the folder of the "
            f"exported ONNX segments ({why}): give --onnx-cache a folder you may write to\n"
        )
    assert loads == []  # before the model was loaded


def test_a_stage1_checkpoint_refuses_a_policy(trained) -> None:
    """A multi-exit model without shallow exits (--exit-layers none, as stage 1 and the demo's
    CE run are): a policy would be ignored, so it is refused, by the command and the hub."""
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

    fairseq_train(trained["data"], trained["root"] / "stage1", *STAGE1)
    ckpt = trained["root"] / "stage1/checkpoint_last.pt"
    code, _, err = run_predict(ckpt, "--policy", "entropy:0.3", stdin="x")
    assert code == 2
    assert err == (
        f"acl-fairseq-predict: error: --policy entropy:0.3: {ckpt} holds a multi-exit model "
        "without shallow exits (trained with --exit-layers none, as stage 1 is), so only full "
        "depth is possible: drop --policy, or use a stage-2 checkpoint (a multi-exit criterion, "
        "--arch multi_exit_roberta*, whose exits were trained)\n"
    )
    code, out, err = run_predict(ckpt, stdin="Good1 good2 w3.\n")
    assert code == 0 and out.split("\t")[2] == "4\n"
    hub = MultiExitRobertaModel.from_pretrained(str(ckpt.parent), ckpt.name, str(trained["data"]))
    tokens = hub.encode("Good1 good2 w3.")
    with pytest.raises(ValueError, match="policy 'entropy:0.3' given, but the model has no "):
        hub.predict_early_exit(DEFAULT_HEAD, tokens, "entropy:0.3")
    assert hub.predict_early_exit(DEFAULT_HEAD, tokens).exit_layers.tolist() == [4]


def test_input_that_is_not_utf8(trained, tmp_path) -> None:
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("a fine film\nun film charmant, très réussi\n".encode("latin-1"))
    code, out, err = run_predict(trained["ckpt"], "--input", latin1)
    assert code == 2 and out == ""
    assert err == (
        f"acl-fairseq-predict: error: --input {latin1} line 2: not valid UTF-8 (at character "
        "21): the input must be UTF-8 text; convert it first, e.g. iconv -f latin1 -t utf-8 FILE\n"
    )
    # stdin as Python decodes undecodable bytes (surrogateescape): a lone surrogate
    code, _, err = run_predict(trained["ckpt"], stdin="good\nbad \udce9 bytes\n")
    assert code == 2 and "error: stdin line 2: not valid UTF-8 (at character 5)" in err


def test_single_exit_checkpoint_full_depth_only(trained) -> None:
    fairseq_train(trained["data"], trained["root"] / "plain", *PLAIN)
    ckpt = trained["root"] / "plain/checkpoint_last.pt"
    code, out, err = run_predict(ckpt, stdin="Good1 good2 w3.\nbad1 w4 w5\n")
    assert code == 0, err
    assert [line.split("\t")[2] for line in out.splitlines()] == ["2", "2"]
    code, _, err = run_predict(ckpt, "--policy", "entropy:0.3", stdin="x")
    assert code == 2 and "one exit, so only full depth is possible: drop --policy" in err


def test_hub_encodes_raw_text_like_the_command(trained) -> None:
    """from_pretrained without bpe= gets the recorded tokenizer: same ids and predictions."""
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

    ckpt = trained["ckpt"]
    hub = MultiExitRobertaModel.from_pretrained(
        str(ckpt.parent), ckpt.name, data_name_or_path=str(trained["data"])
    )
    task = load_for_inference(ckpt, trained["data"]).task
    encoder = ExampleEncoder.from_task(task, trained["data"], 64)
    texts = [row[0] for row in trained["rows"][:6]]
    for text in texts:
        assert hub.encode(text).tolist() == encoder.encode([text]).tolist()
    with pytest.raises(ValueError, match="hub.encode: 2 text.* single-sentence model"):
        hub.encode(texts[0], texts[1])
    assert hub.bpe.decode(hub.bpe.encode(texts[0])) == texts[0]
    _, out, _ = run_predict(ckpt, "--policy", "entropy:0.68", stdin="\n".join(texts))
    labels = task.label_dictionary
    for text, line in zip(texts, out.splitlines()):
        result = hub.predict_early_exit(DEFAULT_HEAD, hub.encode(text), "entropy:0.68")
        label = labels[int(result.predictions[0]) + labels.nspecial]
        assert f"{label}\t{int(result.exit_layers[0])}" == "\t".join(line.split("\t")[::2])


def test_demo_last_step_classifies_example_sentences(trained) -> None:
    """The demo's last step: acl-fairseq-predict in its own process, one line per sentence,
    then what it ran: no policy flag, so the saved choice, here none (full depth)."""
    from acl_fairseq.cli.demo import cli as demo

    cmd = demo.predict_command(trained["ckpt"], trained["data"])
    assert cmd[1:4] == ["-m", "acl_fairseq.cli.predict", "--path"] and "--policy" not in cmd
    text = demo.classify_examples(trained["ckpt"], trained["data"])
    lines = text.splitlines()
    assert len(lines) == len(demo.EXAMPLE_SENTENCES) + 3, text
    for line, sentence in zip(lines, demo.EXAMPLE_SENTENCES):
        label, prob, layer, shown = line.split("\t")
        assert label in ("pos", "neg") and 0.5 <= float(prob) <= 1.0
        assert layer in {f"exit {n}" for n in range(1, 5)} and shown == sentence
    assert lines[-3].startswith("acl-fairseq-predict: policy: full depth (no early_exit_policy")
    assert lines[-2] == "acl-fairseq-predict: dtype: fp32"
    assert lines[-1].startswith("acl-fairseq-predict: 5 sentences, ")
