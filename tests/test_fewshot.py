"""The few-shot protocol (``acl_fairseq.experiment.fewshot``): the draws (k per class, a
disjoint dev of the same size, deterministic, the study's draws; the pool without the test
split's texts and without repeated texts), the learning rate chosen on dev, and the table with
the study's tests and rule (``experiment.fewshot_report``). The tool: test_fewshot_tool.py."""

from __future__ import annotations

import math
import random
import shlex
from collections import Counter

import pytest
from scipy import stats

from acl_fairseq.cli.compare import cli as compare_cli
from acl_fairseq.data.splits import (
    check_disjoint,
    fewshot_train,
    fewshot_train_dev,
    repeated_texts,
    split_off,
    unique_texts,
    without_texts,
)
from acl_fairseq.experiment import fewshot, fewshot_report
from acl_fairseq.experiment.paired_tests import paired_bootstrap, verdict

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


def test_the_pool_loses_the_test_texts_and_repeated_texts_counted():
    pool = [("a", "x"), ("b", "y"), ("a", "x"), ("c", "x"), ("d", "y"), ("b", "y")]
    test = [("c", "y"), ("e", "x")]  # 'c' is a pool text (with another label)
    kept, removed = without_texts(pool, test)
    assert (kept, removed) == ([("a", "x"), ("b", "y"), ("a", "x"), ("d", "y"), ("b", "y")], 1)
    assert unique_texts(kept) == ([("a", "x"), ("b", "y"), ("d", "y")], 2)
    assert repeated_texts(pool) == [[0, 2], [1, 5]]
    pairs = [("p", "q", "x"), ("p", "r", "x"), ("p", "q", "y")]  # a pair's text: both fields
    assert repeated_texts(pairs) == [[0, 2]] and unique_texts(pairs)[1] == 1


def test_train_dev_and_test_are_checked_disjoint_by_text():
    check_disjoint({"train": [("a", "x")], "dev": [("b", "x")], "test": [("c", "y")]})
    with pytest.raises(ValueError, match=r"^train and test share 1 text\(s\), e\.g\. \('a',\)$"):
        check_disjoint({"train": [("a", "x")], "dev": [("b", "x")], "test": [("a", "y")]})
    with pytest.raises(ValueError, match="^dev and test share 2 text"):
        check_disjoint(
            {"train": [], "dev": [("a", "x"), ("b", "x")], "test": [("b", "y"), ("a", "x")]}
        )


# ----------------------------------------------------------------------- choice and table
def test_learning_rate_chosen_on_dev_first_in_grid_order_among_ties():
    assert fewshot.best_on_dev({1e-4: 70.0, 2e-4: 75.0, 5e-4: 72.0}) == 2e-4
    assert fewshot.best_on_dev({5e-4: 75.0, 1e-4: 75.0, 2e-4: 70.0}) == 5e-4
    assert fewshot.best_on_dev({"0.1,0.3": 79.0, "0.5,0.3": 79.0}) == "0.1,0.3"  # any grid
    result = fewshot.DrawResult(16, 1, "acl", {1e-4: 60.0, 2e-4: 65.0}, {1e-4: 90.0, 2e-4: 70.0})
    assert (result.lr, result.dev, result.test) == (2e-4, 65.0, 70.0)  # test never chooses


def naive_holm(p):
    order = sorted(range(len(p)), key=lambda i: p[i])
    out, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def shown(p: float) -> str:
    """A p-value as the table writes it: three decimals, two significant digits under 0.001."""
    return f"{p:.3f}" if p >= 1e-3 else f"{p:.1e}"


def correct(n_right: int, n: int = 200, shift: int = 0) -> tuple[bool, ...]:
    """``n`` test examples, the ``n_right`` from index ``shift`` on (cyclic) right."""
    return tuple((i - shift) % n < n_right for i in range(n))


def draw_results(tests, right=None):
    """DrawResults of k=16, one learning rate: ``tests[method][d]`` test accuracy of draw d+1;
    ``right[method][d]`` its per-example correctness."""
    return [
        fewshot.DrawResult(16, d + 1, m, {1e-4: 50.0}, {1e-4: values[d]},
                           right[m][d] if right else None)
        for m, values in tests.items()
        for d in range(len(values))
    ]  # fmt: skip


def test_report_means_differences_and_paired_tests_over_draws():
    tests = {"ce": [70.0, 72.0, 68.0], "ce_scl": [73.0, 72.5, 71.0], "acl": [74.0, 71.0, 72.0]}
    results = draw_results(tests)
    table = fewshot_report.report(results, test_size=500)
    assert "### 16 examples per class (3 draws; dev of the same size, test 500)" in table
    assert "| CE | 70.0 ± 2.0 | d1 70.0 (0.0001), d2 72.0 (0.0001), d3 68.0 (0.0001) |" in table
    pairs = [("acl", "ce"), ("ce_scl", "ce"), ("acl", "ce_scl")]
    p = [stats.ttest_rel(tests[a], tests[b]).pvalue for a, b in pairs]
    holm = naive_holm(p)
    diffs = [[x - y for x, y in zip(tests[a], tests[b])] for a, b in pairs]
    assert (
        f"| CE+SCL − CE | {sum(diffs[1]) / 3:+.1f} | d1 +3.0, d2 +0.5, d3 +3.0 | {p[1]:.3f} | "
        f"{holm[1]:.3f} | n/a | n/a | n/a | n/a | no verdict |" in table
    )
    assert f"| ACL − CE+SCL | {sum(diffs[2]) / 3:+.1f} | d1 +1.0, d2 -1.5, d3 +1.0 |" in table
    one = fewshot_report.report([r for r in results if r.draw == 1])
    assert "| ACL − CE | +4.0 | d1 +4.0 | n/a | n/a | n/a | n/a | n/a | n/a | no verdict |" in one


def test_report_tests_over_examples_and_gives_a_verdict_only_when_both_tests_survive():
    """The study's page: the t-test over draws, McNemar over the pooled test examples of the
    chosen runs (and a bootstrap interval), Holm over the family, both tests for a verdict."""
    n = 200
    right = {  # ACL: always 30 more right than CE; CE+SCL: 2 more on a draw, 2 fewer on another
        "ce": [correct(120, n, s) for s in (0, 7, 13)],
        "ce_scl": [correct(122, n, 0), correct(118, n, 7), correct(121, n, 13)],
        "acl": [correct(150, n, s) for s in (0, 7, 13)],
    }
    acc = {m: [100.0 * sum(c) / n for c in runs] for m, runs in right.items()}
    acc["acl"] = [a + x for a, x in zip(acc["acl"], (0.5, -0.5, 0.0))]  # spread over draws
    results = draw_results(acc, right)
    rows = fewshot_report.comparison_rows(results)
    assert [(r["method"], r["baseline"]) for r in rows] == [
        ("ce_scl", "ce"), ("acl", "ce"), ("acl", "ce_scl")]  # fmt: skip
    t_p, m_p = [], []
    for row in rows:
        ours, theirs = right[row["method"]], right[row["baseline"]]
        b = sum(o and not t for so, st in zip(ours, theirs) for o, t in zip(so, st))
        c = sum(t and not o for so, st in zip(ours, theirs) for o, t in zip(so, st))
        assert (row["ours_only"], row["theirs_only"], row["example_draws"]) == (b, c, 3)
        assert row["mcnemar_p"] == pytest.approx(stats.binomtest(b, b + c).pvalue)
        diffs = [x - y for x, y in zip(acc[row["method"]], acc[row["baseline"]])]
        assert row["per_draw_difference"] == pytest.approx(diffs)
        t_p.append(stats.ttest_rel(acc[row["method"]], acc[row["baseline"]]).pvalue)
        m_p.append(row["mcnemar_p"])
        boot = paired_bootstrap(ours, theirs)
        assert (row["bootstrap_low"], row["bootstrap_high"]) == (boot.low, boot.high)
    assert [r["paired_t_p"] for r in rows] == pytest.approx(t_p)
    assert [r["paired_t_holm"] for r in rows] == pytest.approx(naive_holm(t_p))
    assert [r["mcnemar_holm"] for r in rows] == pytest.approx(naive_holm(m_p))
    for row in rows:
        expected = verdict(row["mean_difference"], [row["paired_t_holm"], row["mcnemar_holm"]])
        assert row["verdict"] == expected
    assert rows[1]["verdict"] == "better" and rows[2]["verdict"] == "better"
    assert rows[0]["verdict"] == "no verdict"
    table = fewshot_report.report(results, n)
    acl = rows[1]
    assert (
        f"| ACL − CE | +15.0 | d1 +15.5, d2 +14.5, d3 +15.0 | {shown(acl['paired_t_p'])} | "
        f"{shown(acl['paired_t_holm'])} | {acl['ours_only']} / {acl['theirs_only']} | "
        f"{shown(acl['mcnemar_p'])} | {shown(acl['mcnemar_holm'])} | "
        f"{acl['bootstrap_low']:+.1f} to {acl['bootstrap_high']:+.1f} | better |" in table
    )
    assert acl["mcnemar_holm"] < 1e-3 and "| 0.000 |" not in table  # a tiny p is not shown 0
    assert "only when both corrected p-values are below 0.05, otherwise no verdict" in table
    labels = [line.rsplit("|", 2)[1].strip() for line in table.splitlines() if " − " in line]
    assert labels == ["no verdict", "better", "better"]  # the rows' order; never "no difference"


def test_no_verdict_without_the_test_over_examples_or_over_draws():
    """The t-test alone (no predictions kept) or McNemar alone (one draw) is no verdict."""
    assert verdict(3.0, [0.001, math.nan]) == "no verdict"
    assert verdict(3.0, [math.nan, 0.001]) == "no verdict"
    assert verdict(3.0, [0.01, 0.04]) == "better" and verdict(-3.0, [0.01, 0.04]) == "worse"
    assert verdict(3.0, [0.01, 0.06]) == "no verdict" and verdict(0.0, [0.0, 0.0]) == "no verdict"
    assert verdict(3.0, []) == "no verdict"
    right = {"ce": [correct(100)], "acl": [correct(190)]}
    rows = fewshot_report.comparison_rows(draw_results({"ce": [50.0], "acl": [95.0]}, right))
    assert rows[0]["mcnemar_holm"] < 1e-6 and rows[0]["paired_t_p"] is None
    assert rows[0]["verdict"] == "no verdict"


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


def test_extra_flags_the_protocol_sets_already_are_not_another_run():
    """--extra repeating a protocol flag trains the same run (compare would refuse the
    repeated flag as a run of other flags, naming no difference)."""
    plain = fewshot.compare_args("DATA", "OUT", draw=1, lr=1e-4)
    for extra in ("--group-by-length", fewshot.PROTOCOL_EXTRA, "--save-interval 1000"):
        assert fewshot.compare_args("DATA", "OUT", draw=1, lr=1e-4, extra=extra) == plain
    other = fewshot.compare_args("DATA", "OUT", draw=1, lr=1e-4, extra="--autocast bf16")
    assert other[other.index("--extra") + 1] == f"{fewshot.PROTOCOL_EXTRA} --autocast bf16"
    assert fewshot.protocol_extra("--validate-interval 5").endswith("1000 --validate-interval 5")
