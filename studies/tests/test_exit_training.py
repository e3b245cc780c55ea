"""The exit-training study: its judge against a naive computation, its verdict on hand-made
numbers, and the commands of its recipes."""

import csv
import json
import math

import pytest
import torch

from acl_fairseq.early_exit.policies import parse_policy
from studies import exit_judge, exit_training, round2
from studies import phases as study


def synthetic_exits(n: int, seed: int) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
    """Six exits of two classes whose logits sharpen and agree more with depth."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, 2, (n,), generator=g)
    signal = torch.where(targets == 1, 1.0, -1.0)
    exits = []
    for layer in range(1, 7):
        margin = layer * 0.5 * signal + 2.0 * torch.randn(n, generator=g)
        exits.append((layer, torch.stack([-margin / 2, margin / 2], dim=1)))
    return exits, targets


def naive_entropy(row: torch.Tensor) -> float:
    p = torch.softmax(row.double(), -1)
    return -float(sum(q * math.log(q) for q in p.tolist() if q > 0))


def naive_run(exits, targets, thresholds: dict[int, float]) -> tuple[float, float, float]:
    """(accuracy, agreement with the final exit, mean exit layer) of per-exit thresholds, row
    by row: the first exit whose entropy is below its threshold, else the final exit."""
    correct = agree = layers = 0
    for i in range(len(targets)):
        layer, pred = 6, int(exits[-1][1][i].argmax())
        for exit_layer, logits in exits[:-1]:
            if exit_layer in thresholds and naive_entropy(logits[i]) < thresholds[exit_layer]:
                layer, pred = exit_layer, int(logits[i].argmax())
                break
        correct += pred == int(targets[i])
        agree += pred == int(exits[-1][1][i].argmax())
        layers += layer
    n = len(targets)
    return 100.0 * correct / n, 100.0 * agree / n, layers / n


def test_the_judge_against_a_naive_computation():
    dev, dev_t = synthetic_exits(300, 1)
    test, test_t = synthetic_exits(500, 2)
    j = exit_judge.judge(dev, dev_t, test, test_t)
    final = test[-1][1].argmax(-1)
    for layer, logits in test:
        acc = 100.0 * sum(int(a == b) for a, b in zip(logits.argmax(-1), test_t)) / 500
        assert j["exits"]["test"][str(layer)] == pytest.approx(acc, abs=1e-3)
        if layer < 6:
            agree = 100.0 * sum(int(a == b) for a, b in zip(logits.argmax(-1), final)) / 500
            assert j["agreement_with_final_test"][str(layer)] == pytest.approx(agree, abs=1e-3)
    oracle = [
        next(layer for layer, logits in test if logits[i].argmax() == final[i]) for i in range(500)
    ]
    assert j["oracle_test"]["layer_speedup"] == pytest.approx(6 / (sum(oracle) / 500), abs=1e-3)

    rule = j["judge"]
    policy = parse_policy(rule["policy"])
    assert policy.kind == "per_exit_entropy" and policy.patience is None
    thresholds = dict(zip(policy.layers, policy.thresholds))
    dev_acc, dev_agree, dev_layer = naive_run(dev, dev_t, thresholds)
    assert dev_agree >= 100.0 - exit_judge.RULE_DROP  # the agreement constraint, on dev
    assert dev_layer < 6  # it leaves early on these exits
    assert rule["dev"]["agreement"] == pytest.approx(dev_agree, abs=1e-3)
    assert rule["dev"]["mean_exit_layer"] == pytest.approx(dev_layer, abs=1e-3)
    test_acc, test_agree, test_layer = naive_run(test, test_t, thresholds)
    assert rule["test"]["accuracy"] == pytest.approx(test_acc, abs=1e-3)
    assert rule["test"]["agreement"] == pytest.approx(test_agree, abs=1e-3)
    assert rule["test"]["layer_speedup"] == pytest.approx(6 / test_layer, abs=1e-3)
    # a looser target leaves no later on dev: the same search, described beside the rule
    looser = j["other_targets"]["2"]["dev"]["mean_exit_layer"]
    assert looser <= rule["dev"]["mean_exit_layer"] + 1e-9


def fake_judge(full: float, accuracy: float, speedup: float) -> dict:
    return {"judge": {"test": {"full_accuracy": full, "accuracy": accuracy,
                               "layer_speedup": speedup}}}  # fmt: skip


def test_the_verdict_is_against_the_best_full_depth_of_the_study():
    """The floor is 0.5 under the best recipe's mean full depth, not a recipe's own."""
    study_runs = {
        "control": [fake_judge(85.0, 84.8, 2.2), fake_judge(85.4, 85.2, 2.3)],  # full 85.2
        "fast": [fake_judge(84.0, 84.8, 3.4), fake_judge(84.2, 84.6, 3.0)],  # its own within
        "good": [fake_judge(85.0, 84.8, 3.1), fake_judge(85.0, 84.6, 2.95)],
    }
    v = exit_judge.verdicts(study_runs, seeds=2, num_recipes=3)
    assert v["reference_recipe"] == "control"
    assert v["reference_accuracy"] == pytest.approx(85.2)
    assert v["floor"] == pytest.approx(84.7)
    fast, good = v["recipes"]["fast"], v["recipes"]["good"]
    assert fast["accuracy"] == pytest.approx(84.7) and fast["within_margin"]
    assert fast["layer_speedup"] == pytest.approx(3.2) and fast["met"]
    assert fast["seeds_within_margin"] == 1
    assert good["layer_speedup"] == pytest.approx(3.025) and good["accuracy"] == pytest.approx(84.7)
    assert good["met"] and v["met"] and v["outcome"] == "met" and v["complete"]
    assert not v["recipes"]["control"]["met"]  # within the floor, not fast enough
    assert v["recipes"]["control"]["outcome"] == "missed"
    # a recipe short of its seeds, or a study short of its recipes, has no verdict
    short = exit_judge.verdicts(study_runs, seeds=3, num_recipes=3)
    assert not short["met"] and short["outcome"] == "no verdict (incomplete)"
    assert {r["outcome"] for r in short["recipes"].values()} == {"no verdict (incomplete)"}
    assert (short["runs"], short["runs_expected"]) == (6, 9)
    assert exit_judge.verdicts(study_runs, seeds=2, num_recipes=5)["outcome"] == "met"
    slower = {**study_runs, "good": [fake_judge(85.0, 84.8, 3.1), fake_judge(85.0, 84.6, 2.8)]}
    slower["fast"] = [fake_judge(84.0, 84.6, 3.4), fake_judge(84.2, 84.6, 3.0)]  # 84.6 < floor
    v = exit_judge.verdicts(slower, seeds=2, num_recipes=3)
    assert not v["recipes"]["good"]["met"] and not v["recipes"]["fast"]["met"] and not v["met"]
    assert v["outcome"] == "missed"
    incomplete = exit_judge.verdicts(slower, seeds=2, num_recipes=4)
    assert incomplete["outcome"] == "no verdict (incomplete)"


def test_each_recipe_is_one_flag_set_over_the_study_s_stage_1(tmp_path, monkeypatch):
    """The recipes' compare arguments: the stage-2 ones restore the lambda phase's ACL run with
    its own flags (so compare reuses it), and differ from the control only where the protocol
    says; joint-from-start restores MiniLM, with stage 1's patience and no ACL."""
    calls: list[tuple[str, list[str]]] = []

    def record(self, out, args):
        calls.append((str(out.relative_to(tmp_path / "runs")), list(args)))

    monkeypatch.setattr(study.Study, "compare", record)
    monkeypatch.setattr(round2, "count_examples", lambda data: 7968)
    monkeypatch.setattr(exit_training, "link_run", lambda *a: None)
    monkeypatch.setattr(exit_training, "need_checkpoints", lambda *a: [])
    monkeypatch.setattr(exit_training.ExitTraining, "judged", lambda self, run_dir: None)
    monkeypatch.setattr(exit_training.ExitTraining, "timed", lambda self, d, k, work: work())
    round2.Round2(tmp_path, "lambda", methods=["acl"], seeds=[2]).lambda_study()
    (_, stage1), *_ = calls
    stage1 = stage1[: stage1.index("--lambdas")]  # the lambda phase's acl run of seed 2
    calls.clear()
    exit_training.ExitTraining(tmp_path, seeds=[2]).run()
    assert [folder for folder, _ in calls] == [f"exit-training/{n}" for n in exit_training.RECIPES]
    args = dict((folder.split("/")[1], a) for folder, a in calls)

    def flag(a: list[str], name: str) -> str | None:
        return a[a.index(name) + 1] if name in a else None

    for name in ("control", "long-uniform", "long-reverse", "long-alternating"):
        a = args[name]
        assert a[: len(stage1) - 4] == stage1[:-4]  # everything but --methods acl --seeds 2
        assert flag(a, "--methods") == "acl_cl" and flag(a, "--seeds") == "2"
        assert flag(a, "--acl-cl-teacher") == "frozen"
        assert flag(a, "--cross-layer-weighting") == "exit"
        assert flag(a, "--cross-layer-lambda") == "0.5"
    assert flag(args["control"], "--stage2-epochs") == "1"
    assert "--exit-weighting" not in args["control"]
    for name, weighting in (("long-uniform", "uniform"), ("long-reverse", "reverse"),
                            ("long-alternating", "uniform")):  # fmt: skip
        assert flag(args[name], "--stage2-epochs") == "2"
        assert flag(args[name], "--exit-weighting") == weighting
    alternating = [a for a in args["long-alternating"] if a.startswith("--stage2-extra")]
    assert alternating == ["--stage2-extra=--alternate-exits"]
    assert not any(a.startswith("--stage2-extra") for a in args["long-uniform"])
    start = args["joint-from-start"]
    assert flag(start, "--methods") == "joint_from_start" and flag(start, "--epochs") == "3"
    assert flag(start, "--exit-weighting") == "uniform" and "--stage2-epochs" not in start
    assert flag(start, "--extra") == "--group-by-length --patience 4"  # no ACL angle log
    assert flag(start, "--restore-file") == flag(stage1, "--restore-file")
    assert flag(start, "--lr") == flag(stage1, "--lr") == "0.0002"
    with pytest.raises(SystemExit, match="--methods"):
        exit_training.ExitTraining(tmp_path, methods=["acl_cl"]).run()


def test_cpu_time_is_recorded_once_per_run(tmp_path):
    run_dir = tmp_path / "run"
    chain = exit_training.ExitTraining.__new__(exit_training.ExitTraining)
    spent = []

    def work():
        spent.append(sum(i * i for i in range(200_000)))
        (run_dir / "test.json").parent.mkdir(parents=True, exist_ok=True)
        (run_dir / "test.json").write_text("{}")

    chain.timed(run_dir, "train_eval", work)
    first = (run_dir / "cpu.json").read_text()
    assert '"train_eval"' in first and '"cpu_s"' in first
    chain.timed(run_dir, "train_eval", work)  # done before: run (to check) but not re-timed
    assert (run_dir / "cpu.json").read_text() == first and len(spent) == 2
    chain.timed(run_dir, "judge", work, done_before=False)  # a finished run's judge: timed
    record = json.loads((run_dir / "cpu.json").read_text())
    assert set(record) >= {"train_eval", "judge"} and record["judge"]["cpu_s"] >= 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "test.json").write_text("{}")  # finished before this call: not timed
    chain.timed(other, "train_eval", lambda: None)
    assert not (other / "cpu.json").exists()


def test_the_report_writes_every_judged_run_and_the_verdict(tmp_path):
    work, out = tmp_path / "work", tmp_path / "docs"
    for i, (name, seed) in enumerate([("control", 1), ("control", 2), ("long-uniform", 1)]):
        run_dir = work / "runs" / "exit-training" / name / "runs" / f"acl_cl-seed{seed}"
        run_dir.mkdir(parents=True)
        dev, dev_t = synthetic_exits(200, 10 + i)
        test, test_t = synthetic_exits(300, 20 + i)
        (run_dir / "judge.json").write_text(json.dumps(exit_judge.judge(dev, dev_t, test, test_t)))
        (run_dir / "test.json").write_text(json.dumps({"dev": {"num_updates": 186.0}}))
        (run_dir / "cpu.json").write_text(json.dumps(
            {"train_eval": {"cpu_s": 600.0, "wall_s": 1200.0}, "judge": {"cpu_s": 40.0},
             "commit": "735cb07abc"}
        ))  # fmt: skip
        (run_dir / "command.txt").write_text(
            f"{tmp_path}/ck/.venv/bin/fairseq-train {work}/data/movie-bin --user-dir "
            f"{tmp_path}/ck/acl_fairseq --save-dir {work}/runs/x\n"
        )
        listed = ["fairseq-train", "--user-dir", f"{tmp_path}/ck/acl_fairseq"]  # run.json's form
        (run_dir / "run.json").write_text(json.dumps({"train_command": listed}, indent=1))
    verdict = exit_training.report(work, out)
    assert set(verdict["recipes"]) == {"control", "long-uniform"}
    with open(out / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["recipe"], r["seed"]) for r in rows] == [
        ("control", "1"), ("control", "2"), ("long-uniform", "1")
    ]  # fmt: skip
    assert rows[0]["cpu_min"] == "10.0" and rows[0]["best_update"] == "186"
    assert rows[0]["commit"] == "735cb07"
    readme = (out / "README.md").read_text()
    assert "| control | 2 |" in readme and "| long-uniform | 1 |" in readme
    assert f"**{verdict['outcome']}** (3 of 15 runs)" in readme  # 5 recipes x 3 seeds
    assert verdict["outcome"] == "no verdict (incomplete)"
    command = (out / "runs" / "control" / "acl_cl-seed1" / "command.txt").read_text()
    assert str(tmp_path) not in command
    assert command.startswith("<repo>/.venv/bin/fairseq-train <work>/data/movie-bin")
    listed = (out / "runs" / "control" / "acl_cl-seed1" / "run.json").read_text()
    assert str(tmp_path) not in listed and '"<repo>/acl_fairseq"' in listed
    assert json.loads((out / "verdict.json").read_text())["floor"] == pytest.approx(
        verdict["floor"]
    )
