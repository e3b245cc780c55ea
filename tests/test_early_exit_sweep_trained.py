"""acl-fairseq-sweep on checkpoints trained by fairseq-train: the table, a policy per precision,
its early errors."""

from __future__ import annotations

import csv
import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from acl_fairseq.cli.sweep import main as sweep_main
from acl_fairseq.data.splits import load_batches
from acl_fairseq.early_exit.policies import make_policy
from acl_fairseq.early_exit.thresholds import (
    collect_exits,
    exit_accuracies,
    simulate_exits,
)
from acl_fairseq.inference.loader import load_for_inference

from fairseq_helpers import BIN, TINY_MULTI_EXIT, fairseq_train, run, train_args

HEAD = "sentence_classification_head"

TRAIN = train_args(
    TINY_MULTI_EXIT, criterion="multi_exit_ce", max_update=24, no_epoch_checkpoints=True
)


def _read(path: Path, delimiter: str = "\t") -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f, delimiter=delimiter))


@pytest.mark.slow
def test_sweep_on_trained_checkpoint(
    sentiment_data: Path, tmp_path: Path, capsys, one_thread
) -> None:
    fairseq_train(sentiment_data, tmp_path / "ckpt", *TRAIN)
    ckpt = tmp_path / "ckpt" / "checkpoint_last.pt"

    # the command line (own process, 1 thread): entropy, two batch sizes, TSV
    out = run(
        [
            str(BIN / "acl-fairseq-sweep"),
            "--checkpoint", str(ckpt), "--data", str(sentiment_data),
            "--policy", "entropy", "--thresholds", "0,0.3,inf",
            "--batch-sizes", "1,16", "--max-examples", "40", "--repeats", "1", "--cpu",
            "--out", str(tmp_path / "sweep.tsv"),
        ]
    )  # fmt: skip
    assert "| exit layer | 1 | 2 | 3 | 4 |" in out and "| batch | policy | threshold |" in out
    rows = _read(tmp_path / "sweep.tsv")
    oracle = [r for r in rows if r["policy"].startswith("oracle")]
    rows = [r for r in rows if r not in oracle]
    assert [(r["policy"], r["wall_speedup"]) for r in oracle] == [
        ("oracle-final", ""),
        ("oracle-gold", ""),
    ]
    assert oracle[0]["accuracy"] == rows[0]["accuracy"]  # agrees with the final exit
    assert float(oracle[1]["accuracy"]) >= float(rows[0]["accuracy"])
    assert [(r["batch_size"], r["policy"], r["threshold"]) for r in rows] == [
        (b, p, t)
        for b in ("1", "16")
        for p, t in [("none", ""), ("entropy", "0"), ("entropy", "0.3"), ("entropy", "inf")]
    ]
    assert {r["examples"] for r in rows} == {"40"}
    for b in ("1", "16"):
        full, never, _, always = (r for r in rows if r["batch_size"] == b)
        assert float(never["mean_exit_layer"]) == 4.0
        assert never["accuracy"] == full["accuracy"]
        assert float(always["mean_exit_layer"]) == 1.0
        for r in (never, always):
            ideal = 4.0 / float(r["mean_exit_layer"])
            assert float(r["layer_speedup"]) == pytest.approx(ideal)
            frac = float(r["wall_speedup"]) / ideal
            assert float(r["fraction_of_ideal"]) == pytest.approx(frac, rel=1e-4)
            assert float(r["wall_speedup"]) > 0
    # the same examples in the same order for every batch size
    assert rows[0]["accuracy"] == rows[4]["accuracy"]

    # in process (importable main): patience, CSV; patience 3 = never, 0 = first exit
    assert sweep_main(
        [
            str(ckpt), str(sentiment_data), "--policy", "patience", "--thresholds", "3,0",
            "--batch-sizes", "8", "--max-examples", "40", "--repeats", "1", "--cpu",
            "--out", str(tmp_path / "patience.csv"),
        ]
    ) == 0  # fmt: skip
    assert "| batch | policy | threshold |" in capsys.readouterr().out
    full, never, first, *oracle = _read(tmp_path / "patience.csv", ",")
    assert [r["policy"] for r in oracle] == ["oracle-final", "oracle-gold"]
    assert float(never["mean_exit_layer"]) == 4.0 and never["accuracy"] == full["accuracy"]
    assert float(first["mean_exit_layer"]) == 1.0 and float(first["layer_speedup"]) == 4.0

    # the first exit's accuracy is the layer-score curve's layer 1
    loaded = load_for_inference(ckpt, sentiment_data, multi_exit=True)
    model, task = loaded.model, loaded.task
    batches = load_batches(task, "valid", 8, 40)
    assert sum(t.numel() for _, t in batches) == 40
    scores = exit_accuracies(*collect_exits(model, batches, HEAD))
    assert list(scores) == [1, 2, 3, 4]
    assert float(first["accuracy"]) == pytest.approx(scores[1], abs=1e-3)
    assert float(full["accuracy"]) == pytest.approx(scores[4], abs=1e-3)
    # simulating a policy on one exit_outputs pass gives early_exit's exits
    for tokens, _ in batches:
        logits = [(o.layer, o.logits) for o in model.exit_outputs(tokens)]
        for kind, threshold in [("entropy", 0.68), ("maxprob", 0.55), ("patience", 1)]:
            policy = make_policy(kind, threshold)
            result = model.early_exit(tokens, policy)
            layers, preds = simulate_exits(logits, policy)
            assert torch.equal(layers, result.exit_layers), (kind, layers, result.exit_layers)
            assert torch.equal(preds, result.predictions), kind


@pytest.mark.slow
def test_sweep_per_exit_kind_at_two_precisions(sentiment_data: Path, tmp_path: Path) -> None:
    """--policy per_exit_entropy --dtypes fp32,int8 --repeats 0: per precision, the full model
    and the policies calibrated at each --drops target, from one pass each; no timing."""
    fairseq_train(sentiment_data, tmp_path / "ckpt", *TRAIN)
    ckpt = tmp_path / "ckpt" / "checkpoint_last.pt"
    out = run(
        [
            str(BIN / "acl-fairseq-sweep"), str(ckpt), str(sentiment_data),
            "--policy", "per_exit_entropy", "--drops", "0,5,100", "--dtypes", "fp32,int8",
            "--batch-sizes", "1,16", "--max-examples", "40", "--repeats", "0", "--cpu",
            "--out", str(tmp_path / "sweep.csv"),
        ]
    )  # fmt: skip
    assert "no timing (--repeats 0)" in out and "full depth at int8: accuracy" in out
    rows = [r for r in _read(tmp_path / "sweep.csv", ",") if not r["policy"].startswith("oracle")]
    assert [r["dtype"] for r in rows][0] == "fp32" and {r["dtype"] for r in rows} == {
        "fp32",
        "int8",
    }
    assert all(r["wall_speedup"] == "" for r in rows)
    loaded = load_for_inference(ckpt, sentiment_data, multi_exit=True)
    model, task = loaded.model, loaded.task
    exits, targets = collect_exits(model, load_batches(task, "valid", 1, 40), HEAD)
    fp32 = [r for r in rows if r["dtype"] == "fp32" and r["batch_size"] == "1"]
    assert fp32[0]["policy"] == "none" and {r["policy"] for r in fp32[1:]} == {"per_exit_entropy"}
    for r in fp32[1:]:  # each row's policy reads back and gives its row on the split
        policy = make_policy(r["policy"], r["threshold"])
        layers, preds = simulate_exits(exits, policy)
        assert float(r["mean_exit_layer"]) == pytest.approx(float(layers.double().mean()), abs=1e-4)
        assert float(r["accuracy"]) == pytest.approx(
            100.0 * float(preds.eq(targets).double().mean()), abs=1e-3
        )
    assert float(fp32[-1]["mean_exit_layer"]) == 1.0  # the 100-point target: all at exit 1


@pytest.mark.slow
def test_sweep_on_a_stage1_checkpoint_is_an_early_error(sentiment_data: Path, tmp_path: Path):
    """A checkpoint with only its final exit (stage 1, --exit-layers none): an error naming it
    and the stage to train, before any sweep (not a no-op entropy:0.0 policy)."""
    fairseq_train(
        sentiment_data, tmp_path / "stage1", "--exit-layers", "none",
        *train_args(TINY_MULTI_EXIT, criterion="sentence_prediction", max_update=1,
                    no_epoch_checkpoints=True),
    )  # fmt: skip
    ckpt = tmp_path / "stage1" / "checkpoint_last.pt"
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = sweep_main([str(ckpt), str(sentiment_data), "--max-accuracy-drop", "1", "--cpu"])
    assert code == 2 and out.getvalue() == ""
    assert (
        f"acl-fairseq-sweep: error: {ckpt} has no shallow exit (a stage-1 checkpoint, trained "
        "with --exit-layers none): early exit needs the multi-exit stage 2: fairseq-train "
        "--arch multi_exit_roberta* --criterion acl_cross_layer --restore-file"
    ) in err.getvalue()
    assert not (tmp_path / "stage1" / "early_exit_policy.json").exists()
