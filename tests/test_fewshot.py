"""The few-shot protocol (``acl_fairseq.experiment.fewshot``, ``acl-fairseq-fewshot``): the
draws (k per class, a disjoint dev of the same size, deterministic, the study's draws), the
learning rate chosen on dev, the table and its paired tests, the tool's input errors, and a
whole run on tiny data and a tiny model."""

from __future__ import annotations

import json
import math
import random
import shlex
from collections import Counter
from pathlib import Path

import pytest

from acl_fairseq.cli.compare import cli as compare_cli
from acl_fairseq.cli.fewshot import cli as fewshot_cli
from acl_fairseq.data.splits import fewshot_train, fewshot_train_dev, split_off
from acl_fairseq.experiment import fewshot

from fairseq_helpers import TINY_ROBERTA, write_tsv

ROWS = [(f"text {i}", ("a", "b", "c")[i % 3]) for i in range(90)]


def study_draw(train, per_class, seed):
    """The study's few-shot draw as it was written in the study tool (the reference)."""
    rng = random.Random(seed)
    chosen = []
    for label in sorted({label for _, label in train}):
        pool = [row for row in train if row[1] == label]
        chosen += rng.sample(pool, per_class)
    rng.shuffle(chosen)
    return chosen


# ----------------------------------------------------------------------- the draws
def test_draws_k_per_class_with_a_disjoint_dev_of_the_same_size():
    train, dev = fewshot_train_dev(ROWS, 4, seed=3)
    assert Counter(label for _, label in train) == {"a": 4, "b": 4, "c": 4}
    assert Counter(label for _, label in dev) == {"a": 4, "b": 4, "c": 4}
    assert not set(train) & set(dev)
    assert fewshot_train_dev(ROWS, 4, seed=3) == (train, dev)  # deterministic
    assert fewshot_train_dev(ROWS, 4, seed=4)[0] != train
    # the study's draws: the same rows in the same order
    assert train == study_draw(ROWS, 4, 3)
    rest = [row for row in ROWS if row not in set(train)]
    assert dev == study_draw(rest, 4, 10_000 + 3)
    assert fewshot_train(ROWS, 2, 7) == study_draw(ROWS, 2, 7)


def test_a_duplicate_of_a_training_row_never_goes_to_dev():
    rows = (
        [("same", "a")] * 3
        + [(f"x{i}", "a") for i in range(3)]
        + [(f"y{i}", "b") for i in range(6)]
    )
    for seed in range(1, 20):
        train, dev = fewshot_train_dev(rows, 2, seed)
        assert not set(train) & set(dev)


def test_pairs_and_too_small_classes():
    pairs = [(f"p{i}", f"q{i}", "yes" if i % 2 else "no") for i in range(20)]
    train, dev = fewshot_train_dev(pairs, 3, 1)
    assert len(train) == len(dev) == 6 and all(len(row) == 3 for row in train)
    with pytest.raises(ValueError, match="30 examples per class asked, c has 29"):
        fewshot_train(ROWS[:89], 30, 1)


def test_split_off_holds_out_a_fixed_test_split():
    rest, test = split_off(ROWS, 20, seed=0)
    assert len(test) == 20 and len(rest) == 70 and not set(rest) & set(test)
    assert split_off(ROWS, 20, seed=0) == (rest, test)
    assert [r for r in ROWS if r in set(test)] == test  # in the file's order
    with pytest.raises(ValueError, match="cannot hold out 90 of 90 rows"):
        split_off(ROWS, 90)


# ----------------------------------------------------------------------- choice and table
def test_learning_rate_chosen_on_dev_first_in_grid_order_among_ties():
    assert fewshot.choose_lr({1e-4: 70.0, 2e-4: 75.0, 5e-4: 72.0}) == 2e-4
    assert fewshot.choose_lr({5e-4: 75.0, 1e-4: 75.0, 2e-4: 70.0}) == 5e-4
    result = fewshot.DrawResult(16, 1, "acl", {1e-4: 60.0, 2e-4: 65.0}, {1e-4: 90.0, 2e-4: 70.0})
    assert (result.lr, result.dev, result.test) == (2e-4, 65.0, 70.0)  # test never chooses


def test_report_means_differences_and_paired_tests():
    from scipy import stats

    tests = {"ce": [70.0, 72.0, 68.0], "ce_scl": [73.0, 72.5, 71.0], "acl": [74.0, 71.0, 72.0]}
    results = [
        fewshot.DrawResult(16, d + 1, m, {1e-4: 50.0}, {1e-4: values[d]})
        for m, values in tests.items()
        for d in range(3)
    ]
    table = fewshot.report(results, test_size=500)
    assert "### 16 examples per class (3 draws; dev of the same size, test 500)" in table
    assert "| CE | 70.0 ± 2.0 | d1 70.0 (0.0001), d2 72.0 (0.0001), d3 68.0 (0.0001) |" in table
    pairs = [("acl", "ce"), ("ce_scl", "ce"), ("acl", "ce_scl")]
    p = [stats.ttest_rel(tests[a], tests[b]).pvalue for a, b in pairs]
    order = sorted(range(3), key=lambda i: p[i])
    holm, running = [0.0] * 3, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * p[i]))
        holm[i] = running
    diffs = [[x - y for x, y in zip(tests[a], tests[b])] for a, b in pairs]
    assert (
        f"| CE+SCL − CE | {sum(diffs[1]) / 3:+.1f} | d1 +3.0, d2 +0.5, d3 +3.0 | {p[1]:.3f} | "
        f"{holm[1]:.3f} |" in table
    )
    assert f"| ACL − CE+SCL | {sum(diffs[2]) / 3:+.1f} | d1 +1.0, d2 -1.5, d3 +1.0 |" in table
    one = fewshot.report([r for r in results if r.draw == 1])
    assert "| ACL − CE | +4.0 | d1 +4.0 | n/a | n/a |" in one


def test_compare_args_are_compare_flags_for_equal_updates():
    args = fewshot.compare_args(
        "DATA", "OUT", draw=3, lr=2e-4, model=["--arch-args", "--arch roberta"]
    )
    opts = compare_cli.build_parser().parse_args(args)
    assert opts.methods == ["ce", "ce_scl", "acl"] and opts.seeds == [3]
    assert (opts.lr, opts.max_update, opts.epochs) == (2e-4, 60, None)  # epochs: as needed
    assert opts.validate_interval_updates == 5 and opts.batch_size == 32 and opts.ce_scl_plain
    assert shlex.split(opts.extra) == ["--group-by-length", "--validate-interval", "1000",
                                       "--save-interval", "1000"]  # fmt: skip
    assert (opts.contrastive_lambda, opts.temperature) == (0.5, 0.3)


# ----------------------------------------------------------------------- the tool
TINY = ["--arch-args", " ".join(TINY_ROBERTA), "--tokenizer", "sentencepiece",
        "--spm-vocab-size", "100", "--cpu"]  # fmt: skip


def fails(tmp_path: Path, *argv: str, capsys) -> str:
    assert fewshot_cli.main([str(a) for a in argv]) == 2
    return capsys.readouterr().err


def test_tool_input_errors(tmp_path, capsys):
    tsv = tmp_path / "data.tsv"
    write_tsv(tsv, 40, 0)
    common = [tsv, "--test-size", "10", "--out", tmp_path / "out"]
    err = fails(tmp_path, *common, "--per-class", "12", *TINY, capsys=capsys)
    assert err.startswith("acl-fairseq-fewshot: error: --per-class 12: the pool has too few ")
    assert "each draw takes 12 per class for training and 12 for dev (24 per class)" in err
    err = fails(tmp_path, *common, capsys=capsys)
    assert err == (
        "acl-fairseq-fewshot: error: give --model M (a converted BERT) or --tokenizer and its "
        "files\n"
    )
    err = fails(tmp_path, *common, "--methods", "ce,acl_cl", *TINY, capsys=capsys)
    assert "--methods: acl_cl; expected some of ce, ce_scl, acl" in err
    err = fails(tmp_path, tsv, "--test-size", "40", "--out", tmp_path / "o", *TINY, capsys=capsys)
    assert "--test-size 40: cannot hold out 40 of 40 rows" in err
    err = fails(tmp_path, *common, "--model", tmp_path, capsys=capsys)
    assert f"--model {tmp_path}: expected the folder acl-fairseq-convert-bert writes" in err


@pytest.mark.slow
def test_fewshot_end_to_end_on_tiny_data(tmp_path, capfd):
    tsv = tmp_path / "reviews.tsv"
    write_tsv(tsv, 120, 0)
    out = tmp_path / "FEWSHOT"
    argv = [tsv, "--test-size", "30", "--per-class", "4", "--draws", "2", "--methods", "ce,acl",
            "--lrs", "1e-3,3e-3", "--updates", "4", "--validate-every", "2", "--batch-size", "4",
            *TINY, "--out", out]  # fmt: skip
    assert fewshot_cli.main([str(a) for a in argv]) == 0
    first = capfd.readouterr()
    printed = first.out
    records = json.loads((out / "fewshot.json").read_text())
    assert {(r["draw"], r["method"]) for r in records} == {(1, "ce"), (1, "acl"), (2, "ce"),
                                                           (2, "acl")}  # fmt: skip
    rows = [tuple(line.split("\t")) for line in tsv.read_text().splitlines()]
    _, test = split_off(rows, 30, seed=0)
    for draw in (1, 2):
        raw = out / "raw" / f"k4-d{draw}"
        train = [tuple(x.split("\t")) for x in (raw / "train.tsv").read_text().splitlines()]
        dev = [tuple(x.split("\t")) for x in (raw / "dev.tsv").read_text().splitlines()]
        assert (train, dev) == fewshot_train_dev([r for r in rows if r not in set(test)], 4, draw)
        assert (raw / "test.tsv").read_text() == "".join("\t".join(r) + "\n" for r in test)
    for r in records:  # every number is a compare run's, the rate chosen on dev
        for lr in (1e-3, 3e-3):
            run = out / "runs" / f"k4-d{r['draw']}" / f"lr{lr:g}" / "runs"
            result = json.loads((run / f"{r['method']}-seed{r['draw']}" / "test.json").read_text())
            assert result["dev"]["accuracy"] == r["dev_by_lr"][str(lr)]
            assert result["test"]["accuracy"] == r["test_by_lr"][str(lr)]
            assert result["dev"]["num_updates"] <= 4
        best = max(r["dev_by_lr"].values())
        assert r["dev"] == best and r["test"] == r["test_by_lr"][str(r["lr"])]
        assert not math.isnan(r["test"])
    table = (out / "fewshot.md").read_text()
    assert "### 4 examples per class (2 draws; dev of the same size, test 30)" in table
    assert "| ACL − CE |" in table and table in printed
    assert "DEBUG" not in first.out + first.err  # logging as the user gets it
    # a re-run trains nothing (compare is resumable) and gives the same table
    assert fewshot_cli.main([str(a) for a in argv]) == 0
    again = capfd.readouterr().out
    assert again.count(": done before (") == 8 and ": training " not in again
    assert (out / "fewshot.md").read_text() == table
