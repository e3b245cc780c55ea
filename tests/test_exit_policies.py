"""Exit policies: decisions on hand-made logits, patience state, parsing."""

import math

import pytest
import torch

from acl_fairseq.early_exit.policies import (
    EntropyPolicy,
    ExitPolicy,
    MaxProbPolicy,
    PatiencePolicy,
    as_policy,
    parse_policy,
    softmax_entropy,
)


def _entropy(probs):
    return -sum(p * math.log(p) for p in probs if p > 0)


# Rows: uniform over 3, peaked, certain (p = [1, 0, 0] up to float), two-way tie.
LOGITS = torch.tensor(
    [
        [0.0, 0.0, 0.0],
        [math.log(8.0), 0.0, 0.0],  # softmax = [0.8, 0.1, 0.1]
        [100.0, 0.0, 0.0],
        [5.0, 5.0, -1e9],  # softmax = [0.5, 0.5, 0]
    ]
)
PROBS = [[1 / 3] * 3, [0.8, 0.1, 0.1], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]
ENTROPIES = [_entropy(p) for p in PROBS]  # ln 3, 0.639, 0, ln 2


def test_softmax_entropy_matches_independent_values():
    got = softmax_entropy(LOGITS)
    assert got.dtype == torch.float32 and got.shape == (4,)
    assert torch.allclose(got, torch.tensor(ENTROPIES), atol=1e-6)
    assert (got >= 0).all()


@pytest.mark.parametrize(
    "threshold,expected",
    [
        (0.0, [False, False, False, False]),  # entropy is never < 0
        (0.5, [False, False, True, False]),
        (0.65, [False, True, True, False]),  # 0.639 < 0.65
        (0.7, [False, True, True, True]),  # ln 2 = 0.693
        (1.2, [True, True, True, True]),  # ln 3 = 1.0986
        (math.inf, [True, True, True, True]),
    ],
)
def test_entropy_policy(threshold, expected):
    policy = EntropyPolicy(threshold)
    state = policy.init_state(4, "cpu")
    assert state == {}
    mask, new_state = policy.decide(LOGITS, state)
    assert mask.dtype == torch.bool and mask.tolist() == expected
    assert new_state == {}


@pytest.mark.parametrize(
    "threshold,expected",
    [
        (0.0, [True, True, True, True]),
        (0.5, [False, True, True, True]),  # max prob 0.5 >= 0.5
        (0.8 - 1e-6, [False, True, True, False]),
        (0.9, [False, False, True, False]),
        (1.01, [False, False, False, False]),  # above 1: never exits
    ],
)
def test_maxprob_policy(threshold, expected):
    policy = MaxProbPolicy(threshold)
    mask, _ = policy.decide(LOGITS, policy.init_state(4))
    assert mask.tolist() == expected


def test_maxprob_in_half_precision_is_computed_in_float():
    mask, _ = MaxProbPolicy(0.79).decide(LOGITS[1:2].half(), {})
    assert mask.tolist() == [True]


def _onehot(classes, k=3):
    logits = torch.zeros(len(classes), k)
    logits[torch.arange(len(classes)), torch.tensor(classes)] = 5.0
    return logits


def test_patience_counter_over_four_exits():
    policy = PatiencePolicy(2)
    state = policy.init_state(4, torch.device("cpu"))
    assert state["counter"].tolist() == [0, 0, 0, 0]
    assert state["prev_pred"].tolist() == [-1, -1, -1, -1]
    # argmax per exit for 4 rows:
    #   row 0: 0 0 0 0 -> counters 0 1 2 3 -> exits at exit 3 (and stays True)
    #   row 1: 0 1 1 1 -> counters 0 0 1 2 -> exits at exit 4
    #   row 2: 0 0 1 1 -> counters 0 1 0 1 -> never
    #   row 3: 2 2 0 0 -> counters 0 1 0 1 -> never
    steps = [[0, 0, 0, 2], [0, 1, 0, 2], [0, 1, 1, 0], [0, 1, 1, 0]]
    expected_counters = [[0, 0, 0, 0], [1, 0, 1, 1], [2, 1, 0, 0], [3, 2, 1, 1]]
    expected_masks = [
        [False, False, False, False],
        [False, False, False, False],
        [True, False, False, False],
        [True, True, False, False],
    ]
    for classes, counters, masks in zip(steps, expected_counters, expected_masks):
        mask, state = policy.decide(_onehot(classes), state)
        assert state["counter"].tolist() == counters
        assert state["prev_pred"].tolist() == classes
        assert mask.tolist() == masks


def test_patience_state_can_be_indexed_by_the_caller():
    policy = PatiencePolicy(1)
    state = policy.init_state(3)
    mask, state = policy.decide(_onehot([0, 1, 2]), state)
    assert not mask.any()
    keep = torch.tensor([0, 2])  # row 1 "left" for some other reason
    state = {k: v.index_select(0, keep) for k, v in state.items()}
    mask, state = policy.decide(_onehot([0, 1]), state)
    assert mask.tolist() == [True, False]


def test_patience_zero_exits_at_first_exit():
    policy = PatiencePolicy(0)
    mask, _ = policy.decide(_onehot([0, 1]), policy.init_state(2))
    assert mask.tolist() == [True, True]


def test_policies_are_exit_policies_and_immutable():
    for policy in (EntropyPolicy(0.1), MaxProbPolicy(0.9), PatiencePolicy(1)):
        assert isinstance(policy, ExitPolicy)
        with pytest.raises(AttributeError):
            policy.threshold = 0.5  # frozen dataclass


def test_parse_policy():
    assert parse_policy("entropy:0.3") == EntropyPolicy(0.3)
    assert parse_policy(" MaxProb : 0.9 ") == MaxProbPolicy(0.9)
    assert parse_policy("patience:2") == PatiencePolicy(2)
    assert parse_policy("entropy:inf") == EntropyPolicy(math.inf)
    assert parse_policy("maxprob:1") == MaxProbPolicy(1.0)
    assert as_policy("patience:0") == PatiencePolicy(0)
    policy = MaxProbPolicy(0.5)
    assert as_policy(policy) is policy


@pytest.mark.parametrize(
    "spec,match",
    [
        ("entropy", "expected"),
        ("entropy:", "expected"),
        ("foo:0.3", "unknown exit policy"),
        ("entropy:abc", "must be a number"),
        ("entropy:-0.1", ">= 0"),
        ("entropy:nan", ">= 0"),
        ("maxprob:1.5", r"\[0, 1\]"),
        ("maxprob:-0.2", r"\[0, 1\]"),
        ("patience:-1", ">= 0"),
        ("patience:1.5", "integer"),
        ("patience:x", "integer"),
    ],
)
def test_parse_policy_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


def test_constructor_validation():
    with pytest.raises(ValueError):
        EntropyPolicy(-1.0)
    with pytest.raises(ValueError):
        MaxProbPolicy(-0.1)
    with pytest.raises(ValueError):
        PatiencePolicy(-1)
    with pytest.raises(ValueError):
        PatiencePolicy(1.5)
    with pytest.raises(ValueError):
        parse_policy(3)


def test_decide_rejects_non_2d_logits():
    with pytest.raises(ValueError, match="B x K"):
        EntropyPolicy(0.5).decide(torch.zeros(3), {})


@pytest.mark.parametrize(
    "policy, shallow, never",
    [
        (EntropyPolicy(0.0), 3, True),
        (EntropyPolicy(1e-30), 3, False),
        (MaxProbPolicy(1.0), 3, False),
        (MaxProbPolicy(1.01), 3, True),
        (PatiencePolicy(2), 3, False),
        (PatiencePolicy(3), 3, True),
        (EntropyPolicy(float("inf")), 0, True),
    ],
)
def test_never_exits_is_exact(policy, shallow, never):
    assert policy.never_exits(shallow) is never
    if never and shallow:  # whatever the logits, no row leaves at any shallow exit
        gen = torch.Generator().manual_seed(0)
        logits = torch.cat([LOGITS, 50 * torch.randn(64, 3, generator=gen)])
        state = policy.init_state(logits.size(0))
        for _ in range(shallow):
            exit_mask, state = policy.decide(logits, state)
            assert not exit_mask.any()


# --------------------------------------------------------- single-row decisions (decide_row)


def _rows_for_decide_row() -> torch.Tensor:
    """Hand-made rows (ties, certain, -inf, huge margins) and random ones of every scale."""
    gen = torch.Generator().manual_seed(3)
    special = torch.tensor(
        [
            [0.0, 0.0, 0.0],
            [200.0, 0.0, 0.0],  # float32 entropy exactly 0
            [17.0, 0.0, 0.0],  # float32 entropy tiny but > 0
            [5.0, 5.0, float("-inf")],
            [1e-8, 0.0, -1e-8],
        ]
    )
    scales = torch.tensor([1e-3, 0.1, 1.0, 5.0, 30.0]).repeat_interleave(200).unsqueeze(1)
    return torch.cat([special, scales * torch.randn(1000, 3, generator=gen)])


def _thresholds_at(values: torch.Tensor) -> list[float]:
    """Thresholds on, just below and just above float32 values (the guard band's job)."""
    out = []
    for v in values[:40].tolist():
        out += [v, math.nextafter(v, -math.inf), math.nextafter(v, math.inf), v + 1e-7]
    return [t for t in out if t >= 0]


def test_decide_row_equals_decide_for_entropy_and_maxprob():
    rows = _rows_for_decide_row()
    entropies, max_probs = softmax_entropy(rows), torch.softmax(rows, -1).amax(-1)
    policies = [EntropyPolicy(t) for t in [0.0, 1e-30, 1e-6, 0.3, 0.69, 1.0, math.inf]]
    policies += [EntropyPolicy(t) for t in _thresholds_at(entropies)]
    policies += [MaxProbPolicy(t) for t in [0.0, 0.34, 0.5, 0.9, 0.999, 1.0]]
    policies += [MaxProbPolicy(min(t, 1.0)) for t in _thresholds_at(max_probs)]
    for policy in policies:
        expected = policy.decide(rows, {})[0].tolist()
        got = [policy.decide_row(row.unsqueeze(0), policy.init_row_state())[0] for row in rows]
        assert got == expected, policy


def test_decide_row_falls_back_on_non_finite_and_half_logits():
    rows = torch.tensor([[float("nan"), 0.0], [float("inf"), 0.0], [0.0, float("-inf")]])
    for policy in (EntropyPolicy(0.5), MaxProbPolicy(0.7)):
        for row in rows:
            leaves, _ = policy.decide_row(row.unsqueeze(0), policy.init_row_state())
            assert leaves == bool(policy.decide(row.unsqueeze(0), {})[0][0])
    half = LOGITS[1:2].half()
    assert MaxProbPolicy(0.79).decide_row(half, {})[0] is True


def test_patience_decide_row_follows_the_batched_counter():
    policy = PatiencePolicy(2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(50):
        logits = torch.randint(0, 2, (6, 1, 3), generator=gen).float()  # many ties
        state, row_state = policy.init_state(1), policy.init_row_state()
        for exit_logits in logits:
            mask, state = policy.decide(exit_logits, state)
            leaves, row_state = policy.decide_row(exit_logits, row_state)
            assert leaves == bool(mask[0])
            assert row_state == (int(state["counter"][0]), int(state["prev_pred"][0]))
    nan_row = torch.tensor([[0.0, float("nan"), 1.0]])
    assert policy.decide_row(nan_row, (1, 1)) == (True, (2, 1))  # argmax of a NaN row: the NaN


def test_default_decide_row_runs_decide_on_a_one_row_state():
    class EveryOther(ExitPolicy):
        """Stateful, batched only: exits at its second call."""

        def init_state(self, batch_size, device=None):
            return {"calls": torch.zeros(batch_size, dtype=torch.long, device=device)}

        def decide(self, logits, state):
            calls = state["calls"] + 1
            return calls >= 2, {"calls": calls}

    policy = EveryOther()
    state = policy.init_row_state()
    assert policy.decide_row(torch.zeros(1, 2), state)[0] is False
    _, state = policy.decide_row(torch.zeros(1, 2), state)
    assert policy.decide_row(torch.zeros(1, 2), state)[0] is True
