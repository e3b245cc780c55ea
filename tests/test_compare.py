"""acl-fairseq-compare (multi-seed method comparison): the table maths (mean, sample std,
formatting), the run plan and the fairseq-train command lines, and the report built from
hand-written ``test.json`` files. test_plots.py runs it end to end with the plots."""

import argparse
import csv
import json
import math
import shlex
import struct
from pathlib import Path

import pytest

from acl_fairseq.acl_grad import AngleRecord
from acl_fairseq.cli import HelpFormatter
from acl_fairseq.cli.compare import cli as compare_cli
from acl_fairseq.cli.compare import plan, report
from acl_fairseq.cli.compare import run as runner
from acl_fairseq.data.splits import count_classes, count_examples
from acl_fairseq.errors import AclValueError
from acl_fairseq.experiment import fairseq_log
from acl_fairseq.experiment.mean_std import error_bar, fmt, fmt_mean_std, summarize
from acl_fairseq.experiment.recipe import CONTRASTIVE_METHODS, METHODS, multi_exit_arch

from compare_fakes import fake_results, md_table
from fairseq_helpers import TINY_ROBERTA

# ----------------------------------------------------------------------------- table maths


def test_summarize_known_numbers():
    mean, std, n = summarize([80.0, 82.0, 84.0])
    assert (mean, std, n) == (82.0, 2.0, 3)  # sample std: sqrt((4 + 0 + 4) / 2)
    mean, std, n = summarize([70.0, 71.0])
    assert mean == 70.5 and std == pytest.approx(math.sqrt(0.5)) and n == 2
    mean, std, n = summarize([81.3])
    assert mean == 81.3 and math.isnan(std) and n == 1
    assert summarize([])[2] == 0


def test_formatting():
    assert fmt(82.0) == "82.00"
    assert fmt(0.70710678) == "0.71"
    assert fmt(math.nan) == "-" and fmt(None) == "-"
    assert fmt_mean_std([80.0, 82.0, 84.0]) == "82.00 ± 2.00"
    assert fmt_mean_std([81.25]) == "81.25"
    assert fmt_mean_std([]) == "-"
    assert fmt_mean_std([10.0, 20.0], digits=1) == "15.0 ± 7.1"
    assert fmt_mean_std([70, 75], digits=1) == "72.5 ± 3.5"  # the few-shot table's form
    assert fmt_mean_std([70], digits=1) == "70.0"
    assert error_bar(2.5) == 2.5 and error_bar(summarize([81.3])[1]) == 0.0


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
    runs = plan.plan_runs(list(METHODS), [1], 0.5, [0.1, 0.5, 1.0])
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
    assert multi_exit_arch(args)[:2] == ["--arch", "multi_exit_roberta"]
    assert multi_exit_arch(["--arch=roberta_base"]) == ["--arch=multi_exit_roberta_base"]
    assert multi_exit_arch(["--arch", "multi_exit_roberta_tiny"])[1] == ("multi_exit_roberta_tiny")
    with pytest.raises(ValueError, match="no multi-exit variant"):
        multi_exit_arch(["--arch", "transformer"])
    with pytest.raises(AclValueError, match="no --arch"):
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
    opts.stage2_extra_args = shlex.split(opts.stage2_extra)
    opts.num_classes, opts.n_train, opts.cpu = 2, 100, True
    opts.note = plan.plan_epochs(opts)  # as main does once the examples are counted
    return opts


def _flag(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_train_commands(tmp_path):
    opts = _opts(tmp_path, "--restore-file", str(tmp_path / "model.pt"), "--extra=--fp16")
    (tmp_path / "model.pt").write_text("")
    assert plan.total_updates(opts) == 7  # ceil(100 / 16)

    def cmd(method, lam=0.5):
        run_ = plan.Run(method, 3, lam if method in CONTRASTIVE_METHODS else None)
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

    # joint_from_start: every exit from the pretrained model, trained as a stage-1 run
    # (--epochs, --patience kept); --stage2-extra reaches the stage-2 runs only
    start = _opts(
        tmp_path, "--restore-file", str(tmp_path / "model.pt"), "--stage2-epochs", "2",
        "--epochs", "3", "--extra", "--patience 4", "--exit-weighting", "reverse",
        "--stage2-extra=--alternate-exits",
    )  # fmt: skip
    run_ = plan.Run("joint_from_start", 3, None)
    assert run_.multi_exit and not run_.stage2 and run_.stage1 is None
    command = runner.train_command(run_, start, start.out / "runs" / run_.name)
    assert _flag(command, "--criterion") == "multi_exit_ce" and "--exit-layers" not in command
    assert _flag(command, "--restore-file") == str(tmp_path / "model.pt")
    assert _flag(command, "--max-epoch") == "3" and _flag(command, "--patience") == "4"
    assert _flag(command, "--exit-weighting") == "reverse" and "--alternate-exits" not in command
    for method in ("joint_from_acl", "acl_cl"):
        command = runner.train_command(plan.Run(method, 3, 0.5), start, tmp_path)
        assert command[-1] == "--alternate-exits" and _flag(command, "--max-epoch") == "2"
    for method in ("acl", "ce"):
        assert "--alternate-exits" not in runner.train_command(
            plan.Run(method, 3, 0.5), start, tmp_path
        )
    assert [r.name for r in plan.plan_runs(["joint_from_start"], [1], 0.5)] == [
        "joint_from_start-seed1"
    ]

    plain = _opts(tmp_path, "--ce-scl-plain")
    run_ = plan.Run("ce_scl", 1, 0.5)
    assert "--acl-grad" not in runner.train_command(run_, plain, tmp_path)
    assert "--restore-file" not in runner.train_command(plan.Run("ce", 1, None), plain, tmp_path)


def test_max_update_sets_the_epochs_it_needs(tmp_path):
    """--max-update without --epochs trains that many updates (48 examples, batch 16: 3 per
    epoch, so 20 epochs for 60 updates); with --epochs too few, a note says so."""
    opts = _opts(tmp_path, "--max-update", "60", "--batch-size", "16")
    opts.n_train, opts.epochs = 48, None
    assert plan.plan_epochs(opts) is None and opts.epochs == 20
    assert plan.total_updates(opts) == 60
    command = runner.train_command(plan.Run("ce", 1, None), opts, tmp_path)
    assert _flag(command, "--max-epoch") == "20" and _flag(command, "--max-update") == "60"
    assert _flag(command, "--total-num-update") == "60"
    opts = _opts(tmp_path, "--max-update", "10", "--extra", "--update-freq 2")
    assert opts.epochs == 3 and plan.total_updates(opts) == 10  # 4 updates per epoch
    opts = _opts(tmp_path, "--max-update", "60", "--epochs", "2")
    assert opts.epochs == 2 and plan.total_updates(opts) == 14
    assert opts.note == (
        "note: --epochs 2 ends every run after 14 updates (7 per epoch), before --max-update "
        "60; leave --epochs out to train the --max-update updates"
    )
    assert _opts(tmp_path).epochs == 1 and _opts(tmp_path).note is None  # neither: 1 epoch


def test_compare_prints_the_max_update_plan(tmp_path, capsys):
    """The header line of a dry run: 60 updates on 48 examples, not 2."""
    data = _fake_data(tmp_path / "data", n_train=48)
    argv = [str(data), "--arch-args", " ".join(TINY_ROBERTA), "--methods", "ce", "--seeds", "1",
            "--max-update", "60", "--dry-run", "--out", str(tmp_path / "R")]  # fmt: skip
    assert compare_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "1 runs (ce-seed1) of 60 updates each (48 training examples, batch 16, 20 epoch(s))" in (
        out
    )
    assert "--max-epoch 20 --max-update 60" in out


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


def test_help_formatter_adds_defaults_the_help_does_not_name():
    description = "Line one\n  kept as written"
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument("data", help="positional")
    parser.add_argument("--seeds", default=[1, 2, 3], help="comma list")
    parser.add_argument("--lr", type=float, default=5e-5, help="peak learning rate")
    parser.add_argument("--out", default="RESULTS", help="folder (default: RESULTS here)")
    parser.add_argument("--cpu", action="store_true", help="on CPU")
    parser.add_argument("--extra", help="more flags")
    text = " ".join(parser.format_help().split())
    assert "comma list (default: 1,2,3)" in text
    assert "peak learning rate (default: 5e-05)" in text
    assert "folder (default: RESULTS here) " in text and "(default: RESULTS)" not in text
    assert "on CPU --extra" in text  # no "(default: False)" after it
    assert "(default: False)" not in text and "(default: None)" not in text
    assert "positional (default" not in text
    assert description in parser.format_help()


def test_dataset_counts(tmp_path):
    data = _fake_data(tmp_path / "data")
    assert count_examples(data, "train") == 40
    assert count_classes(data) == 2
    with pytest.raises(FileNotFoundError, match="valid1.idx not found"):
        count_examples(data, "valid1")


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


def test_report_tables(tmp_path):
    out = tmp_path / "R"
    fake_results(out)
    report.write_report(out)
    md = (out / "results.md").read_text()
    test = {r[0]: r[1:] for r in md_table(md, "## Test accuracy")}
    assert set(test) == {"ce", "acl (λ 0.5)", "multi_exit_joint", "acl_cl (λ 0.5)"}
    assert test["ce"] == ["81.00", "2.00", "3", "79.00", "81.00", "83.00"]
    assert test["acl (λ 0.5)"] == ["83.00", "2.00", "3", "81.00", "83.00", "85.00"]
    dev = {r[0]: r[1:] for r in md_table(md, "## Dev accuracy")}
    assert dev["ce"][:3] == ["82.00", "2.00", "3"]
    exits = md_table(md, "## Test accuracy per exit (multi-exit methods)")
    assert exits[0] == ["multi_exit_joint", "1", "62.00", "1.00", "3", "61.00", "62.00", "63.00"]
    assert ["acl_cl (λ 0.5)", "2 (final)", "82.00", "2.00", "3", "80.00", "82.00", "84.00"] in exits
    curve = {r[0]: r[1:] for r in md_table(md, "Layer-score curve (test accuracy, mean ± std):")}
    assert curve["acl_cl"] == ["72.00 ± 1.00", "82.00 ± 2.00"]
    # lambda sweep: 0.5 is the main run; 1.0 has the best mean dev accuracy
    sweep = {(r[0], r[1]): r[2:] for r in md_table(md, "### Test accuracy")}
    assert set(sweep) == {("acl", "0.1"), ("acl", "0.5"), ("acl", "1")}
    assert sweep[("acl", "1")][:3] == ["82.00", "2.00", "3"]
    chosen = md_table(md, "### Lambda chosen on dev (highest mean dev accuracy), reported on test")
    assert chosen == [["acl", "1", "85.00 ± 2.00", "82.00 ± 2.00"]]
    angles = md_table(md, "## ACL-Grad angles during training")
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


def test_test_accuracy_counts_every_example(tmp_path):
    """fairseq drops a last batch whose size is not a multiple of --required-batch-size-multiple
    (default 8): 30 test examples at batch 64 would be scored on 24. compare (and the README's
    fairseq-validate) pass 1."""
    import numpy as np
    from fairseq.data import data_utils

    def scored(multiple: int) -> int:
        batches = data_utils.batch_by_size(np.arange(30), lambda i: 10, max_sentences=64,
                                           required_batch_size_multiple=multiple)  # fmt: skip
        return sum(len(b) for b in batches)

    assert (scored(8), scored(1)) == (24, 30)
    command = runner.validate_command(_opts(tmp_path), tmp_path / "checkpoint_best.pt")
    assert _flag(command, "--required-batch-size-multiple") == "1"
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert "--batch-size 32 --required-batch-size-multiple 1" in readme


def test_a_run_from_another_checkout_is_not_trained_with_other_flags(tmp_path):
    """The fairseq-train and --user-dir locations do not change a run; a training flag does."""
    run = plan.Run("ce", 1, None)
    saved = ["/a/.venv/bin/fairseq-train", "DATA", "--user-dir", "/a/acl_fairseq", "--lr", "1e-4"]
    (tmp_path / "run.json").write_text(json.dumps({"train_command": saved}))
    moved = ["/b/bin/fairseq-train", "DATA", "--user-dir", "/b/acl_fairseq", "--lr", "1e-4"]
    runner.check_same_flags(run, tmp_path, moved)  # another machine, another worktree: the same run
    with pytest.raises(AclValueError, match=r"only then: --lr 1e-4; only now: --lr 2e-4"):
        runner.check_same_flags(run, tmp_path, [*moved[:-1], "2e-4"])
