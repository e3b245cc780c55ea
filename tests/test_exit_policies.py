"""Exit policies: decisions on hand-made logits, patience state, the registry, parsing."""

import math

import pytest
import torch

from acl_fairseq.early_exit.policies import (
    POLICIES,
    EntropyPolicy,
    MaxProbPolicy,
    PatiencePolicy,
    as_policy,
    make_policy,
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
        (1.0, [False, False, True, False]),  # softmax of [100, 0, 0] is 1.0 in float32
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


def test_policies_are_immutable():
    for policy in (EntropyPolicy(0.1), MaxProbPolicy(0.9), PatiencePolicy(1)):
        with pytest.raises(AttributeError):
            policy.threshold = 0.5  # frozen dataclass


def test_the_registry_round_trips_every_kind_through_its_string_form():
    from acl_fairseq.early_exit.learned import LearnedPolicy
    from acl_fairseq.early_exit.per_exit import PerExitEntropyPolicy, PerExitMaxProbPolicy

    assert list(POLICIES) == [
        "entropy", "maxprob", "patience", "per_exit_entropy", "per_exit_maxprob", "learned"
    ]  # fmt: skip
    for policy in (
        EntropyPolicy(0.1),
        EntropyPolicy(math.inf),
        EntropyPolicy(1 / 3),
        MaxProbPolicy(0.9),
        MaxProbPolicy(0.0),
        PatiencePolicy(0),
        PatiencePolicy(4),
        PerExitEntropyPolicy((1, 3), (1 / 3, math.inf)),
        PerExitEntropyPolicy((), ()),
        PerExitMaxProbPolicy((2,), (0.9,), patience=1),
        LearnedPolicy(1 / 3, (1 / 3, -2.0, 0.5, 1.0, 0.25, -0.125), 1 / 7),
    ):
        assert parse_policy(policy.spec) == policy, policy.spec
        assert make_policy(policy.kind, policy.value) == policy
    assert EntropyPolicy(1 / 3).spec == f"entropy:{1 / 3!r}"
    assert EntropyPolicy(math.inf).spec == "entropy:inf"
    assert PatiencePolicy(2).spec == "patience:2"


def test_default_grids_go_from_never_to_always_exiting():
    entropy = EntropyPolicy.default_grid(2, 3)
    assert len(entropy) == 11 and entropy[0] == 0 and entropy[-1] == round(math.log(2), 4)
    assert MaxProbPolicy.default_grid(2, 3) == [round(1 - 0.05 * i, 4) for i in range(11)]
    assert MaxProbPolicy.default_grid(4, 3)[-1] == 0.25
    assert PatiencePolicy.default_grid(2, 5) == [5, 4, 3, 2, 1, 0]
    # entropy and patience grids start where no row can leave early
    assert EntropyPolicy(entropy[0]).never_exits(3)
    assert PatiencePolicy(int(PatiencePolicy.default_grid(2, 3)[0])).never_exits(3)
    # the value every row passes at once
    for policy in (
        EntropyPolicy(EntropyPolicy.always_exits()),
        MaxProbPolicy(0.0),
        PatiencePolicy(0),
    ):
        mask, _ = policy.decide(LOGITS, policy.init_state(4))
        assert mask.all(), policy


def test_make_policy_takes_numbers_and_strings():
    assert make_policy("patience", 2.0) == PatiencePolicy(2)
    assert make_policy("patience", "3") == PatiencePolicy(3)
    assert make_policy("entropy", "0.25") == EntropyPolicy(0.25)
    with pytest.raises(ValueError, match="patience must be an integer >= 0, got 1.5"):
        make_policy("patience", 1.5)
    with pytest.raises(ValueError, match="patience must be an integer"):
        make_policy("patience", math.inf)
    with pytest.raises(ValueError, match="unknown exit policy 'oracle'"):
        make_policy("oracle", 1)


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
        ("maxprob:1.5", r"maxprob threshold must be a number in \[0, 1\], got 1.5"),
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
    """The constructors hold the one range check: parsing and the sweep's flags go through it."""
    with pytest.raises(ValueError, match="entropy threshold must be a number >= 0"):
        EntropyPolicy(-1.0)
    with pytest.raises(ValueError, match=r"maxprob threshold must be a number in \[0, 1\]"):
        MaxProbPolicy(-0.1)
    with pytest.raises(ValueError, match=r"in \[0, 1\], got 1.01"):
        MaxProbPolicy(1.01)
    with pytest.raises(ValueError, match="entropy threshold must be a number"):
        EntropyPolicy(True)
    with pytest.raises(ValueError, match="patience must be an integer >= 0, got -1"):
        PatiencePolicy(-1)
    with pytest.raises(ValueError, match="patience must be an integer"):
        PatiencePolicy(1.5)
    with pytest.raises(ValueError, match="must be a string"):
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
