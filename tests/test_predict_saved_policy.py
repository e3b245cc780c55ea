"""acl-fairseq-predict and the hub on a policy acl-fairseq-sweep saved: per precision, on the
weights it was chosen on only, the learned kind, and on the ONNX Runtime backend."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from acl_fairseq.cli import predict as predict
from acl_fairseq.data.splits import load_batches
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD
from acl_fairseq.runtime.onnx_runtime import segment_tag

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


@pytest.mark.parametrize("kind", ["entropy", "per_exit_entropy", "learned"])
def test_a_sweep_on_a_split_too_small_deploys_nothing(trained, tmp_path, capsys, kind):
    """Before: on 1 or 3 dev rows the sweep deployed entropy:inf, per_exit_entropy:1=inf or a
    learned model with every weight 0 over the saved policy. Now it stops in one line naming
    the split's size and the size needed, and the saved file stays as it was."""
    from acl_fairseq.cli import sweep
    from acl_fairseq.inference.saved_policy import POLICY_FILE

    ckpt = tmp_path / trained["ckpt"].name
    shutil.copy(trained["ckpt"], ckpt)
    (tmp_path / POLICY_FILE).write_text('{"policy": "entropy:0.2"}\n', encoding="utf-8")
    before = (tmp_path / POLICY_FILE).read_bytes()
    for rows in (1, 3):
        flags = [str(ckpt), str(trained["data"]), "--policy", kind, "--cpu", "--repeats", "0",
                 "--max-examples", str(rows), "--max-accuracy-drop", "1"]  # fmt: skip
        assert sweep.main(flags) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        err = [line for line in err.splitlines() if line.startswith("acl-fairseq-sweep")]
        assert len(err) == 1 and re.match(
            rf"acl-fairseq-sweep: error: --split valid \(--max-examples {rows}\) has {rows} "
            r"rows? \(class 0: \d, class 1: \d\): choosing an early-exit policy needs at least 5 "
            r"rows of each of the 2 classes: use a larger split",
            err[0],
        ), err
        assert (tmp_path / POLICY_FILE).read_bytes() == before


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
    tag = segment_tag("int8")
    assert any(p.name.endswith(f".{tag}.onnx") for p in cache.rglob("*.onnx"))

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
