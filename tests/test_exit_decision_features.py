"""benchmarks/exit_decision_features.py on constructed exits whose hidden features tell which
rows agree with the final exit and whose logits do not."""

from __future__ import annotations

import pytest
import torch

from benchmarks import exit_decision_features as bench


def constructed(n: int, seed: int) -> bench.Pass:
    """Exits at layers 1, 2 and a final 3. Exit 1 answers class 0 with the same confidence on
    every row; the final exit answers 0 on half of them (they agree) and 1 on the rest; exit 2
    always answers as the final. Exit 1's first hidden feature is +1 where it agrees, -1 where
    not: the oracle leaves at 1 or 2 (1.5 layers), logits alone at 2. ``seed`` orders the
    rows."""
    agree = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) % 2 == 0
    final = torch.where(agree, 0, 1)
    sure = torch.tensor([[3.0, 0.0], [0.0, 3.0]])
    logits = [sure[torch.zeros(n, dtype=torch.long)], sure[final], sure[final] * 2]
    hidden = [torch.zeros(n, 4) for _ in range(3)]
    hidden[0][:, 0] = agree.float() * 2 - 1
    return bench.Pass([1, 2, 3], logits, hidden, final.clone())


@pytest.mark.parametrize("fitting", ["train", "cross-fitted"])
def test_hidden_features_reach_the_oracle_where_logits_cannot(fitting) -> None:
    train, dev, test = constructed(200, 0), constructed(100, 1), constructed(100, 2)
    assert bench.oracle_speedup(test) == pytest.approx(2.0)
    speedups = {}
    for kind in bench.KINDS:
        if fitting == "train":
            on_dev, on_test = bench.fitted_scores(train, [dev, test], kind, 0.01)
        else:
            on_dev, on_test = bench.cross_fitted(dev, test, kind, 0.01)
        assert on_dev.shape == (100, 2) and on_test.shape == (100, 2)
        result = bench.report(test, on_test, bench.choose(dev, on_dev, 0.0))
        assert result["changed"] == 0.0 and result["drop"] == 0.0  # D = 0 holds on test
        speedups[kind] = result["speedup"]
    assert speedups["hidden"] == pytest.approx(2.0)  # every agreeing row leaves at exit 1
    assert speedups["logits"] == pytest.approx(1.5)  # exit 1 looks the same on every row


def test_leave_and_report() -> None:
    a, b = [3.0, 0.0], [0.0, 3.0]  # class 0, class 1
    logits = [torch.tensor([a, a, a, a]), torch.tensor([a, b, a, b]), torch.tensor([a, b, a, b])]
    test = bench.Pass([1, 2, 3], logits, [torch.zeros(4, 1)] * 3, torch.tensor([0, 1, 0, 1]))
    scores = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.1, 0.1], [0.95, 0.0]])
    layer, pred = bench.leave(test, scores, 0.5)
    assert layer.tolist() == [1, 2, 3, 1] and pred.tolist() == [0, 1, 0, 0]
    result = bench.report(test, scores, 0.5)
    # row 3 leaves at exit 1 with class 0 against the final's 1: one change, one error in 4
    assert result["changed"] == 25.0 and result["drop"] == -25.0
    assert result["speedup"] == pytest.approx(3 / 1.75)
