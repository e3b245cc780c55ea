"""benchmarks/inference_anchors.py: the HF anchor carries the fairseq model's weights (same
logits), and the table's accuracy / agreement / exit columns (no timing is asserted)."""

from __future__ import annotations

import copy
import csv

import pytest
import torch

from acl_fairseq.early_exit.policies import parse_policy
from acl_fairseq.runtime.onnx_runtime import segment_tag
from acl_fairseq.runtime.precision import prepare_for_inference
from benchmarks import anchors_plot
from benchmarks import inference_anchors as anchors

from tiny_models import HEAD, build_with_task, random_batch, train_tiny, write_dicts


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_hf_anchor_equals_the_fairseq_model(tmp_path, pooling):
    model, task = build_with_task(write_dicts(tmp_path), extra=("--exit-pooling", pooling))
    tokens, _ = random_batch(task, 8, seed=2)  # right-padded rows of different lengths
    anchor = anchors.HfAnchor(model, "eager")
    pad = task.source_dictionary.pad()
    with torch.no_grad():
        expected = model(tokens, classification_head_name=HEAD)[0]
        got = anchor(tokens, tokens.ne(pad).long())
        alone = anchor(tokens[:1, : int(tokens[0].ne(pad).sum())], torch.ones(1, 1).long())
    assert not anchor.training
    assert torch.allclose(got, expected, atol=1e-5)
    assert alone.shape == (1, 3)


def test_table_rows(tmp_path):
    model, task = build_with_task(write_dicts(tmp_path))
    model = train_tiny(model, task, steps=40)
    tokens, labels = random_batch(task, 48, seed=3)
    batches = [(tokens[i : i + 16], labels[i : i + 16]) for i in range(0, 48, 16)]
    policy = parse_policy("per_exit_entropy:1=0.4,3=0.2")
    hf = anchors.hf_runner(anchors.HfAnchor(model))
    configs = [
        anchors.Config("HF fp32 (eager)", "full depth", hf),
        anchors.Config("fp32", "full depth", anchors.project_runner(model, None)),
        anchors.Config("fp32", policy.spec, anchors.project_runner(model, policy)),
    ]  # fmt: skip
    rows = anchors.measure(configs, batches, rounds=1)
    untimed = anchors.measure(configs, batches, rounds=0)
    with torch.no_grad():
        full = model(tokens, classification_head_name=HEAD)[0].argmax(-1)
        early = model.early_exit(tokens, policy)  # evaluates exits 1 and 3 only
    assert rows[0]["accuracy"] == pytest.approx(100.0 * float(full.eq(labels).double().mean()))
    assert rows[0]["agreement"] == 100.0 and rows[1]["mean_exit_layer"] == 4.0
    # early exit through the benchmark's runner equals the model's own loop per batch
    exits = torch.cat([anchors.project_runner(model, policy)(t)[1] for t, _ in batches])
    assert rows[2]["mean_exit_layer"] == pytest.approx(float(exits.double().mean()))
    assert set(exits.tolist()) <= {1, 3, 4} and len(set(exits.tolist())) > 1
    agreement = 100.0 * float(early.predictions.eq(full).double().mean())
    assert rows[2]["agreement"] == pytest.approx(agreement)
    assert rows[0]["speedup"] == 1.0 and rows[2]["ms"] > 0
    assert [r["accuracy"] for r in untimed] == [r["accuracy"] for r in rows]
    assert untimed[2]["ms"] is None and untimed[2]["speedup"] is None

    table = [{"batch": 32, "threads": 2, **r} for r in rows]
    lines = anchors.format_rows(table)
    assert lines[0].startswith("| batch | threads | system | policy | accuracy % |")
    assert lines[4].startswith(f"| 32 | 2 | fp32 | {policy.spec} | ")
    anchors.write_rows(table, tmp_path / "t.csv", ["# preamble"])
    anchors.write_rows(table, tmp_path / "t.md", ["# preamble"])
    with open(tmp_path / "t.csv") as f:
        written = list(csv.DictReader(f))
    assert list(written[0]) == list(anchors.COLUMNS) and len(written) == 3
    assert float(written[2]["mean_exit_layer"]) == pytest.approx(rows[2]["mean_exit_layer"])
    assert (tmp_path / "t.md").read_text().splitlines()[2:] == lines


@pytest.fixture(scope="module")
def two_precisions(tmp_path_factory):
    """``({"fp32": model, "int8": model}, dev batches)``: a tiny trained multi-exit model at two
    precisions and three dev batches of 32 (read only by the tests)."""
    model, task = build_with_task(write_dicts(tmp_path_factory.mktemp("anchors")))
    model = train_tiny(model, task, steps=40)
    tokens, labels = random_batch(task, 96, seed=4)
    dev = [(tokens[i : i + 32], labels[i : i + 32]) for i in range(0, 96, 32)]
    return {"fp32": model, "int8": prepare_for_inference(copy.deepcopy(model), "int8")}, dev


def test_policies_chosen_on_dev_meet_the_target_there(two_precisions):
    """``deployable``: per precision and kind, the policy ``acl-fairseq-sweep`` would deploy
    (agreement with the full model within the target on dev), or a note why not."""
    from acl_fairseq.early_exit.calibrate import evaluate
    from acl_fairseq.early_exit.thresholds import collect_exits
    from acl_fairseq.inference.deploy import DeployTarget

    models, dev = two_precisions
    target = DeployTarget(max_accuracy_drop=2.0)
    chosen, notes = anchors.deployable(models, dev, ["entropy", "per_exit_entropy"], target, "dev")
    assert len(notes) == 4
    assert sum(len(c) for c in chosen.values()) >= 2  # not vacuous
    for dtype, choices in chosen.items():
        exit_logits, targets = collect_exits(models[dtype], dev, HEAD)
        for label, policy in choices:
            assert label.endswith("chosen on dev")
            result = evaluate(exit_logits, targets, policy)
            assert result.agreement >= 98.0 - 1e-9 and result.mean_exit_layer < 4.0


def test_head_cost_per_system():
    assert anchors.head_costs("0.03") == (0.03, {})
    default, own = anchors.head_costs("0.08, int8=0.15,ort=0.2")
    assert default == 0.08 and own == {"int8": 0.15, anchors.ORT_PROJECT: 0.2}
    for bad, match in [("int4=0.1", "unknown name 'int4'"), ("int8=x", "not COST"),
                       ("-1", ">= 0")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            anchors.head_costs(bad)


def test_one_thread_count_per_run_with_onnx_runtime(capsys):
    with pytest.raises(SystemExit) as stop:
        anchors.main(["ckpt.pt", "data", "--threads", "1,2"])
    assert stop.value.code == 2 and "one count per run with ONNX Runtime" in capsys.readouterr().err


def test_a_system_own_head_cost_leaves_out_exits_that_do_not_pay(two_precisions):
    """``deployable`` with ``{system: cost}``: that system's per-exit policy is chosen at its
    own head cost (fewer exits evaluated), the others at the target's."""
    from acl_fairseq.inference.deploy import DeployTarget

    models, dev = two_precisions
    target = DeployTarget(max_accuracy_drop=2.0)
    kinds = ["per_exit_entropy"]
    plain, _ = anchors.deployable(models, dev, kinds, target, "dev")
    costly, _ = anchors.deployable(models, dev, kinds, target, "dev", {"int8": 1.0})
    assert costly["fp32"][0][1] == plain["fp32"][0][1]
    assert len(plain["int8"][0][1].exits((1, 2, 3))) == 3
    assert len(costly["int8"][0][1].exits((1, 2, 3))) < 3


@pytest.mark.slow
def test_runs_end_to_end_on_a_checkpoint(sentiment_data, tmp_path, capsys):
    """The benchmark on a trained multi-exit checkpoint and its data folder: HF fp32 anchor,
    ONNX Runtime int8, this project at two precisions and on ORT int8 segments, full depth and
    the policies chosen on dev, both batch sizes; the table as CSV (one timed round)."""
    from fairseq_helpers import TINY_MULTI_EXIT, fairseq_train, train_args

    fairseq_train(
        sentiment_data, tmp_path / "ckpt",
        *train_args(TINY_MULTI_EXIT, criterion="multi_exit_ce", max_update=24,
                    no_epoch_checkpoints=True),
    )  # fmt: skip
    ckpt = tmp_path / "ckpt" / "checkpoint_last.pt"
    out = tmp_path / "anchors.csv"
    assert anchors.main([
        str(ckpt), str(sentiment_data), "--dev", "valid", "--test", "valid",
        "--max-examples", "24", "--rounds", "1", "--batch-sizes", "1,8", "--threads", "1",
        "--dtypes", "fp32,int8", "--max-accuracy-drop", "100", "--out", str(out),
        "--ort-cache", str(tmp_path / "onnx"), "--plot", str(tmp_path / "trade-off.png"),
    ]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "measured on valid, policies chosen on valid (--max-accuracy-drop 100" in printed
    with open(out) as f:
        rows = list(csv.DictReader(f))
    systems = [(r["batch"], r["system"], r["policy"].split(":")[0]) for r in rows]
    for batch in ("1", "8"):
        assert (batch, "HF fp32 (sdpa)", "full depth") in systems
        assert (batch, "fp32", "full depth") in systems and (batch, "int8", "full depth") in systems
        assert (batch, "fp32", "entropy chosen on valid") in systems
        assert (batch, "int8", "per_exit_entropy chosen on valid") in systems
        assert (batch, "ORT int8", "full depth") in systems
        assert (batch, anchors.ORT_PROJECT, "full depth") in systems
        assert (batch, anchors.ORT_PROJECT, "entropy chosen on valid") in systems
        assert (batch, anchors.ORT_PROJECT, "per_exit_entropy chosen on valid") in systems
    hf = next(r for r in rows if r["system"].startswith("HF") and r["batch"] == "8")
    fp32 = next(r for r in rows if r["system"] == "fp32" and r["batch"] == "8")
    assert hf["accuracy"] == fp32["accuracy"]  # the same weights
    ort = next(r for r in rows if r["system"] == anchors.ORT_PROJECT and r["batch"] == "8")
    assert float(ort["agreement"]) >= 90.0  # int8 segments of the same weights
    tag = segment_tag("int8")
    assert any((tmp_path / "onnx").rglob(f"layers1-1.{tag}.onnx"))  # the exits' segments
    chosen = [r for r in rows if "chosen on valid" in r["policy"]]
    assert all(float(r["mean_exit_layer"]) == 1.0 for r in chosen)  # the 100-point target
    assert all(float(r["ms"]) > 0 and float(r["speedup"]) > 0 for r in rows)
    # an oracle row after each of this project's full-depth rows, none for the anchors
    oracles = [r for r in rows if r["policy"] == anchors_plot.ORACLE_POLICY]
    assert {(r["batch"], r["system"]) for r in oracles} == {
        (b, s) for b in ("1", "8") for s in ("fp32", "int8", anchors.ORT_PROJECT)
    }
    for r in oracles:
        full = next(
            f for f in rows
            if (f["batch"], f["system"], f["policy"]) == (r["batch"], r["system"], "full depth")
        )  # fmt: skip
        layer, depth = float(r["mean_exit_layer"]), float(full["mean_exit_layer"])
        assert 1.0 <= layer < depth and r["accuracy"] == full["accuracy"]
        assert float(r["ms"]) == pytest.approx(float(full["ms"]) * layer / depth, rel=1e-6)
    png = (tmp_path / "trade-off.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_oracle_rows_are_full_depth_at_the_layer_count_ideal():
    rows = [
        {"system": "HF fp32 (sdpa)", "policy": "full depth", "accuracy": 80.0, "ms": 10.0,
         "speedup": 1.0, "mean_exit_layer": 6.0, "agreement": 100.0},
        {"system": "int8", "policy": "full depth", "accuracy": 79.0, "ms": 4.0,
         "speedup": 2.5, "mean_exit_layer": 6.0, "agreement": 98.0},
        {"system": "int8", "policy": "entropy:0.3", "accuracy": 78.0, "ms": 2.0,
         "speedup": 5.0, "mean_exit_layer": 3.0, "agreement": 97.0},
    ]  # fmt: skip
    out = anchors_plot.with_oracle_rows(rows, {"int8": 1.5, "fp32": 2.0}, depth=6)
    assert [r["policy"] for r in out] == [
        "full depth", "full depth", anchors_plot.ORACLE_POLICY, "entropy:0.3"
    ]  # fmt: skip
    oracle = out[2]
    assert oracle["ms"] == pytest.approx(1.0) and oracle["speedup"] == pytest.approx(10.0)
    assert (oracle["accuracy"], oracle["agreement"]) == (79.0, 98.0)
    assert oracle["mean_exit_layer"] == 1.5
    untimed = anchors_plot.with_oracle_rows(
        [{**rows[1], "ms": None, "speedup": None}], {"int8": 3}, 6
    )
    assert untimed[1]["ms"] is None and untimed[1]["speedup"] is None
