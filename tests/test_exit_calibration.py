"""Per-exit policies, their calibration on a split, and risk-controlled thresholds.

The calibration is checked against brute force (every combination of cuts on small splits),
against the best single threshold, and on constructed splits where the answer is known; the
policy's batched decisions against a naive per-example loop and against the model's
batched early-exit loop.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from acl_fairseq.early_exit.calibrate import (
    best_patience,
    best_single_threshold,
    calibrate_per_exit,
    evaluate,
)
from acl_fairseq.early_exit.calibration_search import NEVER, Split, error_budget
from acl_fairseq.early_exit.per_exit import (
    PerExitEntropyPolicy,
    PerExitMaxProbPolicy,
    PerExitPolicy,
    per_exit_policy,
)
from acl_fairseq.early_exit.policies import (
    EntropyPolicy,
    PatiencePolicy,
    parse_policy,
    softmax_entropy,
)
from acl_fairseq.early_exit.risk_control import (
    binomial_cdf,
    risk_controlled,
    risk_controlled_kind,
    risk_controlled_per_exit,
    risk_controlled_single,
    single_grid,
)
from acl_fairseq.early_exit.thresholds import TargetError, simulate_exits

from tiny_models import HEAD, build_with_task, random_batch, train_tiny, write_dicts


def random_exits(n: int, layers, k: int = 2, seed: int = 0):
    """``([(layer, n x k)], labels)``: each row has an ease shared by its exits; deeper exits
    see more of the label (accuracy grows with depth, and exits agree on the easy rows)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, k, (n,), generator=gen)
    ease = torch.rand(n, generator=gen)
    noise = torch.randn(n, k, generator=gen)
    exits = []
    for i, layer in enumerate(layers):
        logits = 0.6 * noise + 0.4 * torch.randn(n, k, generator=gen)
        logits[torch.arange(n), labels] += 0.8 * (i + 1) * ease
        exits.append((layer, logits))
    return exits, labels


def two_class(entropies, right, label: int = 0) -> torch.Tensor:
    """N x 2 logits with the given binary entropies (nats, < ln 2), predicting ``label`` where
    ``right`` else the other class."""
    out = []
    for h, ok in zip(entropies, right):
        lo, hi = 0.5, 1.0  # entropy of (p, 1 - p) falls from ln 2 at p = 0.5 to 0 at 1
        for _ in range(60):
            mid = (lo + hi) / 2
            value = -(mid * math.log(mid) + (1 - mid) * math.log(1 - mid))
            lo, hi = (mid, hi) if value > h else (lo, mid)
        margin = math.log(lo / (1 - lo))
        pred = label if ok else 1 - label
        row = [0.0, 0.0]
        row[pred] = margin
        out.append(row)
    return torch.tensor(out)


def naive_exit(policy: PerExitPolicy, exit_logits, row: int) -> tuple[int, int]:
    """One example through the policy, by the definitions, in float64 Python."""
    counter, prev = 0, -1
    used = [(layer, x) for layer, x in exit_logits[:-1] if layer in policy.layers]
    used.append(exit_logits[-1])
    for step, (layer, logits) in enumerate(used[:-1]):
        values = [float(v) for v in logits[row].double()]
        top = max(values)
        exps = [math.exp(v - top) for v in values]
        probs = [e / sum(exps) for e in exps]
        pred = max(range(len(values)), key=values.__getitem__)
        if policy.single.kind == "entropy":
            leaves = -sum(p * math.log(p) for p in probs if p > 0) < policy.thresholds[step]
        else:
            leaves = max(probs) >= policy.thresholds[step]
        counter = counter + 1 if pred == prev else 0
        prev = pred
        if leaves or (policy.patience is not None and counter >= policy.patience):
            return layer, pred
    layer, logits = used[-1]
    return layer, int(logits[row].argmax())


# ----------------------------------------------------------------------------- the policy


def test_spec_round_trip_and_errors():
    policy = per_exit_policy("entropy", (2, 3, 5), (0.12, 0.3, math.inf), patience=2)
    assert isinstance(policy, PerExitEntropyPolicy)
    assert parse_policy(policy.spec) == policy
    assert policy.spec == "per_exit_entropy:2=0.12,3=0.3,5=inf;patience=2"
    maxprob = parse_policy("per_exit_maxprob:1=0.99, 4=0.9")
    assert maxprob == PerExitMaxProbPolicy((1, 4), (0.99, 0.9))
    assert parse_policy("per_exit_entropy:none").never_exits(5)
    for bad, message in [
        ("per_exit_foo:1=0.1", "unknown exit policy 'per_exit_foo'"),
        ("per_exit_entropy:1=x", "per_exit_entropy must be LAYER=THRESHOLD pairs"),
        ("per_exit_entropy:1=0.1;speed=2", "unknown option 'speed=2'"),
        ("per_exit_entropy:2=0.1,1=0.2", "layers must increase"),
        ("per_exit_entropy:1=-0.1", "entropy threshold must be a number >= 0"),
        ("per_exit_maxprob:1=1.5", "maxprob threshold must be a number in \\[0, 1\\]"),
        ("per_exit_entropy:1=0.1;patience=-1", "patience must be an integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=f"bad exit policy '{re.escape(bad)}': .*{message}"):
            parse_policy(bad)
    assert maxprob.exits((1, 2, 3, 4, 5)) == (1, 4)
    with pytest.raises(ValueError, match="at layer\\(s\\) \\[4\\], where the model has no"):
        maxprob.exits((1, 2, 3))
    assert PerExitEntropyPolicy.calibrated and PerExitEntropyPolicy.default_grid(2, 5) == []


def test_never_exits():
    assert per_exit_policy("entropy", (1, 2), (0.0, 0.0)).never_exits(2)
    assert not per_exit_policy("entropy", (1, 2), (0.0, 0.1)).never_exits(2)
    assert per_exit_policy("maxprob", (1,), (1.0,)).never_exits(3) is False  # p >= 1 can pass
    assert per_exit_policy("entropy", (1, 2), (0.0, 0.0), patience=2).never_exits(2)
    assert not per_exit_policy("entropy", (1, 2), (0.0, 0.0), patience=1).never_exits(2)


@pytest.mark.parametrize("patience", [None, 1])
@pytest.mark.parametrize("kind", ["entropy", "maxprob"])
def test_simulation_equals_naive_loop(kind, patience):
    exits, _ = random_exits(300, [1, 2, 3, 4, 5], k=3, seed=4)
    thresholds = (0.5, 0.8, 0.3) if kind == "entropy" else (0.8, 0.7, 0.9)
    policy = per_exit_policy(kind, (1, 3, 4), thresholds, patience)
    layers, preds = simulate_exits(exits, policy)
    assert len(set(layers.tolist())) >= 3 and 2 not in set(layers.tolist())  # exit 2 skipped
    for row in range(300):
        assert (layers[row].item(), preds[row].item()) == naive_exit(policy, exits, row), row


def test_too_many_exits_is_an_error():
    policy = per_exit_policy("entropy", (1,), (0.1,))
    state = policy.init_state(2)
    _, state = policy.decide(torch.zeros(2, 2), state)
    with pytest.raises(ValueError, match="has 1 exit\\(s\\) but was asked to decide at more"):
        policy.decide(torch.zeros(2, 2), state)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model, task = build_with_task(write_dicts(tmp_path_factory.mktemp("calibration")))
    return train_tiny(model, task, steps=40), task


@pytest.mark.parametrize("patience", [None, 1])
def test_batched_loop_equals_simulation_and_skips_exits(trained, patience):
    """The model's early_exit with a per-exit policy evaluates only the policy's exits (the
    skipped head never runs) and takes the decisions of the one-pass simulation and of each
    row alone."""
    model, task = trained
    tokens, labels = random_batch(task, 96, seed=7)
    calls = []
    skipped = model.classification_heads[f"{HEAD}_exit2"]
    hook = skipped.dense.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            exits = [(o.layer, o.logits) for o in model.exit_outputs(tokens)]
            calls.clear()
            t1 = float(softmax_entropy(exits[0][1]).quantile(0.3))
            t3 = float(softmax_entropy(exits[2][1]).quantile(0.5))
            policy = per_exit_policy("entropy", (1, 3), (t1, t3), patience)
            layers, preds = simulate_exits(exits, policy)
            assert {1, 3, 4} <= set(layers.tolist()) and 2 not in set(layers.tolist())
            result = model.early_exit(tokens, policy)
            alone = [model.early_exit(r[r.ne(1)].unsqueeze(0), policy) for r in tokens[:24]]
    finally:
        hook.remove()
    assert calls == []  # exit 2's head never ran
    assert torch.equal(result.exit_layers, layers)
    assert torch.equal(result.predictions, preds)
    assert [int(r.exit_layers) for r in alone] == layers[:24].tolist()
    with pytest.raises(ValueError, match="where the model has no shallow exit"):
        model.early_exit(tokens, per_exit_policy("entropy", (5,), (0.1,)))


# ----------------------------------------------------------------------------- calibration


def brute_force(exits, labels, drop: float, kind: str = "entropy") -> float:
    """The least total exit layer over every combination of cuts within the target."""
    split = Split(exits, labels, kind, None)
    max_errors = error_budget(split, drop)
    best = math.inf
    for cuts in itertools.product(*[range(NEVER, len(v)) for v in split.values]):
        cost, err = split.run(list(cuts), [True] * split.num_shallow, 0.0)
        if err.sum() <= max_errors + 1e-9:
            best = min(best, float(cost.sum()))
    return best


@pytest.mark.parametrize("kind", ["entropy", "maxprob"])
def test_calibration_matches_brute_force_on_small_splits(kind):
    for seed in range(12):
        exits, labels = random_exits(9, [1, 2, 3], seed=seed)
        for drop in (0.0, 12.0):
            cal = calibrate_per_exit(exits, labels, drop, kind)
            assert cal.accuracy >= cal.full_accuracy - drop - 1e-9
            assert cal.mean_exit_layer * 9 == pytest.approx(brute_force(exits, labels, drop, kind))


@pytest.mark.parametrize("constraint", ["accuracy", "agreement"])
def test_calibration_meets_target_and_beats_single(constraint):
    exits, labels = random_exits(240, [1, 2, 3, 4, 5, 6], k=3, seed=2)
    final = exits[-1][1].argmax(-1)
    for drop in (0.0, 0.5, 1.0, 3.0):
        per_exit = calibrate_per_exit(exits, labels, drop, constraint=constraint)
        single = best_single_threshold(exits, labels, drop, constraint=constraint)
        reference = labels if constraint == "accuracy" else final
        for cal in (per_exit, single):
            # recomputed with the policy itself (the batched decisions)
            check = evaluate(exits, reference, cal.policy)
            assert check.accuracy >= check.full_accuracy - drop - 1e-9, (drop, cal)
            assert cal.accuracy == pytest.approx(evaluate(exits, labels, cal.policy).accuracy)
        assert per_exit.mean_exit_layer <= single.mean_exit_layer + 1e-9
    assert per_exit.mean_exit_layer < 6.0  # not vacuous


def test_single_threshold_is_the_best_single_threshold():
    exits, labels = random_exits(200, [1, 2, 3, 4], k=2, seed=5)
    single = best_single_threshold(exits, labels, 1.0)
    full = evaluate(exits, labels, EntropyPolicy(0.0)).accuracy
    grid = torch.cat([softmax_entropy(x) for _, x in exits[:-1]]).unique().tolist()
    best = 4.0
    for t in [0.0, *[v + 1e-7 for v in grid]]:
        result = evaluate(exits, labels, EntropyPolicy(t))
        if result.accuracy >= full - 1.0 - 1e-9:
            best = min(best, result.mean_exit_layer)
    assert single.mean_exit_layer == pytest.approx(best)
    assert single.accuracy >= full - 1.0 - 1e-9


def test_per_exit_beats_single_threshold_on_a_constructed_split():
    """Exit 1 is confident (entropy 0.1) but right on half the rows; exit 2 is less confident
    (0.2) and right on 90%, unsure (0.6) on the rest. Any single threshold that keeps the
    wrong rows at exit 1 also keeps every row at exit 2; per exit: never at 1, 0.3 at 2."""
    n = 100
    right1 = [i % 2 == 0 for i in range(n)]
    right2 = [i < 90 for i in range(n)]
    exits = [
        (1, two_class([0.1] * n, right1)),
        (2, two_class([0.2 if ok else 0.6 for ok in right2], right2)),
        (3, two_class([0.01] * n, [True] * n)),
    ]
    labels = torch.zeros(n, dtype=torch.long)
    single = best_single_threshold(exits, labels, 0.0)
    per_exit = calibrate_per_exit(exits, labels, 0.0)
    assert single.mean_exit_layer == pytest.approx(3.0)
    assert per_exit.mean_exit_layer == pytest.approx(0.9 * 2 + 0.1 * 3)
    assert per_exit.accuracy == 100.0
    assert per_exit.policy.layers == (2,)  # exit 1 never fires: left out, its head skipped
    assert 0.2 < per_exit.policy.thresholds[0] <= 0.6


def test_head_cost_drops_exits_that_do_not_pay():
    """Exit 1 lets out 30 rows; exit 2 one row in 100 (saving two layers once): at a head cost
    of 0.2 layers evaluating exit 2 on 70 rows costs far more, so it is dropped; at head cost
    0 it is kept. Exit 3 is never right: left out either way."""
    n = 100
    rows = range(n)
    exits = [
        (1, two_class([0.05 if i < 30 else 0.6 for i in rows], [i < 30 for i in rows])),
        (2, two_class([0.05 if i == 99 else 0.6 for i in rows], [i == 99 for i in rows])),
        (3, two_class([0.6] * n, [False] * n)),
        (4, two_class([0.01] * n, [True] * n)),
    ]
    labels = torch.zeros(n, dtype=torch.long)
    free = calibrate_per_exit(exits, labels, 0.0, head_cost=0.0)
    paid = calibrate_per_exit(exits, labels, 0.0, head_cost=0.2)
    assert free.policy.layers == (1, 2)
    assert paid.policy.layers == (1,)
    assert paid.cost < evaluate(exits, labels, free.policy, head_cost=0.2).cost


def test_deploy_refuses_a_policy_slower_than_full_depth():
    """Every row is wrong (and unsure) before exit 5 of 6 and sure there: one entropy
    threshold leaves there after five heads. At 0.1 layers a head it costs 5.5 layers and is
    deployed; at 0.3 it costs 6.5, more than full depth, and the choice is an error naming the
    flags (nothing to save)."""
    from acl_fairseq.inference.deploy import DeployTarget, choose

    n = 20  # rows of each class (two classes)

    def both(entropy: float, right: bool) -> torch.Tensor:
        return torch.cat([two_class([entropy] * n, [right] * n, label) for label in (0, 1)])

    exits = [(layer, both(0.6, False)) for layer in (1, 2, 3, 4)]
    exits += [(5, both(0.05, True)), (6, both(0.01, True))]
    labels = torch.arange(2).repeat_interleave(n)
    cheap = choose("entropy", exits, labels, DeployTarget(max_accuracy_drop=0, head_cost=0.1))
    assert evaluate(exits, labels, cheap.policy, 0.1).cost == pytest.approx(5.5)
    dear = DeployTarget(max_accuracy_drop=0, head_cost=0.3)
    with pytest.raises(TargetError) as err:
        choose("entropy", exits, labels, dear, split="valid")
    assert re.search(
        r"^entropy:\S+ \(calibrated\) costs 6\.50 layers per row on valid with its exit heads "
        r"\(--head-cost 0\.3 layers each\) against 6 at full depth: early exit would be slower",
        str(err.value),
    )
    assert "--policy per_exit_entropy" in str(err.value)
    # the per-exit kind evaluates exit 5 only, 5.3 layers: deployed at the same head cost
    per_exit = choose("per_exit_entropy", exits, labels, dear)
    assert per_exit.policy.layers == (5,)
    assert evaluate(exits, labels, per_exit.policy, 0.3).cost == pytest.approx(5.3)


@pytest.mark.parametrize("constraint", ["accuracy", "agreement"])
def test_best_patience_is_the_fastest_within_the_target(constraint):
    exits, labels = random_exits(300, [1, 2, 3, 4, 5, 6], k=2, seed=8)
    final = exits[-1][1].argmax(-1)
    full = 100.0 * float(final.eq(labels).double().mean())
    for drop in (0.0, 2.0, 10.0):
        chosen = best_patience(exits, labels, drop, constraint=constraint)
        best = 5
        for p in range(5):
            _, preds = simulate_exits(exits, PatiencePolicy(p))
            if constraint == "accuracy":
                ok = 100.0 * float(preds.eq(labels).double().mean()) >= full - drop - 1e-9
            else:
                ok = 100.0 * float(preds.eq(final).double().mean()) >= 100.0 - drop - 1e-9
            if ok:
                best = min(best, p)
        assert chosen.policy == PatiencePolicy(best), (drop, chosen)
        assert chosen.agreement == pytest.approx(evaluate(exits, labels, chosen.policy).agreement)


def test_patience_calibration_and_unreachable_target():
    exits, labels = random_exits(300, [1, 2, 3, 4, 5, 6], k=2, seed=3)
    alone = evaluate(exits, labels, PatiencePolicy(3))
    drop = alone.full_accuracy - alone.accuracy + 1.0
    cal = calibrate_per_exit(exits, labels, drop, patience=3)
    assert cal.policy.patience == 3 and cal.accuracy >= cal.full_accuracy - drop - 1e-9
    assert cal.mean_exit_layer < alone.mean_exit_layer
    with pytest.raises(TargetError, match="patience alone"):
        calibrate_per_exit(exits, labels, 0.0, patience=0)


# ----------------------------------------------------------------------------- risk control


def test_binomial_cdf():
    assert binomial_cdf(0, 10, 0.5) == pytest.approx(0.5**10)
    assert binomial_cdf(3, 10, 0.3) == pytest.approx(
        sum(math.comb(10, j) * 0.3**j * 0.7 ** (10 - j) for j in range(4))
    )
    assert binomial_cdf(-1, 5, 0.1) == 0.0 and binomial_cdf(5, 5, 0.1) == 1.0


def test_risk_control_fixed_sequence():
    """The certified policy is the last of the prefix whose binomial p-value is <= delta."""
    exits, labels = random_exits(600, [1, 2, 3, 4, 5, 6], k=2, seed=6)
    family = single_grid("entropy", 2, steps=50)
    result = risk_controlled(exits, family, 0.05, 0.1)
    final = exits[-1][1].argmax(-1)
    passed = 0
    for policy in family:
        _, preds = simulate_exits(exits, policy)
        if binomial_cdf(int(preds.ne(final).sum()), 600, 0.05) > 0.1:
            break
        passed += 1
    assert result.passed == passed > 0
    assert result.policy == family[passed - 1]
    assert result.disagreement <= 0.05
    assert risk_controlled_single(exits, 0.05, 0.1, steps=50) == result
    strict = risk_controlled(exits, family, 1e-4, 0.1)  # nothing can be certified
    assert strict.passed == 0 and strict.policy == EntropyPolicy(0.0)
    halves = risk_controlled_per_exit(exits, 0.05, 0.1, drops=(0.0, 1.0, 3.0))
    assert halves.examples == 300 and halves.disagreement <= 0.05
    assert isinstance(halves.policy, (PerExitPolicy, EntropyPolicy))
    assert risk_controlled_kind("entropy", exits, 0.05, 0.1) == risk_controlled_single(
        exits, 0.05, 0.1
    )
    patience = risk_controlled_kind("patience", exits, 0.05, 0.1)
    _, preds = simulate_exits(exits, patience.policy)
    assert isinstance(patience.policy, PatiencePolicy)
    assert binomial_cdf(int(preds.ne(final).sum()), 600, 0.05) <= 0.1


def test_maxprob_policy_thresholds_are_exact():
    """Thresholds are cut between float32 confidences: the policy lets out exactly the rows
    the search counted, also when two confidences are adjacent floats."""
    x = torch.tensor([[2.0, 0.0], [2.0, 1e-7], [1.0, 0.0], [0.0, 0.0]])
    exits = [(1, x), (2, torch.tensor([[5.0, 0.0]] * 3 + [[0.0, 5.0]]))]
    labels = torch.tensor([0, 0, 0, 1])
    for kind in ("entropy", "maxprob"):
        cal = calibrate_per_exit(exits, labels, 0.0, kind)
        layers, _ = simulate_exits(exits, cal.policy)
        assert layers.tolist()[:3] == [1, 1, 1] and layers[3] == 2, (kind, cal.policy)
