"""The one early-exit decision (``acl_fairseq.portable.decide``): every kind against a naive
float64 implementation away from its threshold; a row's decision the same alone as in any
batch (the batch-1 loops and the batched ones decide the same); the rule as JSON; the torch
policies' ``decide`` being this decision; bad rules named."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from acl_fairseq.early_exit.learned import FEATURES, LearnedPolicy
from acl_fairseq.early_exit.policies import parse_policy
from acl_fairseq.portable import decide as host
from acl_fairseq.portable.decide import Decision

EXITS = 4


def random_exits(rows: int, k: int, seed: int) -> list[np.ndarray]:
    """EXITS x (rows x k) float32 logits at several scales (flat to sharp), with repeated
    argmaxes so that patience has runs."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([0.05, 1.0, 4.0, 20.0], size=(rows, 1))
    base = rng.standard_normal((rows, k))
    out = []
    for _ in range(EXITS):
        noise = rng.standard_normal((rows, k)) * 0.7
        out.append(((base + noise) * scale).astype(np.float32))
    return out


def naive_scores(logits: np.ndarray) -> tuple[list[float], list[float], list[float]]:
    """Per row, in float64 with ``math``: entropy, top probability, top minus second."""
    entropy, top, margin = [], [], []
    for row in logits.astype(np.float64).tolist():
        m = max(row)
        exps = [math.exp(v - m) for v in row]
        total = sum(exps)
        probs = sorted((e / total for e in exps), reverse=True)
        entropy.append(-sum(p * math.log(p) for p in probs if p > 0))
        top.append(probs[0])
        margin.append(probs[0] - probs[1] if len(probs) > 1 else probs[0])
    return entropy, top, margin


def naive_run(spec: str, exits: list[np.ndarray]) -> tuple[list[int], list[bool]]:
    """Each row's exit index (EXITS: none) by the kind's definition in float64, and whether
    some decision on the way was within 1e-4 of its threshold (too close to compare with
    float32)."""
    policy = parse_policy(spec)
    rows = exits[0].shape[0]
    layers = list(policy.exits(list(range(1, EXITS + 1))))
    out, close = [EXITS] * rows, [False] * rows
    for r in range(rows):
        counter, prev, step = 0, -1, 0
        for e in range(EXITS):
            if e + 1 not in layers:
                continue
            x = exits[e][r : r + 1]
            (h,), (top,), (margin,) = naive_scores(x)
            pred = int(np.argmax(x[0]))
            counter = counter + 1 if pred == prev else 0
            prev, step = pred, step + 1
            kind = policy.kind.removeprefix("per_exit_")
            leaves, gap = False, math.inf
            if kind in ("entropy", "maxprob"):
                t = policy.thresholds[step - 1] if policy.kind != kind else policy.threshold
                score = h if kind == "entropy" else top
                leaves, gap = (score < t if kind == "entropy" else score >= t), abs(score - t)
            if kind == "learned":
                features = (top, margin, h, float(counter > 0), counter, step)
                z = policy.bias + sum(w * f for w, f in zip(policy.weights, features))
                cut = math.log(policy.threshold) - math.log1p(-policy.threshold)
                leaves, gap = z >= cut, abs(z - cut) / (1 + sum(map(abs, policy.weights)))
            patience = getattr(policy, "patience", None)
            if kind != "learned" and patience is not None and counter >= patience:
                leaves = True
            close[r] = close[r] or gap < 1e-4
            if leaves:
                out[r] = e
                break
    return out, close


def run(decision: Decision, exits: list[np.ndarray], layers: list[int]) -> list[int]:
    """Each row's exit index under ``decision`` at the exits ``layers`` (1-based), all rows
    decided together (no row removed: a row's later decisions are not used)."""
    rows = exits[0].shape[0]
    state = decision.init_state(rows)
    out = np.full(rows, EXITS)
    for e in range(EXITS):
        if e + 1 not in layers:
            continue
        leave, state = decision.decide(exits[e], state)
        out[(out == EXITS) & leave] = e
    return out.tolist()


LEARNED = LearnedPolicy(0.6, (3.0, 1.5, -0.8, 0.7, 0.4, 0.2), -2.0).spec
SPECS = [
    "entropy:0.35",
    "maxprob:0.8",
    "patience:1",
    "patience:2",
    "per_exit_entropy:1=0.2,3=0.6,4=0.1",
    "per_exit_maxprob:2=0.7,3=0.9;patience=1",
    LEARNED,
]


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("spec", SPECS)
def test_every_kind_equals_its_float64_definition(spec, k):
    exits = random_exits(400, k, seed=k)
    policy = parse_policy(spec)
    layers = list(policy.exits(list(range(1, EXITS + 1))))
    got = run(Decision(policy.rule()), exits, layers)
    want, close = naive_run(spec, exits)
    compared = [r for r in range(len(got)) if not close[r]]
    assert len(compared) > 0.9 * len(got)
    assert [got[r] for r in compared] == [want[r] for r in compared]
    assert len({want[r] for r in compared}) >= 3, spec  # rows leave at several exits


@pytest.mark.parametrize("spec", SPECS)
def test_a_row_decides_the_same_alone_and_in_any_batch(spec):
    """Batch 1 (the single-row paths) and batches of every size give a row the same decisions
    and state, bit for bit, rows with ties and tiny or huge logits included."""
    exits = random_exits(64, 3, seed=7)
    for x in exits:
        x[0] = [1.0, 1.0, 0.0]  # a tie
        x[1] = [1e-7, 0.0, -1e-7]
        x[2] = [80.0, -80.0, 0.0]
    decision = Decision(parse_policy(spec).rule())
    steps = len(decision.thresholds) if decision.per_exit else EXITS
    batch_state = decision.init_state(64)
    alone = [decision.init_state(1) for _ in range(64)]
    for e in range(steps):
        before = batch_state
        leave, batch_state = decision.decide(exits[e], batch_state)
        half, _ = decision.decide(exits[e][::2], {k: v[::2] for k, v in before.items()})
        assert half.tolist() == leave[::2].tolist(), (spec, e)
        for r in range(64):
            one, alone[r] = decision.decide(exits[e][r : r + 1], alone[r])
            assert one[0] == leave[r], (spec, e, r)
            for key, value in alone[r].items():
                assert value[0] == batch_state[key][r], (spec, key)


def test_scores_match_independent_values_and_stay_in_range():
    logits = np.array(
        [[0.0, 0.0, 0.0], [math.log(8.0), 0.0, 0.0], [100.0, 0.0, 0.0], [5.0, 5.0, -1e9]],
        dtype=np.float32,
    )
    assert np.allclose(host.entropy(logits), [math.log(3), 0.639031, 0.0, math.log(2)], atol=1e-6)
    assert host.maxprob(logits).tolist() == pytest.approx([1 / 3, 0.8, 1.0, 0.5], abs=1e-6)
    assert host.entropy(logits).dtype == np.float32 and (host.entropy(logits) >= 0).all()
    table, state = host.features(logits, host.feature_state(4))
    assert table.shape == (4, len(FEATURES)) and table.dtype == np.float32
    assert table[:, 1].tolist() == pytest.approx([0.0, 0.7, 1.0, 0.0], abs=1e-6)  # margins
    assert state["step"].tolist() == [1] * 4 and state["counter"].tolist() == [0] * 4
    with np.errstate(all="raise"):  # non-finite logits: no leave, no warning
        bad = np.array([[np.nan, 0.0], [np.inf, 0.0]], dtype=np.float32)
        assert not Decision({"kind": "entropy", "threshold": "inf"}).decide(bad, {})[0].any()


@pytest.mark.parametrize("spec", [*SPECS, "entropy:inf", "per_exit_entropy:none"])
def test_the_rule_survives_json_and_is_the_policys_decision(spec):
    policy = parse_policy(spec)
    rule = json.loads(json.dumps(policy.rule(), allow_nan=False))
    exits = random_exits(50, 2, seed=1)
    layers = list(policy.exits(list(range(1, EXITS + 1))))
    assert run(Decision(rule), exits, layers) == run(policy.decision(), exits, layers)
    decision, tensors = Decision(rule), policy.init_state(50)
    arrays = decision.init_state(50)
    for e in range(EXITS):  # the torch policy's decide is this decision, exit by exit
        if e + 1 not in layers:
            continue
        mask, tensors = policy.decide(torch.from_numpy(exits[e]), tensors)
        leave, arrays = decision.decide(exits[e], arrays)
        assert mask.dtype == torch.bool and mask.numpy().tolist() == leave.tolist()
        assert {k: v.tolist() for k, v in tensors.items()} == {
            k: v.tolist() for k, v in arrays.items()
        }


def test_bad_rules_are_named():
    with pytest.raises(ValueError, match="kind must be one of"):
        Decision({"kind": "margin", "threshold": 0.1})
    with pytest.raises(ValueError, match="'thresholds' must be 2 numbers"):
        Decision({"kind": "per_exit_entropy", "layers": [1, 2], "thresholds": [0.1]})
    with pytest.raises(ValueError, match="'weights' must be 6 numbers"):
        Decision({"kind": "learned", "threshold": 0.5, "weights": [1.0], "bias": 0.0})
    with pytest.raises(ValueError, match="patience must be an integer"):
        Decision({"kind": "patience", "patience": -1})
    with pytest.raises(ValueError, match="'threshold' holds"):
        Decision({"kind": "maxprob", "threshold": "high"})
    with pytest.raises(ValueError, match="B x K"):
        Decision({"kind": "maxprob", "threshold": 0.5}).decide(np.zeros(3), {})
