"""Paired tests over seeds and examples, against naive implementations; the predictions file."""

import math
import random

import pytest
from scipy import stats

from acl_fairseq.experiment.paired_tests import holm, mcnemar, paired_bootstrap, seed_t_test
from acl_fairseq.experiment.predictions import SplitPredictions, read_predictions, write_predictions


def naive_binomial_two_sided(b: int, n: int) -> float:
    """Exact two-sided binomial p-value at 1/2: the probability of every outcome no more
    likely than the observed one."""
    probs = [math.comb(n, k) / 2**n for k in range(n + 1)]
    return min(1.0, sum(p for p in probs if p <= probs[b] * (1 + 1e-9)))


def test_mcnemar_pools_discordant_pairs_over_seeds():
    rng = random.Random(0)
    ours = [[rng.random() < 0.8 for _ in range(200)] for _ in range(3)]
    theirs = [[rng.random() < 0.7 for _ in range(200)] for _ in range(3)]
    b = sum(o and not t for so, st in zip(ours, theirs) for o, t in zip(so, st))
    c = sum(t and not o for so, st in zip(ours, theirs) for o, t in zip(so, st))
    result = mcnemar(ours, theirs)
    assert (result.ours_only, result.theirs_only) == (b, c)
    assert result.p_value == pytest.approx(naive_binomial_two_sided(b, b + c), rel=1e-9)
    assert mcnemar([[True, False]], [[True, False]]).p_value == 1.0  # no discordant pair
    with pytest.raises(ValueError):
        mcnemar([[True]], [[True], [False]])


def test_paired_bootstrap_keeps_the_pairing():
    rng = random.Random(1)
    n = 400
    base = [[rng.random() < 0.7 for _ in range(n)] for _ in range(2)]
    better = [[b or rng.random() < 0.3 for b in seed] for seed in base]  # strictly more right
    result = paired_bootstrap(better, base, resamples=2000)
    naive = 100.0 * sum(sum(a) - sum(b) for a, b in zip(better, base)) / (2 * n)
    assert result.difference == pytest.approx(naive)
    assert result.low < result.difference < result.high and result.low > 0
    assert result.p_value < 0.001
    same = paired_bootstrap(base, base, resamples=500)
    assert (same.difference, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert paired_bootstrap(better, base, resamples=500, seed=3) == paired_bootstrap(
        better, base, resamples=500, seed=3
    )
    # a small difference on few examples is not significant
    noisy = paired_bootstrap([[True, False, True, False]], [[False, True, True, False]], 2000)
    assert noisy.difference == 0.0 and noisy.p_value > 0.5


def test_seed_t_test_is_the_paired_t_test():
    ours, theirs = [81.0, 80.5, 80.5, 82.0], [80.0, 81.0, 79.5, 80.0]
    diffs = [a - b for a, b in zip(ours, theirs)]
    assert seed_t_test(diffs) == pytest.approx(stats.ttest_rel(ours, theirs).pvalue)
    assert math.isnan(seed_t_test([1.0])) and math.isnan(seed_t_test([1.0, 1.0]))


def test_holm_step_down():
    # sorted 0.01, 0.02, 0.04, 0.30 with m = 4: 0.04, 0.06, 0.08, 0.30 (monotone)
    assert holm([0.04, 0.01, 0.30, 0.02]) == pytest.approx([0.08, 0.04, 0.30, 0.06])
    assert holm([0.5, 0.4]) == pytest.approx([0.8, 0.8])  # the running maximum
    out = holm([math.nan, 0.01, 0.02])  # NaN is not a test: m = 2
    assert math.isnan(out[0]) and out[1:] == pytest.approx([0.02, 0.02])
    assert holm([0.9, 0.8, 0.7]) == [1.0, 1.0, 1.0]


def test_predictions_file_round_trips(tmp_path):
    dev = SplitPredictions("valid", [0, 1, 1], {2: [0, 0, 1], 4: [0, 1, 1]})
    test = SplitPredictions("test", [1, 0], {2: [1, 1], 4: [1, 0]})
    path = write_predictions(tmp_path / "predictions.tsv", [dev, test])
    assert path.read_text().splitlines()[:2] == ["split\tindex\tlabel\texit2\texit4",
                                                 "valid\t0\t0\t0\t0"]  # fmt: skip
    back = read_predictions(path)
    assert back["valid"] == dev and back["test"] == test
    assert back["valid"].accuracy() == 100.0 and back["valid"].accuracy(2) == pytest.approx(200 / 3)
    assert back["test"].correct(2) == [True, False]
    bad = tmp_path / "bad.tsv"
    bad.write_text("split\tindex\tlabel\texit4\nvalid\t1\t0\t0\n")
    with pytest.raises(ValueError, match="index 1, expected 0"):
        read_predictions(bad)
    with pytest.raises(ValueError, match="exits"):
        write_predictions(tmp_path / "x.tsv", [dev, SplitPredictions("t", [0], {4: [0]})])
