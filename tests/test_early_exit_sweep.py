"""``acl-fairseq-sweep``: table maths on a fake model, and end to end on a checkpoint
trained by ``fairseq-train``."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import pytest
import torch

from acl_fairseq.checkpoint.inference import load_for_inference
from acl_fairseq.cli.sweep import main as sweep_main
from acl_fairseq.data.splits import load_batches
from acl_fairseq.early_exit.measure import sweep
from acl_fairseq.early_exit.policies import EntropyPolicy, ExitPolicy, make_policy
from acl_fairseq.early_exit.table import COLUMNS, format_markdown, read_sweep, write_table
from acl_fairseq.early_exit.thresholds import (
    TargetError,
    choose_row,
    collect_exits,
    exit_accuracies,
    oracle_rows,
    quantile_thresholds,
    simulate_exits,
)
from acl_fairseq.models.types import EarlyExitResult

from fairseq_helpers import BIN, TINY_MULTI_EXIT, fairseq_train, run, train_args

HEAD = "sentence_classification_head"


# ----------------------------------------------------------------------------- fake model


class FakeMultiExit(torch.nn.Module):
    """4 layers, exits at 1, 2, 3 (+ final 4); one "layer" costs ``LAYER_S`` per full batch.

    Row ``i`` of ``tokens`` is ``(e, label)``: its exits are uniform (prediction 0) before layer
    ``e`` and confident in ``label`` from layer ``e`` on. The cost of a layer is proportional to
    the rows still running, as in a batched forward.
    """

    LAYER_S = 0.002
    num_layers = 4
    shallow_exit_layers = (1, 2, 3)

    def _logits(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        confident = tokens[:, 0] <= layer
        logits = torch.zeros(tokens.size(0), 2)
        logits[confident, tokens[confident, 1]] = 20.0
        return logits

    def forward(self, tokens: torch.Tensor, classification_head_name: str = HEAD):
        time.sleep(self.LAYER_S * self.num_layers)
        return self._logits(tokens, self.num_layers), {}

    def early_exit(
        self, tokens: torch.Tensor, policy: ExitPolicy, classification_head_name: str = HEAD
    ) -> EarlyExitResult:
        bsz = tokens.size(0)
        state = policy.init_state(bsz)
        exit_layers = torch.zeros(bsz, dtype=torch.long)
        logits = torch.zeros(bsz, 2)
        for layer in range(1, self.num_layers + 1):
            running = exit_layers.eq(0)
            time.sleep(self.LAYER_S * float(running.float().mean()))
            layer_logits = self._logits(tokens, layer)
            if layer == self.num_layers:
                leave = running
            else:
                decided, state = policy.decide(layer_logits, state)
                leave = decided & running
            exit_layers[leave] = layer
            logits[leave] = layer_logits[leave]
            if not exit_layers.eq(0).any():
                break
        return EarlyExitResult(logits.argmax(-1), exit_layers, logits)


def _fake_batches() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    exit_at = torch.randint(1, 5, (24,), generator=gen)
    label = torch.randint(0, 2, (24,), generator=gen)
    target = torch.where(torch.rand(24, generator=gen) < 0.8, label, 1 - label)
    tokens = torch.stack([exit_at, label], dim=1)
    batches = [(tokens[i : i + 8], target[i : i + 8]) for i in range(0, 24, 8)]
    return batches, torch.stack([exit_at, label, target], dim=1)


@pytest.fixture
def one_thread():
    """Tiny tensors: a second OpenMP thread only adds wake-up latency on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sweep_table_maths_on_fake_model(tmp_path: Path, one_thread) -> None:
    batches, rows = _fake_batches()
    exit_at, label, target = rows.unbind(1)
    table = sweep(FakeMultiExit(), batches, "entropy", [0.0, 0.5, math.inf], repeats=3)
    assert [r["policy"] for r in table] == ["none", "entropy", "entropy", "entropy"]
    assert all(r["batch_size"] == 8 and r["examples"] == 24 for r in table)
    full, never, half, always = table
    final_acc = 100.0 * float(label.eq(target).float().mean())
    assert full["accuracy"] == pytest.approx(final_acc)
    assert full["mean_exit_layer"] == 4 and full["wall_speedup"] == 1.0
    # threshold 0 never exits early: the full model
    assert never["mean_exit_layer"] == 4 and never["accuracy"] == pytest.approx(final_acc)
    assert never["exit_share"] == {4: 1.0}
    # 0.5 < ln 2: rows leave at the first confident exit, with the final exit's prediction
    assert half["mean_exit_layer"] == pytest.approx(float(exit_at.float().mean()))
    assert half["accuracy"] == pytest.approx(final_acc)
    assert half["layer_speedup"] == pytest.approx(4 / float(exit_at.float().mean()))
    share = {int(layer): int(n) / 24 for layer, n in zip(*exit_at.unique(return_counts=True))}
    assert half["exit_share"] == pytest.approx(share)
    # inf: everyone leaves at layer 1; unconfident rows predict 0 there
    first_pred = torch.where(exit_at.eq(1), label, torch.zeros_like(label))
    assert always["mean_exit_layer"] == 1 and always["layer_speedup"] == 4
    assert always["accuracy"] == pytest.approx(100.0 * float(first_pred.eq(target).float().mean()))
    for row in table[1:]:
        # the table's derived columns are consistent (wall-clock values themselves are not
        # asserted: the machine is shared and noisy; benchmarks/ measures them)
        assert row["fraction_of_ideal"] == pytest.approx(row["wall_speedup"] / row["layer_speedup"])
        assert row["wall_speedup"] > 0 and row["early_ms"] > 0

    tsv, csv_path = tmp_path / "t.tsv", tmp_path / "sub" / "t.csv"
    write_table(table, tsv)
    write_table(table, csv_path)
    with open(tsv) as f:
        written = list(csv.DictReader(f, delimiter="\t"))
    with open(csv_path) as f:
        assert list(csv.DictReader(f)) == written
    assert list(written[0]) == list(COLUMNS) and len(written) == 4
    assert written[0]["threshold"] == "" and written[3]["threshold"] == "inf"
    assert float(written[2]["layer_speedup"]) == pytest.approx(half["layer_speedup"], rel=1e-5)
    markdown = format_markdown(table).splitlines()
    assert len(markdown) == 2 + 4 and markdown[0].startswith("| batch | policy | threshold |")


def test_simulate_exits() -> None:
    confident, unsure = [0.0, 9.0], [0.0, 0.1]
    logits = [
        (1, torch.tensor([confident, unsure, unsure])),
        (3, torch.tensor([unsure, [9.0, 0.0], unsure])),
        (6, torch.tensor([unsure, unsure, [0.0, 0.2]])),
    ]
    layers, preds = simulate_exits(logits, make_policy("entropy", 0.3))
    assert layers.tolist() == [1, 3, 6] and preds.tolist() == [1, 0, 1]
    layers, _ = simulate_exits(logits, make_policy("entropy", 0.0))
    assert layers.tolist() == [6, 6, 6]
    layers, preds = simulate_exits(logits, make_policy("patience", 1))
    assert layers.tolist() == [3, 6, 3] and preds.tolist() == [1, 1, 1]


def _data_dir(root: Path, splits: tuple[str, ...] = ("valid",)) -> Path:
    """A folder with the layout the flag checks look at (no real data)."""
    (root / "input0").mkdir(parents=True)
    for split in splits:
        (root / "input0" / f"{split}.idx").write_bytes(b"")
    return root


@pytest.mark.parametrize(
    ("policy", "thresholds", "message"),
    [
        ("maxprob", "0.9,1.5", "--thresholds: 1.5 is not a valid maxprob threshold: each must be "
         "a number in [0, 1] (--policy maxprob)"),
        ("entropy", "0.3,-0.1", "--thresholds: -0.1 is not a valid entropy threshold: each must "
         "be a number >= 0 (nats; inf always exits)"),
        ("patience", "1,1.5", "--thresholds: 1.5 is not a valid patience threshold: each must be "
         "an integer >= 0"),
        ("patience", "2,inf", "--thresholds: inf is not a valid patience threshold"),
        ("patience", "-1", "--thresholds: -1 is not a valid patience threshold"),
    ],
)  # fmt: skip
def test_bad_thresholds_stop_before_loading(tmp_path, capsys, policy, thresholds, message):
    data = _data_dir(tmp_path / "data")
    argv = ["no-such-checkpoint.pt", str(data), "--policy", policy, "--thresholds", thresholds]
    with pytest.raises(SystemExit) as exc:
        sweep_main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_split_and_checkpoint_name_the_sweeps_flags(tmp_path, capsys) -> None:
    data = _data_dir(tmp_path / "data", ("valid", "test"))
    with pytest.raises(SystemExit):
        sweep_main(["ckpt.pt", str(data), "--split", "dev"])
    err = capsys.readouterr().err
    assert f"--split dev: {data}/input0/dev.bin/.idx not found (splits there: test, valid); " in err
    assert "pick one with --split" in err and "--valid-subset" not in err
    with pytest.raises(SystemExit):
        sweep_main(["ckpt.pt", str(tmp_path / "nowhere")])
    assert "no input0/ folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep_main(["ckpt.pt", str(data), "--policy", "maxprob", "--thresholds", "0,1"])
    assert "--checkpoint ckpt.pt: no such file" in capsys.readouterr().err


def test_sweep_reports_progress_per_configuration(one_thread) -> None:
    batches, _ = _fake_batches()
    lines: list[str] = []
    sweep(FakeMultiExit(), batches, "entropy", [0.0, 0.5], repeats=2, progress=lines.append)
    assert len(lines) == 1 + 2 + 2  # full depth, each threshold, each timed round
    assert lines[0].startswith("batch ") and "full depth: accuracy" in lines[0]
    assert "entropy 0.5 (2/2): accuracy" in lines[2] and "mean exit layer" in lines[2]
    assert "timed round 2/2 [" in lines[4]


# ----------------------------------------------------------------------------- end to end

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
    model, task, _ = load_for_inference(ckpt, sentiment_data, multi_exit=True)
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
    with pytest.raises(TargetError, match=r"--max-accuracy-drop 1: .* smallest drop .* 5\.00"):
        choose_row(worse, max_accuracy_drop=1.0)
    with pytest.raises(ValueError, match="exactly one of --max-accuracy-drop and --target"):
        choose_row(TABLE, max_accuracy_drop=1.0, target_speedup=2.0)


def test_sweep_target_flag_errors(tmp_path: Path, capsys) -> None:
    data = _data_dir(tmp_path / "data")
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"")
    for flags, message in [
        (["--max-accuracy-drop", "1", "--target-speedup", "2"], "not both"),
        (["--max-accuracy-drop", "-1"], "--max-accuracy-drop must be >= 0"),
        (["--target-speedup", "0.5"], "--target-speedup must be >= 1"),
        (["--thresholds", "quantiles:0"], "quantiles:N with an integer N >= 1"),
    ]:
        with pytest.raises(SystemExit) as e:
            sweep_main([str(ckpt), str(data), *flags])
        assert e.value.code == 2
        assert message in capsys.readouterr().err, flags


def test_policy_file_round_trip_and_errors(tmp_path: Path) -> None:
    from acl_fairseq.early_exit.saved_policy import POLICY_FILE, read_policy, write_policy

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
