"""``acl-fairseq-sweep``: table maths, timing and the deploy guards on a fake model, and its
flag checks (end to end on a trained checkpoint: test_early_exit_sweep_trained.py)."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import pytest
import torch

from acl_fairseq.cli.sweep import main as sweep_main
from acl_fairseq.early_exit.policies import ExitPolicy, make_policy
from acl_fairseq.early_exit.table import COLUMNS, format_markdown, write_table
from acl_fairseq.early_exit.thresholds import (
    TargetError,
    collect_exits,
    simulate_exits,
)
from acl_fairseq.inference.measure import sweep
from acl_fairseq.models.types import ExitOutput
from acl_fairseq.runtime.rows import EarlyExitResult

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

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"forward": 0, "early_exit": 0, "exit_outputs": 0}

    def forward(self, tokens: torch.Tensor, classification_head_name: str = HEAD):
        self.calls["forward"] += 1
        time.sleep(self.LAYER_S * self.num_layers)
        return self._logits(tokens, self.num_layers), {}

    def exit_outputs(self, tokens: torch.Tensor, classification_head_name: str = HEAD):
        self.calls["exit_outputs"] += 1
        time.sleep(self.LAYER_S * self.num_layers)
        return [
            ExitOutput(layer, self._logits(tokens, layer), None, None) for layer in (1, 2, 3, 4)
        ]

    def early_exit(
        self, tokens: torch.Tensor, policy: ExitPolicy, classification_head_name: str = HEAD
    ) -> EarlyExitResult:
        self.calls["early_exit"] += 1
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


def test_sweep_table_maths_on_fake_model(tmp_path: Path, one_thread) -> None:
    batches, rows = _fake_batches()
    exit_at, label, target = rows.unbind(1)
    policies = [make_policy("entropy", t) for t in (0.0, 0.5, math.inf)]
    table = sweep(FakeMultiExit(), batches, policies, repeats=3)
    assert [r["policy"] for r in table] == ["none", "entropy", "entropy", "entropy"]
    assert {r["dtype"] for r in table} == {"fp32"}
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
    assert always["agreement"] == pytest.approx(100.0 * float(first_pred.eq(label).float().mean()))
    assert full["agreement"] == never["agreement"] == half["agreement"] == 100.0
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
    assert len(markdown) == 2 + 4
    assert markdown[0].startswith("| dtype | batch | policy | threshold | accuracy % |")


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


def test_sweep_reuses_one_pass_and_times_only_the_loop(one_thread) -> None:
    """One exit_outputs pass gives every policy's statistics (equal to running the loop);
    the loop and the full forward run only for timing: one warm-up call on the first batch,
    then every batch once per round."""
    batches, _ = _fake_batches()
    policies = [make_policy("entropy", 0.5), make_policy("patience", 1)]
    model = FakeMultiExit()
    untimed = sweep(model, batches, policies, repeats=0)
    assert model.calls == {"forward": 0, "early_exit": 0, "exit_outputs": len(batches)}
    assert all(r["wall_speedup"] is None and r["early_ms"] is None for r in untimed)
    for policy, row in zip(policies, untimed[1:]):  # simulated = the loop's own results
        results = [model.early_exit(t, policy) for t, _ in batches]
        target = torch.cat([t for _, t in batches])
        layers = torch.cat([r.exit_layers for r in results]).double()
        correct = torch.cat([r.predictions for r in results]).eq(target).double()
        assert row["mean_exit_layer"] == pytest.approx(float(layers.mean()))
        assert row["accuracy"] == pytest.approx(100.0 * float(correct.mean()))

    model = FakeMultiExit()
    lines: list[str] = []
    timed = sweep(model, batches, policies, repeats=2, progress=lines.append)
    rounds, warmup = 2 * len(batches), 1
    assert model.calls == {
        "forward": warmup + rounds,
        "early_exit": len(policies) * (warmup + rounds),
        "exit_outputs": len(batches),
    }
    assert [r["accuracy"] for r in timed] == [r["accuracy"] for r in untimed]
    assert len(lines) == 2 and lines[1].startswith("fp32, batch 8: timed round 2/2 [")
    model = FakeMultiExit()
    given = collect_exits(model, batches, HEAD)
    sweep(model, batches, policies, repeats=0, exits=given)
    assert model.calls["exit_outputs"] == len(batches)  # the pass given is not repeated


def _sweep_precision(args, model, dtype, backend, batches, head, num_classes, target, reference,
                     thresholds):  # fmt: skip
    """One precision as the sweep runs it: calibrate, time (when --repeats), finish."""
    from acl_fairseq.cli.sweep.precision import calibrate, finish, time_all

    out, thresholds = calibrate(
        args, model, dtype, backend, batches, head, num_classes, target, reference, thresholds
    )
    if args.repeats:
        time_all([out], batches, head, args)
    finish(args, out)
    return out, thresholds


class LoggedFake(FakeMultiExit):
    """A fake that writes ``(name, call)`` to a shared ``log`` per forward / early exit, and
    whose layers cost ``scale`` times the base fake's."""

    def __init__(self, name: str, log: list, scale: float = 1.0) -> None:
        super().__init__()
        self.name, self.log, self.LAYER_S = name, log, FakeMultiExit.LAYER_S * scale

    def forward(self, tokens, classification_head_name=HEAD):
        self.log.append((self.name, "full"))
        return super().forward(tokens, classification_head_name)

    def early_exit(self, tokens, policy, classification_head_name=HEAD):
        self.log.append((self.name, policy.spec))
        return super().early_exit(tokens, policy, classification_head_name)


def test_time_together_times_several_models_in_the_same_rounds(one_thread) -> None:
    """Two models (say two precisions) and their policies: every round runs every job of both,
    in alternating order, and each row's times are its own model's; the model whose layers
    cost three times more is timed about three times slower at full depth."""
    from acl_fairseq.inference.measure import policy_rows, time_together

    batches, _ = _fake_batches()
    policies = [make_policy("entropy", t) for t in (0.5, math.inf)]
    log: list = []
    fast, slow = LoggedFake("fast", log), LoggedFake("slow", log, scale=3.0)
    runs = []
    for model in (fast, slow):
        rows = policy_rows(*collect_exits(model, batches, HEAD), policies, 8)
        runs.append((model, policies, rows))
    log.clear()
    lines: list[str] = []
    time_together(runs, batches, HEAD, repeats=2, progress=lines.append, label="batch 8")
    jobs = [(name, spec) for name in ("fast", "slow")
            for spec in ("full", "entropy:0.5", "entropy:inf")]  # fmt: skip
    warmup = jobs  # one batch each
    round_1 = [j for j in jobs for _ in batches]
    round_2 = [j for j in reversed(jobs) for _ in batches]
    assert log == warmup + round_1 + round_2
    assert len(lines) == 2 and all(line.startswith("batch 8: timed round ") for line in lines)
    (_, _, fast_rows), (_, _, slow_rows) = runs
    for rows in (fast_rows, slow_rows):
        assert rows[0]["early_ms"] == rows[0]["full_ms"] and rows[0]["wall_speedup"] == 1.0
        assert all(r["full_ms"] == rows[0]["full_ms"] for r in rows)
        assert all(r["early_ms"] > 0 and r["wall_speedup"] > 0 for r in rows)
    assert 2.0 < slow_rows[0]["full_ms"] / fast_rows[0]["full_ms"] < 4.5
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_together(runs, batches, HEAD, repeats=0)


def test_the_sweep_times_every_precision_before_it_chooses(one_thread) -> None:
    """``time_all`` over two precisions: their jobs alternate within each round; then each
    precision's saved entry has its own times."""
    from acl_fairseq.cli.sweep.cli import build_parser
    from acl_fairseq.cli.sweep.precision import calibrate, finish, time_all
    from acl_fairseq.inference.deploy import DeployTarget

    batches, _ = _fake_batches()
    args = build_parser().parse_args(
        ["ck.pt", "data", "--thresholds", "0.5", "--batch-sizes", "8", "--repeats", "1",
         "--max-accuracy-drop", "100", "--dtypes", "fp32,bf16"]
    )  # fmt: skip
    target = DeployTarget(max_accuracy_drop=100, head_cost=args.head_cost)
    log: list = []
    found, thresholds = [], None
    for name in ("fp32", "bf16"):
        model = LoggedFake(name, log, scale=1.0 if name == "fp32" else 0.5)
        out, thresholds = calibrate(
            args, model, name, "fairseq", {8: batches}, HEAD, 2, target, None, thresholds
        )
        found.append(out)
    log.clear()
    time_all(found, {8: batches}, HEAD, args)
    jobs = [
        (out.dtype, spec) for out in found for spec in ["full"] + [p.spec for p in out.policies]
    ]
    assert log == jobs + [j for j in jobs for _ in batches]  # the warm-up, then one round
    for out in found:
        finish(args, out)
        assert 0 < out.entry["ms_per_example"] < out.entry["full_ms_per_example"]
    fp32, bf16 = (out.entry["full_ms_per_example"] for out in found)
    assert bf16 < fp32  # the half-cost model, timed in the same rounds


class SlowExitFake(FakeMultiExit):
    """The fake whose early-exit loop costs more than its whole forward (exits that do not
    pay)."""

    def early_exit(self, tokens, policy, classification_head_name=HEAD):
        time.sleep(self.LAYER_S * self.num_layers * 3)
        return super().early_exit(tokens, policy, classification_head_name)


@pytest.mark.parametrize("model_class", [FakeMultiExit, SlowExitFake])
def test_sweep_deploys_no_policy_timed_slower_than_full_depth(model_class, one_thread) -> None:
    """The choice at the first batch size is timed: saved with its times when faster than
    full depth, an error naming the flags when slower (even though it saves layers)."""
    from acl_fairseq.cli.sweep.cli import build_parser
    from acl_fairseq.inference.deploy import DeployTarget

    batches, _ = _fake_batches()
    args = build_parser().parse_args(
        ["ck.pt", "data", "--thresholds", "0.5", "--batch-sizes", "8", "--repeats", "2",
         "--max-accuracy-drop", "100"]
    )  # fmt: skip
    target = DeployTarget(max_accuracy_drop=100, head_cost=args.head_cost)
    model = model_class()
    call = (args, model, "fp32", "fairseq", {8: batches}, HEAD, 2, target, None, None)
    if model_class is FakeMultiExit:
        out, _ = _sweep_precision(*call)
        assert out.entry["layer_speedup"] == 4.0  # D = 100: every row leaves at exit 1
        assert 0 < out.entry["ms_per_example"] < out.entry["full_ms_per_example"]
        return
    with pytest.raises(TargetError) as err:
        _sweep_precision(*call)
    message = str(err.value)
    assert message.startswith("entropy:inf ran ") and " ms per row at batch 8 on valid " in message
    assert "early exit would be slower than no early exit, so it is not deployed" in message
    assert "--head-cost" in message and "--repeats 0" in message


def test_head_costs_by_precision_and_backend() -> None:
    from acl_fairseq.inference.deploy import head_costs

    costs = head_costs("0.08, int8=0.15,ort=0.4")
    assert costs.default == 0.08 and costs.own == {"int8": 0.15, "onnxruntime": 0.4}
    assert costs.at("fp32") == 0.08 and costs.at("int8") == 0.15
    assert costs.at("int8", "onnxruntime") == costs.at("fp32", "onnxruntime") == 0.4
    assert head_costs("0.2,bf16=0").at("fp32", "onnxruntime") == 0.2  # no onnxruntime entry
    for bad, match in [("int4=0.1", "unknown name 'int4'"), ("int8=x", "not COST or NAME=COST"),
                       ("-1", ">= 0")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            head_costs(bad)


def test_a_precision_own_head_cost_chooses_its_policy(one_thread) -> None:
    """``--head-cost 0,fp32=0.3``: the fp32 per-exit policy is calibrated at 0.3 layers an exit
    (the one ``deploy.choose`` gives at that cost, fewer exits than at 0), recorded in its
    entry."""
    from acl_fairseq.cli.sweep.cli import build_parser
    from acl_fairseq.early_exit.thresholds import collect_exits
    from acl_fairseq.inference.deploy import DeployTarget, choose

    batches, _ = _fake_batches()
    flags = ["ck.pt", "data", "--policy", "per_exit_entropy", "--batch-sizes", "8", "--repeats",
             "0", "--max-accuracy-drop", "0"]  # fmt: skip
    model = FakeMultiExit()
    exit_logits, targets = collect_exits(model, batches, HEAD)
    chosen = {}
    for spec in ("0", "0,fp32=0.3", "0,int8=0.3"):
        args = build_parser().parse_args([*flags, "--head-cost", spec])
        target = DeployTarget(max_accuracy_drop=0, head_cost=args.head_cost.default)
        out, _ = _sweep_precision(
            args, model, "fp32", "fairseq", {8: batches}, HEAD, 2, target, None, None
        )
        chosen[spec] = out.choice.policy
        assert ("head_cost" in out.entry) == (spec != "0")
    dear = choose("per_exit_entropy", exit_logits, targets, DeployTarget(0, head_cost=0.3))
    assert chosen["0,fp32=0.3"] == dear.policy and chosen["0,int8=0.3"] == chosen["0"]
    assert len(dear.policy.layers) < len(chosen["0"].layers)


def test_sweep_target_flag_errors(tmp_path: Path, capsys) -> None:
    data = _data_dir(tmp_path / "data")
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"")
    for flags, message in [
        (["--max-accuracy-drop", "1", "--target-speedup", "2"], "not both"),
        (["--max-accuracy-drop", "-1"], "--max-accuracy-drop must be >= 0"),
        (["--target-speedup", "0.5"], "--target-speedup must be >= 1"),
        (["--thresholds", "quantiles:0"], "quantiles:N with an integer N >= 1"),
        (["--risk-control", "0.1"], "--risk-control needs --max-accuracy-drop D"),
        (["--max-accuracy-drop", "1", "--risk-control", "0.1", "--constraint", "accuracy"],
         "--risk-control certifies the agreement with the full model: drop --constraint"),
        (["--max-accuracy-drop", "1", "--risk-control", "1.5"], "DELTA must be in (0, 1)"),
        (["--target-speedup", "2", "--risk-control", "0.1"],
         "--risk-control certifies a disagreement rate: give --max-accuracy-drop D"),
        (["--patience", "2"], "--patience: beside a per-exit policy's thresholds"),
        (["--drops", "0,1"], "--drops: the rows of a calibrated policy (per_exit_*)"),
        (["--policy", "per_exit_entropy", "--thresholds", "0.1"],
         "--thresholds: --policy per_exit_entropy is calibrated on the split, not swept"),
        (["--dtypes", "fp32,fp16"], "argument --dtypes: must be one of fp32, bf16, int8"),
        (["--dtypes", "int8,int8"], "argument --dtypes: expected distinct precisions"),
        (["--repeats", "-1"], "--repeats must be >= 0"),
        (["--max-examples", "0"], "error: --max-examples must be >= 1 (the first N examples of "
         "--split), got 0; leave it out to use the whole split\n"),
        (["--head-cost", "-1", "--max-accuracy-drop", "1"], "--head-cost must be >= 0"),
        (["--backend", "fairseq,tvm"], "argument --backend: expected distinct backends among "
         "fairseq, onnxruntime, got 'fairseq,tvm'"),
        (["--backend", "fairseq,onnxruntime", "--max-accuracy-drop", "1", "--repeats", "0"],
         "--backend fairseq,onnxruntime: the backend of each precision is the one whose chosen "
         "policy runs faster, which needs timing: give --repeats 1 or more, or one --backend"),
        (["--backend", "onnxruntime,fairseq", "--target-speedup", "2"],
         "--target-speedup picks a swept row by its layer count, not by time: give one "
         "--backend with it"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as e:
            sweep_main([str(ckpt), str(data), *flags])
        assert e.value.code == 2
        assert message in capsys.readouterr().err, flags


def test_a_policy_or_table_that_cannot_be_written_stops_before_the_sweep(tmp_path, capsys):
    """The policy goes next to the checkpoint, the table to --out: a folder that takes no
    file (here a regular file in the way) stops the sweep in one line before the model loads
    (it said so only after sweeping)."""
    data = _data_dir(tmp_path / "data", ("valid",))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"not loaded")  # loading it would fail later, with another message
    code = sweep_main([str(ckpt), str(data), "--out", str(blocker / "table.tsv")])
    assert code == 2
    assert capsys.readouterr().err == (
        f"acl-fairseq-sweep: error: --out {blocker / 'table.tsv'}: cannot write there (a file "
        "is in the way of its folder): give --out a file in a folder you may write to\n"
    )
    assert not list(tmp_path.glob(".*probe*")) and blocker.read_text() == "x"
