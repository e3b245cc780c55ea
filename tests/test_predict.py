"""acl-fairseq-predict (and the hub interface): raw text in, predictions out, on checkpoints
trained by ``fairseq-train``. The encoding itself is tested in test_text_encoder.py."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from acl_fairseq.cli import predict as predict
from acl_fairseq.data.splits import load_batches
from acl_fairseq.data.text_encoder import ExampleEncoder
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD

from fairseq_helpers import NEUTRAL, TINY_MULTI_EXIT, fairseq_train, prepare_tsv_task, train_args

pytestmark = pytest.mark.slow  # every test trains a model (the module's fixture)

MULTI_EXIT = train_args(
    TINY_MULTI_EXIT, criterion="multi_exit_ce", max_update=12, no_epoch_checkpoints=True
)
PLAIN = train_args(criterion="sentence_prediction", max_update=1, no_epoch_checkpoints=True)
STAGE1 = train_args(
    TINY_MULTI_EXIT, criterion="acl_embed", max_update=1, no_epoch_checkpoints=True
) + ["--exit-layers", "none"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("predict")
    data, test_rows = prepare_tsv_task(root)
    fairseq_train(data, root / "multi", *MULTI_EXIT)
    ckpt = root / "multi/checkpoint_last.pt"
    return {"root": root, "data": data, "rows": test_rows, "ckpt": ckpt}


@pytest.fixture
def timing_guard(monkeypatch) -> list[tuple]:
    """The sweep's deploy-time guard (``deploy.check_measured``: refuse a policy timed no
    faster than full depth) compares wall-clock times, which on a tiny model and a busy machine
    go either way; it is tested with fakes in test_early_exit_sweep.py. Here it records its
    calls ``(policy spec, early ms, full ms)`` and lets the policy through."""
    from acl_fairseq.inference import deploy

    calls: list[tuple] = []

    def record(policy, early_ms: float, full_ms: float, *_: object) -> None:
        calls.append((policy.spec, early_ms, full_ms))

    monkeypatch.setattr(deploy, "check_measured", record)
    return calls


def run_predict(*argv: str | Path, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = predict.main([str(a) for a in argv], io.StringIO(stdin), out, err)
    return code, out.getvalue(), err.getvalue()


def _model_predictions(trained, policy: str | None, dtype=None, batch_size=8) -> list[str]:
    """The model's own predictions on the binarized test split (label, layer)."""
    from acl_fairseq.early_exit.policies import parse_policy

    loaded = load_for_inference(trained["ckpt"], trained["data"], dtype=dtype)
    model, task = loaded.model, loaded.task
    labels = task.label_dictionary
    pad = task.source_dictionary.pad()
    out = []
    with torch.no_grad():
        for tokens, _ in load_batches(task, "test", batch_size):
            if batch_size == 1:
                tokens = tokens[:, : int(tokens.ne(pad).sum())]
            if policy is None:
                preds = model(tokens, classification_head_name=DEFAULT_HEAD)[0].argmax(-1)
                layers = [model.num_layers] * len(preds)
            else:
                result = model.early_exit(tokens, parse_policy(policy))
                preds, layers = result.predictions, result.exit_layers.tolist()
            out += [f"{labels[int(p) + labels.nspecial]}\t{n}" for p, n in zip(preds, layers)]
    return out


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


def test_sweep_target_saves_a_policy_that_predict_and_hub_use(
    trained, tmp_path, capsys, timing_guard
) -> None:
    from acl_fairseq.cli import sweep
    from acl_fairseq.inference.saved_policy import POLICY_FILE, read_policy
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

    ckpt = tmp_path / "model" / trained["ckpt"].name  # own folder: the fixture's stays bare
    ckpt.parent.mkdir()
    shutil.copy(trained["ckpt"], ckpt)
    common = [str(ckpt), str(trained["data"]), "--thresholds", "quantiles:4", "--cpu",
              "--batch-sizes", "8", "--max-examples", "24", "--repeats", "1"]  # fmt: skip
    assert sweep.main([*common, "--target-speedup", "100"]) == 2
    assert "--target-speedup 100: no policy reaches it; the largest" in capsys.readouterr().err
    assert read_policy(ckpt) is None
    assert sweep.main([*common, "--max-accuracy-drop", "100"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | oracle-final |" in out and "| 8 | oracle-gold |" in out
    saved = read_policy(ckpt)
    assert f"wrote {ckpt.parent / POLICY_FILE}" in out
    assert [spec for spec, *_ in timing_guard] == [saved.policy.spec]
    assert all(early > 0 and full > 0 for _, early, full in timing_guard)
    assert saved.fields["chosen_by"]["target"] == {"max_accuracy_drop": 100.0}
    assert saved.fields["chosen_by"]["split"] == "valid"
    assert saved.fields["checkpoint"] == ckpt.name and saved.dtype == "fp32"
    assert saved.fields["layer_speedup"] == 4.0  # the fastest

    text = "".join(f"{row[0]}\n" for row in trained["rows"][:8])
    code, by_default, err = run_predict(ckpt, stdin=text)
    assert code == 0 and f"policy: {saved.policy.spec} (saved in" in err
    assert {line.split("\t")[2] for line in by_default.splitlines()} == {"1"}
    _, explicit, _ = run_predict(ckpt, "--policy", saved.policy.spec, stdin=text)
    assert explicit == by_default
    code, full, err = run_predict(ckpt, "--policy", "none", stdin=text)
    assert code == 0 and "policy: full depth (--policy none)" in err
    assert {line.split("\t")[2] for line in full.splitlines()} == {"4"}
    code, _, err = run_predict(trained["ckpt"], "--policy", "saved", stdin=text)
    assert code == 2 and "--policy saved: no " in err and "--max-accuracy-drop" in err

    hub = MultiExitRobertaModel.from_pretrained(
        str(ckpt.parent), ckpt.name, data_name_or_path=str(trained["data"])
    )
    assert hub.default_policy == saved.policy
    tokens = hub.encode(trained["rows"][0][0])
    assert hub.predict_early_exit(DEFAULT_HEAD, tokens).exit_layers.tolist() == [1]
    hub.default_policy = None  # full depth
    assert hub.predict_early_exit(DEFAULT_HEAD, tokens).exit_layers.tolist() == [4]


def test_sweep_dtypes_saves_a_policy_per_precision_that_predict_and_hub_use(
    trained, tmp_path, capsys, timing_guard
) -> None:
    """acl-fairseq-sweep --dtypes int8,fp32: both precisions' choices saved, int8 the default
    that predict (its --dtype) and the hub (from_pretrained's dtype) then run."""
    from acl_fairseq.cli import sweep
    from acl_fairseq.inference.saved_policy import read_policy
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel
    from acl_fairseq.runtime.precision import model_precision, quantized_linears

    ckpt = tmp_path / "model" / trained["ckpt"].name
    ckpt.parent.mkdir()
    shutil.copy(trained["ckpt"], ckpt)
    assert sweep.main([
        str(ckpt), str(trained["data"]), "--policy", "per_exit_entropy", "--dtypes", "int8,fp32",
        "--max-accuracy-drop", "100", "--batch-sizes", "8", "--max-examples", "24",
        "--repeats", "1", "--cpu",
    ]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "chosen (target {'max_accuracy_drop': 100.0}, constraint agreement, head_cost" in out
    assert "  int8: per_exit_entropy:" in out and "  fp32: per_exit_entropy:" in out
    saved = read_policy(ckpt)
    assert saved.dtype == "int8" and set(saved.by_dtype) == {"int8", "fp32"}
    assert sorted(spec for spec, *_ in timing_guard) == sorted(
        policy.spec for policy in saved.by_dtype.values()
    )  # each precision's timed choice went through the guard
    assert saved.policy == saved.by_dtype["int8"]
    assert saved.fields["chosen_by"]["constraint"] == "agreement"
    int8 = saved.fields["by_dtype"]["int8"]
    assert int8["method"] == "calibrated" and int8["batch_size"] == 8
    assert 0 <= int8["full_agreement_with_fp32"] <= 100 and int8["ms_per_example"] > 0
    assert int8["exits"] == list(saved.policy.layers) and int8["layer_speedup"] == 4.0

    text = "".join(f"{row[0]}\n" for row in trained["rows"])
    code, by_default, err = run_predict(ckpt, "--batch-size", "1", stdin=text)
    assert code == 0 and "dtype: int8" in err and f"policy: {saved.policy.spec} (saved" in err
    policy = saved.policy.spec
    assert sorted("\t".join(line.split("\t")[::2]) for line in by_default.splitlines()) == sorted(
        _model_predictions(trained, policy, dtype="int8", batch_size=1)
    )
    code, _, err = run_predict(ckpt, "--dtype", "fp32", stdin=text)
    assert code == 0 and "dtype: fp32" in err
    assert f"policy: {saved.by_dtype['fp32'].spec} (saved" in err and "chosen at" not in err
    code, full, err = run_predict(ckpt, "--dtype", "bf16", "--policy", "none", "--batch-size", "1",
                                  stdin=text)  # fmt: skip
    assert code == 0 and "dtype: bf16" in err
    assert sorted("\t".join(x.split("\t")[::2]) for x in full.splitlines()) == sorted(
        _model_predictions(trained, None, dtype="bf16", batch_size=1)
    )
    code, _, err = run_predict(ckpt, "--dtype", "bf16", stdin=text)
    assert code == 0 and "chosen at int8, none for bf16 in the file" in err

    hub = MultiExitRobertaModel.from_pretrained(
        str(ckpt.parent), ckpt.name, data_name_or_path=str(trained["data"])
    )
    assert hub.dtype == "int8" and model_precision(hub.model) == "int8"
    assert len(quantized_linears(hub.model)) > 0 and hub.default_policy == saved.policy
    tokens = hub.encode(trained["rows"][0][0])
    assert hub.predict_early_exit(DEFAULT_HEAD, tokens).exit_layers.tolist() == [1]
    fp32 = MultiExitRobertaModel.from_pretrained(
        str(ckpt.parent), ckpt.name, data_name_or_path=str(trained["data"]), dtype="fp32"
    )
    assert fp32.dtype == "fp32" and not quantized_linears(fp32.model)
    assert fp32.default_policy == saved.by_dtype["fp32"]


def test_a_saved_policy_runs_only_on_the_weights_it_was_chosen_on(trained, tmp_path, capsys):
    """early_exit_policy.json belongs to a folder, its policy to the weights the sweep chose it
    on: a copy of them runs it; checkpoint_last.pt next to it (other weights) runs full depth
    with the reason, refuses --policy saved, and so does the hub; an older file without the
    fingerprint is not used either."""
    from acl_fairseq.checkpoint.fingerprint import model_fingerprint
    from acl_fairseq.cli import sweep
    from acl_fairseq.inference.loader import read_checkpoint
    from acl_fairseq.inference.saved_policy import FINGERPRINT, POLICY_FILE, read_policy
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

    folder = tmp_path / "run"
    folder.mkdir()
    best, last = folder / "checkpoint_best.pt", folder / "checkpoint_last.pt"
    shutil.copy(trained["ckpt"], best)
    flags = [str(trained["data"]), "--thresholds", "quantiles:4", "--cpu", "--batch-sizes", "8",
             "--max-examples", "24", "--repeats", "0", "--max-accuracy-drop", "100"]  # fmt: skip
    assert sweep.main([str(best), *flags]) == 0
    capsys.readouterr()
    file, saved = folder / POLICY_FILE, read_policy(best)
    state = read_checkpoint(best)
    assert saved.fields[FINGERPRINT] == model_fingerprint(state["model"])
    text = "".join(f"{row[0]}\n" for row in trained["rows"][:8])

    # the same weights elsewhere, saved without the optimizer state: the policy runs
    elsewhere = tmp_path / "copy" / "model.pt"
    elsewhere.parent.mkdir()
    state = torch.load(best, weights_only=False)
    state.pop("last_optimizer_state", None)
    torch.save(state, elsewhere)
    shutil.copy(file, elsewhere.parent / POLICY_FILE)
    code, out, err = run_predict(elsewhere, stdin=text)
    assert code == 0 and f"policy: {saved.policy.spec} (saved in" in err
    assert {line.split("\t")[2] for line in out.splitlines()} == {"1"}

    # checkpoint_last.pt of the same run, other weights: full depth, with the reason
    state["model"]["encoder.sentence_encoder.layers.0.fc1.bias"].add_(1e-3)
    torch.save(state, last)
    reason = (
        f"{file} was chosen on other weights (checkpoint_best.pt as it was then) than {last}'s: "
        f"rerun acl-fairseq-sweep {last} DATA --max-accuracy-drop D to choose one for it"
    )
    code, out, err = run_predict(last, stdin=text)
    assert code == 0 and {line.split("\t")[2] for line in out.splitlines()} == {"4"}
    assert f"acl-fairseq-predict: policy: full depth, not the saved policy: {reason}\n" in err
    assert "saved in" not in err and "layer_speedup" not in err  # not the old file's numbers
    assert run_predict(last, "--policy", "saved", stdin=text)[1:] == (
        "",
        f"acl-fairseq-predict: error: --policy saved: {reason}\n",
    )
    hub = MultiExitRobertaModel.from_pretrained(str(folder), last.name, str(trained["data"]))
    assert hub.default_policy is None
    hub = MultiExitRobertaModel.from_pretrained(str(folder), best.name, str(trained["data"]))
    assert hub.default_policy == saved.policy

    # sweeping checkpoint_last.pt replaces the file, and says whose it was
    assert sweep.main([str(last), *flags]) == 0
    assert f"replaced {file}, which was chosen on other weights (checkpoint_best.pt)" in (
        capsys.readouterr().out
    )
    code, _, err = run_predict(best, stdin=text)
    assert code == 0 and "was chosen on other weights (checkpoint_last.pt as it was then)" in err

    # a file of an older sweep, without the fingerprint: not used, said in one line
    record = json.loads(file.read_text())
    del record[FINGERPRINT]
    file.write_text(json.dumps(record))
    code, out, err = run_predict(last, stdin=text)
    assert code == 0 and {line.split("\t")[2] for line in out.splitlines()} == {"4"}
    assert f"policy: full depth, not the saved policy: {file} does not record the model" in err


def test_sweep_learned_policy_that_predict_and_hub_run(trained, tmp_path, capsys) -> None:
    """--policy learned: its rows and its choice are fitted on the split; the saved file
    carries the weights; predict runs it by default (as the model's own loop does) and the hub
    too; --patience beside it is refused before loading."""
    from acl_fairseq.cli import sweep
    from acl_fairseq.early_exit.learned import LearnedPolicy
    from acl_fairseq.inference.saved_policy import read_policy
    from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

    ckpt = tmp_path / "model" / trained["ckpt"].name
    ckpt.parent.mkdir()
    shutil.copy(trained["ckpt"], ckpt)
    flags = [str(ckpt), str(trained["data"]), "--policy", "learned", "--cpu", "--batch-sizes",
             "8", "--max-examples", "40", "--repeats", "0"]  # fmt: skip
    with pytest.raises(SystemExit):
        sweep.main([*flags, "--patience", "1", "--max-accuracy-drop", "5"])
    assert "--patience: beside a per-exit policy's thresholds" in capsys.readouterr().err
    assert sweep.main([*flags, "--drops", "0,100", "--max-accuracy-drop", "100"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | learned |" in out and "  fp32: learned:" in out
    saved = read_policy(ckpt)
    assert isinstance(saved.policy, LearnedPolicy) and saved.fields["method"] == "calibrated"

    text = "".join(f"{row[0]}\n" for row in trained["rows"])
    code, by_default, err = run_predict(ckpt, "--batch-size", "5", stdin=text)
    assert code == 0 and f"policy: {saved.policy.spec} (saved in" in err
    assert sorted("\t".join(line.split("\t")[::2]) for line in by_default.splitlines()) == sorted(
        _model_predictions(trained, saved.policy.spec)
    )
    hub = MultiExitRobertaModel.from_pretrained(
        str(ckpt.parent), ckpt.name, data_name_or_path=str(trained["data"])
    )
    assert hub.default_policy == saved.policy
    tokens = hub.encode(trained["rows"][0][0])
    first = by_default.splitlines()[0].split("\t")[2]
    assert hub.predict_early_exit(DEFAULT_HEAD, tokens).exit_layers.tolist() == [int(first)]


def test_onnxruntime_backend_equals_the_fairseq_backend(trained, tmp_path, monkeypatch) -> None:
    """--backend onnxruntime: the fairseq backend's labels and exits at fp32, its probabilities
    to float32's rounding; int8 runs; the segments are exported once into --onnx-cache
    (default: onnx_runtime/ next to the checkpoint); bf16 and a missing onnxruntime refused."""
    import sys

    from acl_fairseq.early_exit.policies import parse_policy
    from acl_fairseq.inference.saved_policy import write_policy
    from acl_fairseq.runtime.onnx_runtime import INSTALL

    text = "".join(f"{row[0]}\n" for row in trained["rows"])
    cache = tmp_path / "onnx"
    ort = ["--backend", "onnxruntime", "--onnx-cache", cache, "--batch-size", "5"]
    layers = set()
    for policy in ("none", "entropy:0.68", "patience:1"):
        code, want, err = run_predict(trained["ckpt"], "--batch-size", "5", "--policy", policy,
                                      stdin=text)  # fmt: skip
        assert code == 0, err
        code, got, err = run_predict(trained["ckpt"], *ort, "--policy", policy, stdin=text)
        assert code == 0, err
        assert "backend: onnxruntime, segments in" in err and "dtype: fp32" in err
        want_rows = [line.split("\t") for line in want.splitlines()]
        got_rows = [line.split("\t") for line in got.splitlines()]
        assert [(r[0], r[2]) for r in got_rows] == [(r[0], r[2]) for r in want_rows], policy
        assert all(abs(float(a[1]) - float(b[1])) <= 2e-4 for a, b in zip(got_rows, want_rows))
        layers |= {r[2] for r in got_rows}
    assert layers == {"3", "4"}, layers  # patience:1 left early (row by row: test_onnx_runtime)
    exported = {p: p.stat().st_mtime_ns for p in cache.rglob("*.onnx")}
    assert exported
    code, again, err = run_predict(trained["ckpt"], *ort, "--policy", "patience:1", stdin=text)
    assert code == 0 and again == got
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.onnx")} == exported  # cached
    code, int8, err = run_predict(trained["ckpt"], *ort, "--dtype", "int8", stdin=text)
    assert code == 0 and "dtype: int8" in err, err
    assert len(int8.splitlines()) == len(trained["rows"])
    assert any(p.name.endswith(".int8.onnx") for p in cache.rglob("*.onnx"))

    ckpt = tmp_path / "model" / trained["ckpt"].name  # own folder: the fixture's stays bare
    ckpt.parent.mkdir()
    shutil.copy(trained["ckpt"], ckpt)
    code, _, err = run_predict(ckpt, "--backend", "onnxruntime", stdin=text)
    assert code == 0 and any((ckpt.parent / "onnx_runtime").rglob("layers1-4.fp32.onnx")), err
    # the saved policy runs by default, at its precision, the one chosen at --dtype else
    fingerprint = load_for_inference(ckpt, trained["data"], fingerprint=True).fingerprint
    by_dtype = {"int8": {"policy": parse_policy("patience:1")},
                "fp32": {"policy": parse_policy("entropy:0.68")}}  # fmt: skip
    write_policy(ckpt, parse_policy("patience:1"), "int8", by_dtype, fingerprint)
    code, saved, err = run_predict(ckpt, "--backend", "onnxruntime", stdin=text)
    assert code == 0 and "policy: patience:1 (saved in" in err and "dtype: int8" in err, err
    assert {line.split("\t")[2] for line in saved.splitlines()} == {"3"}
    code, _, err = run_predict(ckpt, "--backend", "onnxruntime", "--dtype", "fp32", stdin=text)
    assert code == 0 and "policy: entropy:0.68 (saved in" in err and "dtype: fp32" in err, err
    code, _, err = run_predict(ckpt, "--backend", "onnxruntime", "--dtype", "bf16", stdin="x")
    assert code == 2 and "--backend onnxruntime runs fp32 or int8, not --dtype bf16" in err
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # not installed
    code, _, err = run_predict(ckpt, "--backend", "onnxruntime", stdin="x")
    assert code == 2 and INSTALL in err and err.startswith("acl-fairseq-predict: error:")


def test_a_policy_swept_on_onnxruntime_runs_there_by_default(trained, tmp_path, monkeypatch):
    """``acl-fairseq-sweep --backend onnxruntime``: the policy is chosen on the segments' own
    exits (what ``deploy.choose`` gives on them), the file records the backend, and predict
    runs it there without ``--backend``; ``--backend fairseq`` still overrides it."""
    from acl_fairseq.cli.sweep import main as sweep_main
    from acl_fairseq.early_exit.policies import parse_policy
    from acl_fairseq.early_exit.thresholds import collect_exits
    from acl_fairseq.inference import deploy
    from acl_fairseq.runtime.onnx_runtime import OrtEarlyExit

    ckpt = tmp_path / "model" / trained["ckpt"].name
    ckpt.parent.mkdir()
    shutil.copy(trained["ckpt"], ckpt)
    flags = ["--split", "valid", "--policy", "per_exit_entropy", "--max-accuracy-drop", "10",
             "--repeats", "0", "--batch-sizes", "8", "--cpu", "--dtypes", "int8"]  # fmt: skip
    passes = []
    exit_outputs = OrtEarlyExit.exit_outputs

    def counted(self, *args, **kwargs):
        passes.append(self.dtype)
        return exit_outputs(self, *args, **kwargs)

    monkeypatch.setattr(OrtEarlyExit, "exit_outputs", counted)
    assert sweep_main([str(ckpt), str(trained["data"]), "--backend", "onnxruntime", *flags]) == 0
    assert passes and set(passes) == {"int8"}  # chosen on the segments' own exits
    monkeypatch.undo()
    record = json.loads((ckpt.parent / "early_exit_policy.json").read_text())
    assert record["backend"] == "onnxruntime" and record["dtype"] == "int8"
    loaded = load_for_inference(ckpt, trained["data"], fingerprint=True)
    segments = OrtEarlyExit(loaded.model, DEFAULT_HEAD, ckpt.parent / "onnx_runtime", "int8")
    batches = load_batches(loaded.task, "valid", 8)
    exit_logits, targets = collect_exits(segments, batches, DEFAULT_HEAD)
    target = deploy.DeployTarget(max_accuracy_drop=10.0, head_cost=0.03)
    own = deploy.choose("per_exit_entropy", exit_logits, targets, target).policy
    assert parse_policy(record["policy"]) == own

    text = "".join(f"{row[0]}\n" for row in trained["rows"])
    code, by_default, err = run_predict(ckpt, "--batch-size", "5", stdin=text)
    assert code == 0 and "backend: onnxruntime" in err and "dtype: int8" in err, err
    assert "backend onnxruntime" in err  # the saved policy's description
    ort = ["--backend", "onnxruntime", "--dtype", "int8", "--policy", own.spec]
    code, asked, err = run_predict(ckpt, "--batch-size", "5", *ort, stdin=text)
    assert code == 0 and asked == by_default, err
    code, _, err = run_predict(ckpt, "--batch-size", "5", "--backend", "fairseq", stdin=text)
    assert code == 0 and "backend: onnxruntime" not in err, err

    with pytest.raises(SystemExit) as stop:
        sweep_main([str(ckpt), str(trained["data"]), "--backend", "onnxruntime",
                    *flags[:-1], "bf16"])  # fmt: skip
    assert stop.value.code == 2


def test_the_sweep_saves_each_precision_on_its_faster_backend(
    trained, tmp_path, capsys, timing_guard
):
    """``acl-fairseq-sweep --backend fairseq,onnxruntime``: every precision swept and timed on
    each backend that runs it, and saved with the one whose chosen policy ran faster (its entry
    records both times); bf16 only on fairseq. Predict runs each precision on its backend."""
    from acl_fairseq.cli.sweep import main as sweep_main

    ckpt = tmp_path / "model" / trained["ckpt"].name
    ckpt.parent.mkdir()
    shutil.copy(trained["ckpt"], ckpt)
    assert sweep_main([
        str(ckpt), str(trained["data"]), "--backend", "fairseq,onnxruntime",
        "--dtypes", "int8,bf16", "--policy", "per_exit_entropy", "--max-accuracy-drop", "10",
        "--repeats", "1", "--batch-sizes", "8", "--max-examples", "24", "--cpu",
    ]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for label in ("int8 on onnxruntime", "int8 on fairseq", "bf16 on fairseq"):
        assert f"| {label} | 8 | per_exit_entropy |" in out, label
    assert "bf16 on onnxruntime" not in out
    record = json.loads((ckpt.parent / "early_exit_policy.json").read_text())
    int8, bf16 = record["by_dtype"]["int8"], record["by_dtype"]["bf16"]
    timed = int8["timed_backends"]
    assert set(timed) == {"fairseq", "onnxruntime"} and all(ms > 0 for ms in timed.values())
    assert int8["backend"] == min(timed, key=timed.get)
    assert int8["ms_per_example"] == timed[int8["backend"]]
    assert len(timing_guard) == 3  # int8 on each backend, bf16 on fairseq
    line = next(x for x in out.splitlines() if x.startswith("  int8 on "))
    assert line.startswith(f"  int8 on {int8['backend']} (") and re.search(
        r"fairseq \d+\.\d{3} ms", line
    ), line
    assert bf16["backend"] == "fairseq" and "timed_backends" not in bf16
    assert record["dtype"] == "int8" and record["backend"] == int8["backend"]

    text = "".join(f"{row[0]}\n" for row in trained["rows"][:8])
    code, _, err = run_predict(ckpt, stdin=text)
    assert code == 0 and "dtype: int8" in err, err
    assert ("backend: onnxruntime" in err) == (int8["backend"] == "onnxruntime")
    code, _, err = run_predict(ckpt, "--dtype", "bf16", stdin=text)
    assert code == 0 and "dtype: bf16" in err and "backend: onnxruntime" not in err, err
