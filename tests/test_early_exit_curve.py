"""The early-exit curve from one pass over every exit (quantile thresholds, oracle rows, the
row for a target), the saved policy file and the sweep table's file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from acl_fairseq.early_exit.policies import EntropyPolicy, make_policy
from acl_fairseq.early_exit.table import read_sweep, write_table
from acl_fairseq.early_exit.thresholds import (
    TargetError,
    choose_row,
    oracle_rows,
    quantile_thresholds,
    simulate_exits,
)

# ----------------------------------------------------------------------------- whole curve


def _constructed_exits(
    n: int = 400, seed: int = 0
) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
    """Exits at layers 1, 2, 4 + final 6 on 3 classes, confidence growing with depth."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 3, (n,), generator=gen)
    out = []
    for depth, layer in enumerate((1, 2, 4, 6), start=1):
        logits = torch.randn(n, 3, generator=gen)
        logits[torch.arange(n), target] += depth * torch.rand(n, generator=gen) * 2
        out.append((layer, logits))
    return out, target


@pytest.mark.parametrize("kind", ["entropy", "maxprob"])
def test_quantile_thresholds_spread_the_mean_exit_layer(kind: str) -> None:
    exits, _ = _constructed_exits()
    thresholds = quantile_thresholds(exits, kind, 10)
    assert len(thresholds) == 10 and len(set(thresholds)) == 10
    means = [
        float(simulate_exits(exits, make_policy(kind, t))[0].double().mean()) for t in thresholds
    ]
    assert all(a > b for a, b in zip(means, means[1:])), means  # monotone
    assert means[-1] == 1.0 and means[0] > 5.0  # covers the range 6 -> 1
    expected = [6 - 5 * i / 10 for i in range(1, 11)]  # L - q (L - l_1)
    assert max(abs(m - e) for m, e in zip(means, expected)) < 0.05, means
    with pytest.raises(ValueError, match="quantiles:N"):
        quantile_thresholds(exits, kind, 0)


def test_oracle_rows_equal_a_naive_loop() -> None:
    exits, target = _constructed_exits(n=60, seed=3)
    final = exits[-1][1].argmax(-1)
    rows = oracle_rows(exits, target, batch_size=8)
    assert [r["policy"] for r in rows] == ["oracle-final", "oracle-gold"]
    for row, goal in zip(rows, (final, target)):
        layers, correct = [], 0
        for i in range(len(target)):
            hit = next(((lay, x[i].argmax()) for lay, x in exits if x[i].argmax() == goal[i]), None)
            layer, pred = hit if hit is not None else (6, final[i])
            layers.append(layer)
            correct += int(pred == target[i])
        assert row["mean_exit_layer"] == pytest.approx(sum(layers) / len(layers))
        assert row["accuracy"] == pytest.approx(100.0 * correct / len(target))
        assert row["layer_speedup"] == pytest.approx(6 / row["mean_exit_layer"])
        assert row["wall_speedup"] is None and row["batch_size"] == 8
    full_acc = 100.0 * float(final.eq(target).double().mean())
    assert rows[0]["accuracy"] == pytest.approx(full_acc)
    assert rows[1]["accuracy"] > full_acc and rows[1]["mean_exit_layer"] < 6


def _row(policy: str, threshold, accuracy: float, speedup: float) -> dict:
    return {"policy": policy, "threshold": threshold, "accuracy": accuracy,
            "layer_speedup": speedup, "examples": 100, "mean_exit_layer": 6 / speedup}  # fmt: skip


TABLE = [
    _row("none", None, 90.0, 1.0),
    _row("entropy", 0.1, 90.0, 1.2),
    _row("entropy", 0.2, 89.5, 1.8),
    _row("entropy", 0.3, 88.0, 2.5),
    _row("entropy", 0.4, 80.0, 4.0),
    _row("oracle-final", None, 90.0, 5.0),
]


def test_choose_row_for_a_target() -> None:
    assert choose_row(TABLE, max_accuracy_drop=0.5)["threshold"] == 0.2
    assert choose_row(TABLE, max_accuracy_drop=0.0)["threshold"] == 0.1
    assert choose_row(TABLE, max_accuracy_drop=2.0)["threshold"] == 0.3
    assert choose_row(TABLE, target_speedup=2.0)["threshold"] == 0.3
    assert choose_row(TABLE, target_speedup=1.8)["threshold"] == 0.2
    assert choose_row(TABLE, target_speedup=4.0)["threshold"] == 0.4  # oracle rows ignored
    with pytest.raises(TargetError, match=r"--target-speedup 5: .* largest .* 4\.00"):
        choose_row(TABLE, target_speedup=5.0)
    worse = [TABLE[0], _row("entropy", 0.5, 85.0, 3.0)]
    with pytest.raises(TargetError, match=r"--max-accuracy-drop 1 .* smallest drop .* 5\.00"):
        choose_row(worse, max_accuracy_drop=1.0)
    agreeing = [{**r, "agreement": a} for r, a in zip(TABLE, (100, 99.8, 98.5, 99.5, 80, 100))]
    assert choose_row(agreeing, max_accuracy_drop=0.5, constraint="agreement")["threshold"] == 0.3
    assert choose_row(agreeing, target_speedup=1.1, constraint="agreement")["threshold"] == 0.1
    with pytest.raises(ValueError, match="exactly one of --max-accuracy-drop and --target"):
        choose_row(TABLE, max_accuracy_drop=1.0, target_speedup=2.0)


def test_policy_file_round_trip_and_errors(tmp_path: Path) -> None:
    from acl_fairseq.inference.saved_policy import POLICY_FILE, read_policy, write_policy

    ckpt = tmp_path / "checkpoint_best.pt"
    ckpt.write_bytes(b"")
    assert read_policy(ckpt) is None
    path = write_policy(ckpt, EntropyPolicy(0.25), split="valid", accuracy=90.0)
    assert path == tmp_path / POLICY_FILE
    saved = read_policy(ckpt)
    assert saved.policy == EntropyPolicy(0.25) and saved.path == path
    assert saved.fields == {"split": "valid", "accuracy": 90.0, "checkpoint": ckpt.name}
    assert read_policy(tmp_path) == saved  # the checkpoint's folder names the same file
    path.write_text('{"policy": "entropy:x"}', encoding="utf-8")
    with pytest.raises(ValueError, match=f"{POLICY_FILE}: bad exit policy 'entropy:x'"):
        read_policy(ckpt)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{POLICY_FILE}: not valid JSON"):
        read_policy(ckpt)


def test_policy_file_with_precisions_round_trips(tmp_path: Path) -> None:
    """What predict needs to reproduce the choice: the kind and thresholds (the per-exit
    spec, its skip list), the precision, every precision's policy, how it was chosen."""
    from acl_fairseq.inference.saved_policy import POLICY_FILE, read_policy, write_policy

    ckpt = tmp_path / "checkpoint_best.pt"
    ckpt.write_bytes(b"")
    int8 = make_policy("per_exit_entropy", "1=0.05,3=0.25;patience=2")
    fp32 = make_policy("per_exit_maxprob", "2=0.95")
    chosen_by = {"target": {"max_accuracy_drop": 1.0}, "constraint": "agreement",
                 "head_cost": 0.03, "split": "valid", "examples": 600}  # fmt: skip
    write_policy(
        ckpt, int8, dtype="int8", chosen_by=chosen_by, exits=[1, 3], accuracy=90.5,
        by_dtype={"int8": {"policy": int8, "exits": [1, 3], "accuracy": 90.5},
                  "fp32": {"policy": fp32, "exits": [2], "accuracy": 91.0}},
    )  # fmt: skip
    record = json.loads((tmp_path / POLICY_FILE).read_text())
    assert record["policy"] == "per_exit_entropy:1=0.05,3=0.25;patience=2"
    assert record["by_dtype"]["fp32"] == {"policy": "per_exit_maxprob:2=0.95", "exits": [2],
                                          "accuracy": 91.0}  # fmt: skip
    saved = read_policy(ckpt)
    assert saved.policy == int8 and saved.dtype == "int8"
    assert saved.by_dtype == {"int8": int8, "fp32": fp32}
    assert saved.fields["chosen_by"] == chosen_by and saved.fields["exits"] == [1, 3]
    assert saved.for_dtype("fp32") == fp32 and saved.for_dtype("bf16") is None
    assert saved.policy_at("int8") == (int8, "")
    policy, note = saved.policy_at("bf16")
    assert policy == int8 and "chosen at int8, none for bf16" in note
    assert "--dtypes bf16" in note
    assert saved.describe().startswith("dtype int8, target {'max_accuracy_drop': 1.0}, ")
    assert saved.backend_at() is None and saved.backend_at("fp32") is None  # none recorded

    # a sweep over both backends: each precision's entry names its own, the default's on top
    write_policy(
        ckpt, int8, dtype="int8", backend="onnxruntime",
        by_dtype={"int8": {"policy": int8, "backend": "onnxruntime"},
                  "fp32": {"policy": fp32, "backend": "fairseq"}},
    )  # fmt: skip
    saved = read_policy(ckpt)
    assert saved.backend_at() == saved.backend_at("int8") == "onnxruntime"
    assert saved.backend_at("fp32") == "fairseq" and saved.backend_at("bf16") is None
    write_policy(ckpt, int8, dtype="int8", backend="onnxruntime")  # an older, one-backend file
    assert read_policy(ckpt).backend_at("int8") == "onnxruntime"
    assert read_policy(ckpt).backend_at("fp32") is None
    # a file without a precision is fp32 (older files)
    write_policy(ckpt, EntropyPolicy(0.2))
    assert read_policy(ckpt).dtype == "fp32" and read_policy(ckpt).for_dtype("fp32")
    for record, message in [
        ({"policy": "entropy:0.2", "dtype": "fp16"}, "--dtype must be one of fp32, bf16, int8"),
        ({"policy": "entropy:0.2", "by_dtype": {"int8": {"policy": "per_exit_entropy:2=x"}}},
         "bad exit policy 'per_exit_entropy:2=x'"),
        ({"policy": "entropy:0.2", "by_dtype": {"int8": "entropy:0.1"}},
         "'by_dtype' must map each dtype to an entry with a 'policy'"),
    ]:  # fmt: skip
        (tmp_path / POLICY_FILE).write_text(json.dumps(record))
        with pytest.raises(ValueError, match=f"{POLICY_FILE}: {message}"):
            read_policy(ckpt)


def test_early_exit_sweep_tables_are_readable(tmp_path):
    """The table acl-fairseq-sweep writes (TSV and CSV) is what acl-fairseq-plots reads."""

    row = {
        "batch_size": 1,
        "policy": "entropy",
        "threshold": 0.2,
        "examples": 10,
        "accuracy": 80.0,
        "mean_exit_layer": 3.5,
        "layer_speedup": 6 / 3.5,
        "full_ms": 2.0,
        "early_ms": 1.5,
        "wall_speedup": 1.33,
        "fraction_of_ideal": 0.78,
        "exit_share": {3: 0.5, 4: 0.5},
    }
    full = {**row, "policy": "none", "threshold": None, "layer_speedup": 1.0, "wall_speedup": 1.0}
    for name in ("sweep.tsv", "sweep.csv"):
        write_table([full, row], tmp_path / name)
        rows = read_sweep(tmp_path / name)
        assert [r["policy"] for r in rows] == ["none", "entropy"]
        assert rows[1]["wall_speedup"] == pytest.approx(1.33)
        assert rows[1]["layer_speedup"] == pytest.approx(6 / 3.5, rel=1e-5)
        assert rows[1]["dtype"] == "fp32" and math.isnan(rows[1]["agreement"])
    per_exit = {**row, "dtype": "int8", "policy": "per_exit_entropy", "threshold": "1=0.1,3=0.2",
                "agreement": 99.5}  # fmt: skip
    write_table([full, per_exit], tmp_path / "dtypes.tsv")
    rows = read_sweep(tmp_path / "dtypes.tsv")
    assert [r["dtype"] for r in rows] == ["fp32", "int8"]
    assert rows[1]["threshold"] == "1=0.1,3=0.2" and rows[1]["agreement"] == 99.5
    old = tmp_path / "old.tsv"  # a table written before the dtype and agreement columns
    old.write_text("batch_size\tpolicy\tthreshold\taccuracy\tmean_exit_layer\tlayer_speedup\n"
                   "1\tnone\t\t80\t6\t1\n")  # fmt: skip
    assert read_sweep(old)[0]["dtype"] == "fp32"
