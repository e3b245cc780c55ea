"""acl-fairseq-compare (multi-seed method comparison) and acl-fairseq-plots (its pictures).

Fast tests: the table maths (mean, sample std, formatting), the run plan and the fairseq-train
command lines, the report built from hand-written ``test.json`` files, and the plots that need
no model. The slow test runs acl-fairseq-compare for real on a tiny generated dataset (every
method, one seed, a few updates each, plus a 2-value lambda sweep of acl), checks that the
report's numbers are the runs' own, that a repeated invocation trains nothing, and draws every plot.
"""

import csv
import json
import math
import re
import shlex
import struct
from pathlib import Path

import pytest

from acl_fairseq import fairseq_log
from acl_fairseq.acl_grad import AngleRecord, read_angle_log
from acl_fairseq.cli.compare import cli as compare_cli
from acl_fairseq.cli.compare import plan, report
from acl_fairseq.cli.compare import run as runner
from acl_fairseq.cli.plots import cli as plots
from acl_fairseq.early_exit import table as sweep_table

from fairseq_helpers import BIN, TINY_ROBERTA, run, write_sentiment_split

# ----------------------------------------------------------------------------- table maths


def test_summarize_known_numbers():
    mean, std, n = report.summarize([80.0, 82.0, 84.0])
    assert (mean, std, n) == (82.0, 2.0, 3)  # sample std: sqrt((4 + 0 + 4) / 2)
    mean, std, n = report.summarize([70.0, 71.0])
    assert mean == 70.5 and std == pytest.approx(math.sqrt(0.5)) and n == 2
    mean, std, n = report.summarize([81.3])
    assert mean == 81.3 and math.isnan(std) and n == 1
    assert report.summarize([])[2] == 0


def test_formatting():
    assert report.fmt(82.0) == "82.00"
    assert report.fmt(0.70710678) == "0.71"
    assert report.fmt(math.nan) == "-" and report.fmt(None) == "-"
    assert report.fmt_mean_std([80.0, 82.0, 84.0]) == "82.00 ± 2.00"
    assert report.fmt_mean_std([81.25]) == "81.25"
    assert report.fmt_mean_std([]) == "-"
    assert report.fmt_mean_std([10.0, 20.0], digits=1) == "15.0 ± 7.1"


def test_markdown_table_mean_std_and_seeds():
    rows = [
        report.Row("ce", {1: 80.0, 2: 82.0, 3: 84.0}),
        report.Row("acl", {1: 90.0, 3: 91.0}),  # seed 2 missing
    ]
    lines = report.markdown_table(["method"], rows)
    assert lines[0] == "| method | mean | std | n | seed 1 | seed 2 | seed 3 |"
    assert lines[2] == "| ce | 82.00 | 2.00 | 3 | 80.00 | 82.00 | 84.00 |"
    assert lines[3] == "| acl | 90.50 | 0.71 | 2 | 90.00 | - | 91.00 |"


def test_best_dev_takes_the_last_of_tied_maxima():
    log = "\n".join(
        [
            '2026 | INFO | valid | {"epoch": 1, "valid_accuracy": "70", "valid_num_updates": "2"}',
            '2026 | INFO | train_inner | {"epoch": 1, "accuracy": "99", "num_updates": "3"}',
            '2026 | INFO | valid | {"epoch": 1, "valid_accuracy": "75.5", '
            '"valid_accuracy_exit1": "60", "valid_num_updates": "4"}',
            '2026 | INFO | valid | {"epoch": 1, "valid_accuracy": "75.5", '
            '"valid_accuracy_exit1": "65", "valid_num_updates": "6"}',
            '2026 | INFO | valid | {"epoch": 1, "valid_accuracy": "71", "valid_num_updates": "8"}',
        ]
    )
    best = fairseq_log.best_dev(log)
    assert best["accuracy"] == 75.5 and best["accuracy_exit1"] == 65.0
    assert best["num_updates"] == 6.0


def test_angle_summary():
    rows = [AngleRecord(u, a, bool(k), math.nan) for u, a, k in
            [(0, 30.0, 1), (1, 100.0, 0), (2, 95.0, 1), (3, 35.0, 1)]]  # fmt: skip
    s = report.angle_summary(rows)
    assert s == {"updates": 4, "mean_angle": 65.0, "pct_over_90": 50.0, "pct_dropped": 25.0}
    assert report.angle_summary([]) is None


# ----------------------------------------------------------------------------- plan, commands


def test_plan_adds_stage1_and_reuses_the_main_lambda():
    runs = plan.plan_runs(["acl_cl"], [1, 2], 0.5)
    assert [r.name for r in runs] == ["acl-seed1", "acl_cl-seed1", "acl-seed2", "acl_cl-seed2"]
    assert runs[1].stage1 == runs[0]
    runs = plan.plan_runs(list(plan.METHODS), [1], 0.5, [0.1, 0.5, 1.0])
    names = [r.name for r in runs]
    assert names == [
        "ce-seed1",
        "ce_scl-seed1",
        "acl-seed1",
        "multi_exit_joint-seed1",
        "acl_cl-seed1",
        "ce_scl-lam0.1-seed1",
        "ce_scl-lam1-seed1",
        "acl-lam0.1-seed1",
        "acl-lam1-seed1",
    ]
    assert runs[3].stage1.name == "ce-seed1" and runs[4].stage1.name == "acl-seed1"
    with pytest.raises(ValueError, match="unknown method"):
        plan.plan_runs(["bert"], [1], 0.5)


def test_arch_args():
    args = plan.read_arch_args(
        None, "--arch roberta --restore-file x.pt --reset-optimizer --encoder-layers 6"
    )
    assert args == ["--arch", "roberta", "--encoder-layers", "6"]
    assert plan.multi_exit_arch(args)[:2] == ["--arch", "multi_exit_roberta"]
    assert plan.multi_exit_arch(["--arch=roberta_base"]) == ["--arch=multi_exit_roberta_base"]
    assert plan.multi_exit_arch(["--arch", "multi_exit_roberta_tiny"])[1] == (
        "multi_exit_roberta_tiny"
    )
    with pytest.raises(SystemExit, match="no multi-exit variant"):
        plan.multi_exit_arch(["--arch", "transformer"])
    with pytest.raises(SystemExit, match="no --arch"):
        plan.read_arch_args(None, "--encoder-layers 2")


def _opts(tmp_path, *extra):
    opts = compare_cli.build_parser().parse_args(
        [str(tmp_path / "data"), "--arch-args", " ".join(TINY_ROBERTA), "--out",
         str(tmp_path / "R"), *extra]
    )  # fmt: skip
    opts.out = opts.out.resolve()
    opts.data = opts.data.resolve()
    opts.arch_args = plan.read_arch_args(None, opts.arch_args)
    opts.extra_args = shlex.split(opts.extra)
    opts.num_classes, opts.n_train, opts.cpu = 2, 100, True
    return opts


def _flag(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_train_commands(tmp_path):
    opts = _opts(tmp_path, "--restore-file", str(tmp_path / "model.pt"), "--extra=--fp16")
    (tmp_path / "model.pt").write_text("")
    assert plan.total_updates(opts) == 7  # ceil(100 / 16)

    def cmd(method, lam=0.5):
        run_ = plan.Run(method, 3, lam if method in plan.CONTRASTIVE_METHODS else None)
        return runner.train_command(run_, opts, opts.out / "runs" / run_.name)

    ce = cmd("ce")
    assert _flag(ce, "--criterion") == "sentence_prediction"
    assert _flag(ce, "--task") == "acl_sentence_prediction"  # the plugin's input checks run
    assert _flag(ce, "--arch") == "multi_exit_roberta" and _flag(ce, "--exit-layers") == "none"
    assert _flag(ce, "--restore-file") == str(tmp_path / "model.pt")
    assert _flag(ce, "--seed") == "3" and _flag(ce, "--total-num-update") == "7"
    assert _flag(ce, "--exit-pooling") == "mean" and ce[-1] == "--fp16"
    ce_scl = cmd("ce_scl")
    assert "--acl-grad" in ce_scl and _flag(ce_scl, "--acl-grad-threshold") == "180"
    assert _flag(ce_scl, "--acl-grad-log").endswith("ce_scl-seed3/angles.tsv")
    acl = cmd("acl", 0.1)
    assert _flag(acl, "--criterion") == "acl_embed" and _flag(acl, "--acl-grad-threshold") == "90"
    assert _flag(acl, "--contrastive-lambda") == "0.1"
    joint = cmd("multi_exit_joint")
    assert _flag(joint, "--criterion") == "multi_exit_ce" and "--exit-layers" not in joint
    assert _flag(joint, "--restore-file") == str(opts.out / "runs/ce-seed3/checkpoint_best.pt")
    acl_cl = cmd("acl_cl")
    assert _flag(acl_cl, "--criterion") == "acl_cross_layer"
    assert _flag(acl_cl, "--restore-file") == str(opts.out / "runs/acl-seed3/checkpoint_best.pt")
    assert "--reset-optimizer" in acl_cl
    # the best checkpoint is saved at every validation, not only at the end of an epoch
    assert _flag(ce, "--save-interval-updates") == _flag(ce, "--validate-interval-updates")
    assert _flag(ce, "--keep-interval-updates") == "1"
    assert "--frozen-teacher" not in acl_cl and "--cross-layer-weighting" not in acl_cl

    stage2 = _opts(
        tmp_path, "--stage2-epochs", "2", "--acl-cl-teacher", "frozen",
        "--cross-layer-weighting", "uniform", "--exit-weighting", "uniform",
        "--extra", "--patience 4", "--epochs", "3",
    )  # fmt: skip
    for method in ("multi_exit_joint", "acl_cl"):
        run_ = plan.Run(method, 3, 0.5 if method == "acl_cl" else None)
        command = runner.train_command(run_, stage2, stage2.out / "runs" / run_.name)
        assert _flag(command, "--max-epoch") == "2" and "--patience" not in command
        assert _flag(command, "--total-num-update") == "14"  # 2 epochs x ceil(100 / 16)
        assert _flag(command, "--exit-weighting") == "uniform"
    assert _flag(command, "--frozen-teacher") == str(
        stage2.out / "runs/acl-seed3/checkpoint_best.pt"
    )
    assert _flag(command, "--cross-layer-weighting") == "uniform"
    command = runner.train_command(plan.Run("ce", 3, None), stage2, tmp_path)
    assert _flag(command, "--max-epoch") == "3" and _flag(command, "--patience") == "4"

    plain = _opts(tmp_path, "--ce-scl-plain")
    run_ = plan.Run("ce_scl", 1, 0.5)
    assert "--acl-grad" not in runner.train_command(run_, plain, tmp_path)
    assert "--restore-file" not in runner.train_command(plan.Run("ce", 1, None), plain, tmp_path)


def test_a_best_checkpoint_from_another_update_than_the_best_dev_record_stops(tmp_path):
    import torch

    best = tmp_path / "checkpoint_best.pt"
    torch.save({"optimizer_history": [{"num_updates": 40}]}, best)
    runner.check_best_checkpoint(best, {"accuracy": 80.0, "num_updates": 40.0})
    with pytest.raises(runner.RunFailed, match="saved at update 40, but the best dev"):
        runner.check_best_checkpoint(best, {"accuracy": 80.0, "num_updates": 30.0})


def _fake_data(root: Path, n_train: int = 40) -> Path:
    """Just enough of a binarized dataset for the compare plan: index headers, labels."""
    (root / "input0").mkdir(parents=True)
    (root / "label").mkdir()
    for split, n in (("train", n_train), ("valid", 8), ("test", 8)):
        header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + b"\x01" + struct.pack("<Q", n)
        (root / "input0" / f"{split}.idx").write_bytes(header)
    (root / "label" / "dict.txt").write_text("neg 20\npos 20\nmadeupword0000 0\n")
    return root


def test_help_texts():
    text = compare_cli.build_parser().format_help()
    assert "--lambdas" in text and "(default: 1,2,3)" in text
    assert "--sweep-tsv" in plots.build_parser().format_help()


def test_dataset_counts(tmp_path):
    data = _fake_data(tmp_path / "data")
    assert plan.count_examples(data, "train") == 40
    assert plan.count_classes(data) == 2
    with pytest.raises(SystemExit, match="not found"):
        plan.count_examples(data, "valid1")


def test_stage2_is_retrained_when_its_stage1_was(tmp_path, monkeypatch, capsys):
    data = _fake_data(tmp_path / "data")
    calls = []

    def fake_execute(run_, opts, progress, index, force=False):
        calls.append((run_.name, force))
        return "trained" if run_.name == "acl-seed1" else "skipped"

    monkeypatch.setattr(compare_cli, "execute", fake_execute)
    args = [str(data), "--arch-args", " ".join(TINY_ROBERTA), "--out", str(tmp_path / "R")]
    assert compare_cli.main([*args, "--seeds", "1", "--cpu"]) == 0
    assert calls == [
        ("ce-seed1", False),
        ("ce_scl-seed1", False),
        ("acl-seed1", False),
        ("multi_exit_joint-seed1", False),  # its stage 1 (ce) was done before
        ("acl_cl-seed1", True),  # its stage 1 (acl) was trained again
    ]
    assert "1 trained, 0 only evaluated, 4 done before, 0 failed" in capsys.readouterr().out
    assert "No finished run yet" in (tmp_path / "R" / "results.md").read_text()


# ----------------------------------------------------------------------------- report


def _fake_run(out, method, seed, dev, test, lam=None, sweep=False, exits=None, angles=None):
    name = plan.Run(method, seed, lam, sweep).name
    d = out / "runs" / name
    d.mkdir(parents=True)
    result = {
        "run": name,
        "method": method,
        "seed": seed,
        "lambda": lam,
        "sweep": sweep,
        "acl_grad_threshold": 90.0 if angles else None,
        "dev": {"accuracy": dev, "loss": 0.5},
        "test": {"accuracy": test, "loss": 0.6, **(exits or {})},
        "angles": angles,
    }
    (d / "test.json").write_text(json.dumps(result))
    if angles:
        (d / "angles.tsv").write_text("0\t30.0\t1\n1\t100.0\t0\n2\t95.0\t1\n")
    return result


def _fake_results(out):
    for seed, (dev, test) in enumerate([(80, 79), (82, 81), (84, 83)], start=1):
        _fake_run(out, "ce", seed, dev, test)
        ang = {"updates": 3, "mean_angle": 75.0, "pct_over_90": 66.7, "pct_dropped": 33.3}
        _fake_run(out, "acl", seed, dev + 2, test + 2, lam=0.5, angles=ang)
        _fake_run(out, "acl", seed, dev + 3, test + 1, lam=1.0, sweep=True)
        _fake_run(out, "acl", seed, dev - 5, test - 5, lam=0.1, sweep=True)
        exits = {"accuracy_exit1": 60.0 + seed, "accuracy_exit2": float(test)}
        _fake_run(out, "multi_exit_joint", seed, dev, test, exits=exits)
        exits = {"accuracy_exit1": 70.0 + seed, "accuracy_exit2": test + 1.0}
        _fake_run(out, "acl_cl", seed, dev, test + 1, lam=0.5, exits=exits)


def _table(md, title):
    """Rows (lists of cells) of the first Markdown table after the heading ``title``."""
    lines = md.split(title + "\n", 1)[1].strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_report_tables(tmp_path):
    out = tmp_path / "R"
    _fake_results(out)
    report.write_report(out)
    md = (out / "results.md").read_text()
    test = {r[0]: r[1:] for r in _table(md, "## Test accuracy")}
    assert set(test) == {"ce", "acl (λ 0.5)", "multi_exit_joint", "acl_cl (λ 0.5)"}
    assert test["ce"] == ["81.00", "2.00", "3", "79.00", "81.00", "83.00"]
    assert test["acl (λ 0.5)"] == ["83.00", "2.00", "3", "81.00", "83.00", "85.00"]
    dev = {r[0]: r[1:] for r in _table(md, "## Dev accuracy")}
    assert dev["ce"][:3] == ["82.00", "2.00", "3"]
    exits = _table(md, "## Test accuracy per exit (multi-exit methods)")
    assert exits[0] == ["multi_exit_joint", "1", "62.00", "1.00", "3", "61.00", "62.00", "63.00"]
    assert ["acl_cl (λ 0.5)", "2 (final)", "82.00", "2.00", "3", "80.00", "82.00", "84.00"] in exits
    curve = {r[0]: r[1:] for r in _table(md, "Layer-score curve (test accuracy, mean ± std):")}
    assert curve["acl_cl"] == ["72.00 ± 1.00", "82.00 ± 2.00"]
    # lambda sweep: 0.5 is the main run; 1.0 has the best mean dev accuracy
    sweep = {(r[0], r[1]): r[2:] for r in _table(md, "### Test accuracy")}
    assert set(sweep) == {("acl", "0.1"), ("acl", "0.5"), ("acl", "1")}
    assert sweep[("acl", "1")][:3] == ["82.00", "2.00", "3"]
    chosen = _table(md, "### Lambda chosen on dev (highest mean dev accuracy), reported on test")
    assert chosen == [["acl", "1", "85.00 ± 2.00", "82.00 ± 2.00"]]
    angles = _table(md, "## ACL-Grad angles during training")
    assert angles == [["acl (λ 0.5)", "90°", "3", "75.0 ± 0.0", "66.7 ± 0.0", "33.3 ± 0.0"]]
    # results.csv: every per-seed number; summary.csv: mean / std / n
    with open(out / "results.csv") as f:
        per_run = list(csv.DictReader(f))
    row = next(r for r in per_run if r["run"] == "acl_cl-seed2" and r["metric"] == "accuracy_exit1")
    assert (row["split"], float(row["value"])) == ("test", 72.0)
    with open(out / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    row = next(
        r for r in summary if (r["method"], r["lambda"], r["split"], r["metric"])
        == ("acl", "0.1", "test", "accuracy")
    )  # fmt: skip
    assert (float(row["mean"]), float(row["std"]), row["n"]) == (76.0, 2.0, "3")


# ----------------------------------------------------------------------------- plots, no model


def test_plots_from_results_without_models(tmp_path, capsys):
    out = tmp_path / "R"
    _fake_results(out)
    sweep = tmp_path / "sweep.csv"
    sweep.write_text(
        "policy,threshold,batch_size,accuracy,mean_exit_layer,layer_speedup,wallclock_speedup\n"
        "none,,1,85.0,6,1.0,1.0\nentropy,0.1,1,84.5,4.0,1.5,1.3\nentropy,0.3,1,80.0,2.0,3.0,2.4\n"
        "none,,32,85.0,6,1.0,1.0\nentropy,0.1,32,84.5,4.0,1.5,1.1\n"
    )
    assert plots.main([str(out), "--sweep-tsv", f"acl_cl={sweep}"]) == 0
    printed = capsys.readouterr().out
    assert "skipped (d) t-SNE of pooled features: needs --data" in printed
    for name in ("angles", "layer_scores", "early_exit", "lambda"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 0
        assert (out / "plots" / f"{name}.csv").exists()
    with open(out / "plots" / "layer_scores.csv") as f:
        rows = {(r["method"], r["layer"]): r for r in csv.DictReader(f)}
    assert float(rows[("acl_cl", "1")]["mean"]) == 72.0
    assert float(rows[("acl_cl", "1")]["std"]) == 1.0
    with open(out / "plots" / "angles_summary.csv") as f:
        (acl,) = list(csv.DictReader(f))
    assert acl["method"] == "acl" and acl["updates"] == "9"
    assert float(acl["frac_over_90"]) == pytest.approx(2 / 3)
    with open(out / "plots" / "lambda.csv") as f:
        rows = list(csv.DictReader(f))
    assert [
        (r["method"], r["lambda"], r["chosen_on_dev"]) for r in rows if r["method"] == "acl"
    ] == [
        ("acl", "0.1", "0"),
        ("acl", "0.5", "0"),
        ("acl", "1", "1"),
    ]
    # nothing to draw from: every plot says why it was skipped
    empty = tmp_path / "empty"
    (empty / "runs").mkdir(parents=True)
    assert plots.main([str(empty)]) == 0
    assert capsys.readouterr().out.count("skipped") == 5


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
        sweep_table.write_table([full, row], tmp_path / name)
        rows = plots.read_sweep(tmp_path / name)
        assert [r["policy"] for r in rows] == ["none", "entropy"]
        assert rows[1]["wall_speedup"] == pytest.approx(1.33)
        assert rows[1]["layer_speedup"] == pytest.approx(6 / 3.5, rel=1e-5)


# ----------------------------------------------------------------------------- end to end


def make_data_with_test(root: Path) -> Path:
    """train 64 / valid (dev) 32 / test 32, binarized in the sentence_prediction layout."""
    raw = root / "raw"
    raw.mkdir(parents=True)
    for split, n, seed in (("train", 64, 0), ("valid", 32, 1), ("test", 32, 2)):
        write_sentiment_split(raw / split, n, seed)
    dest = root / "bin"
    for field in ("input0", "label"):
        run(
            [
                str(BIN / "fairseq-preprocess"), "--only-source",
                "--trainpref", str(raw / f"train.{field}"),
                "--validpref", str(raw / f"valid.{field}"),
                "--testpref", str(raw / f"test.{field}"),
                "--destdir", str(dest / field), "--workers", "1",
            ]
        )  # fmt: skip
    return dest


def _cells(md: str, title: str) -> dict[str, list[str]]:
    return {r[0]: r for r in _table(md, title)}


@pytest.mark.slow
def test_compare_then_plots_end_to_end(tmp_path):
    data = make_data_with_test(tmp_path)
    out = tmp_path / "RESULTS"
    base = [
        str(BIN / "acl-fairseq-compare"), str(data),
        "--arch-args", " ".join(TINY_ROBERTA), "--restore-file", "none",
        "--seeds", "1", "--lr", "1e-3", "--log-interval", "1", "--out", str(out), "--cpu",
    ]  # fmt: skip
    first = run(base, timeout=1800)
    assert "5 trained, 0 only evaluated, 0 done before, 0 failed" in first
    # the lambda sweep of acl adds one run; lambda 0.5 is the main acl run, not trained again
    sweep = run([*base, "--methods", "acl", "--lambdas", "0.1,0.5"], timeout=1800)
    assert "1 trained, 0 only evaluated, 1 done before, 0 failed" in sweep
    assert not (out / "runs" / "acl-lam0.1-seed1" / "checkpoint_best.pt").exists()
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/test.json")}
    assert len(stamps) == 6
    again = run(base, timeout=600)
    assert "0 trained, 0 only evaluated, 5 done before, 0 failed" in again
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/test.json")} == stamps

    results = {p.parent.name: json.loads(p.read_text()) for p in out.glob("runs/*/test.json")}
    for name, r in results.items():
        run_dir = out / "runs" / name
        assert (run_dir / "train.log").exists() and (run_dir / "test.log").exists()
        if r["method"] in ("ce_scl", "acl", "acl_cl"):
            angles = read_angle_log(run_dir / "angles.tsv")
            assert len(angles) == r["angles"]["updates"] == 4  # 64 examples / batch 16
            if r["method"] == "ce_scl":  # threshold 180: measured, never dropped
                assert r["acl_grad_threshold"] == 180.0 and all(a.kept for a in angles)
        else:
            assert r["angles"] is None
    assert set(results["acl_cl-seed1"]["test"]) >= {"accuracy_exit1", "accuracy_exit2"}

    # the report's numbers are the runs' own
    md = (out / "results.md").read_text()
    labels = {
        "ce-seed1": "ce",
        "ce_scl-seed1": "ce_scl (λ 0.5)",
        "acl-seed1": "acl (λ 0.5)",
        "multi_exit_joint-seed1": "multi_exit_joint",
        "acl_cl-seed1": "acl_cl (λ 0.5)",
    }
    for title, split in (("## Test accuracy", "test"), ("## Dev accuracy", "dev")):
        cells = _cells(md, title)
        assert set(cells) == set(labels.values())
        for name, label in labels.items():
            mean, std, n, seed1 = cells[label][1:]
            value = results[name][split]["accuracy"]
            assert float(mean) == float(seed1) == pytest.approx(value, abs=0.005)
            assert (std, n) == ("-", "1")
    exits = _table(md, "## Test accuracy per exit (multi-exit methods)")
    run_of = {label: name for name, label in labels.items()}
    for label, layer, mean, *_ in exits:
        layer = re.match(r"\d+", layer).group(0)
        value = results[run_of[label]]["test"][f"accuracy_exit{layer}"]
        assert float(mean) == pytest.approx(value, abs=0.005)
    assert len(exits) == 4
    sweep_rows = {(r[0], r[1]): r for r in _table(md, "### Test accuracy")}
    assert float(sweep_rows[("acl", "0.1")][2]) == pytest.approx(
        results["acl-lam0.1-seed1"]["test"]["accuracy"]
    )
    with open(out / "results.csv") as f:
        per_run = list(csv.DictReader(f))
    for row in per_run:
        r = results[row["run"]]
        if row["split"] in ("dev", "test"):
            assert float(row["value"]) == pytest.approx(r[row["split"]][row["metric"]])
    assert {r["run"] for r in per_run} == set(results)

    # pictures: a synthetic early-exit table for (c); everything else from the runs
    sweep_csv = tmp_path / "sweep.csv"
    sweep_csv.write_text(
        "policy,threshold,batch_size,accuracy,mean_exit_layer,layer_speedup,wall_speedup\n"
        "none,,1,60.0,2,1.0,1.0\nentropy,0.5,1,58.0,1.5,1.33,1.2\n"
    )
    printed = run(
        [str(BIN / "acl-fairseq-plots"), str(out), "--data", str(data),
         "--sweep-tsv", f"acl_cl={sweep_csv}"],
        timeout=900,
    )  # fmt: skip
    assert "skipped" not in printed and "FAILED" not in printed
    for name in ("angles", "layer_scores", "early_exit", "tsne", "lambda"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 0, name
        assert (out / "plots" / f"{name}.csv").exists(), name
    with open(out / "plots" / "tsne.csv") as f:
        tsne = list(csv.DictReader(f))
    assert sum(r["kind"] == "sample" for r in tsne) == 2 * 32
    assert sum(r["kind"] == "label_embedding" for r in tsne) == 2 * 2
