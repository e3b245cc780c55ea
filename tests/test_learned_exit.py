"""The learned exit decision (``early_exit.learned``, ``learned_calibration``): its features
against a naive per-example loop, the logistic fit against closed forms and a generic
optimiser, the exact threshold search against brute force, cross-fitting, the spec and the
saved file, and the model's batched loop and the hub running it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from test_exit_calibration import random_exits

from acl_fairseq.checkpoint.fingerprint import model_fingerprint
from acl_fairseq.early_exit.calibrate import calibrate, evaluate
from acl_fairseq.early_exit.learned import (
    FEATURES,
    LearnedPolicy,
    exit_features,
    feature_state,
    fit_logistic,
    probability_logit,
    split_features,
)
from acl_fairseq.early_exit.learned_calibration import (
    NEVER,
    Cut,
    best_threshold,
    calibrate_learned,
    cross_fit,
    exit_costs,
    fold_ids,
    learned_family,
    probability_threshold,
)
from acl_fairseq.early_exit.policies import POLICIES, parse_policy
from acl_fairseq.early_exit.risk_control import (
    binomial_cdf,
    risk_controlled_kind,
    risk_controlled_learned,
)
from acl_fairseq.early_exit.thresholds import simulate_exits
from acl_fairseq.inference.loader import CheckpointError, load_for_inference, read_checkpoint
from acl_fairseq.inference.plan import Request
from acl_fairseq.inference.saved_policy import (
    POLICY_FILE,
    read_policy,
    write_policy,
)
from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

from tiny_models import HEAD, tiny_batch

POLICY = LearnedPolicy(0.7, (2.0, 1.0, -1.5, 0.5, 0.25, 0.1), -1.0)


def naive_features(exit_logits, row: int) -> list[list[float]]:
    """One row's features at every shallow exit, by the definitions, in float64 Python."""
    out, prev, run = [], None, 0
    for step, (_, x) in enumerate(exit_logits[:-1], start=1):
        z = [float(v) for v in x[row]]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        p = sorted((v / sum(e) for v in e), reverse=True)
        entropy = -sum(q * math.log(q) for q in p if q > 0)
        pred = max(range(len(z)), key=lambda k: (z[k], -k))
        same = pred == prev
        run = run + 1 if same else 0
        margin = p[0] - p[1] if len(p) > 1 else p[0]
        out.append([p[0], margin, entropy, float(same), float(run), float(step)])
        prev = pred
    return out


def naive_exit(policy: LearnedPolicy, exit_logits, row: int) -> int:
    """The layer one row leaves at, by the definitions, in float64."""
    for (layer, _), f in zip(exit_logits, naive_features(exit_logits, row)):
        z = policy.bias + sum(w * v for w, v in zip(policy.weights, f))
        if 1.0 / (1.0 + math.exp(-z)) >= policy.threshold:
            return layer
    return exit_logits[-1][0]


# ----------------------------------------------------------------------------- features


def test_features_equal_a_naive_per_example_loop():
    exits, _ = random_exits(40, [1, 2, 3, 4], k=3, seed=2)
    exits[1] = (2, exits[0][1].clone())  # exit 2 repeats exit 1: agreement and runs
    features = split_features([x for _, x in exits[:-1]])
    assert features.shape == (40, 3, len(FEATURES)) and features.dtype == torch.float32
    for row in range(40):
        expected = torch.tensor(naive_features(exits, row), dtype=torch.float32)
        assert torch.allclose(features[row], expected, atol=1e-5), row
    assert features[:, 1, FEATURES.index("agree")].eq(1).all()
    assert features[:, 0, FEATURES.index("run")].eq(0).all()
    # one class: the margin is the top probability
    one, _ = exit_features(torch.zeros(2, 1), feature_state(2))
    assert one[:, 1].tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- the fit


def test_logistic_fit_closed_form_and_generic_optimiser():
    # one binary feature, a tiny penalty: weight and bias are the two groups' log-odds
    x = torch.tensor([0.0] * 10 + [1.0] * 10).unsqueeze(1)
    y = torch.tensor([1] * 2 + [0] * 8 + [1] * 7 + [0] * 3)
    w, b = fit_logistic(x, y, l2=1e-9)
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    assert b == pytest.approx(logit(0.2), abs=1e-5)
    assert float(w[0]) == pytest.approx(logit(0.7) - logit(0.2), abs=1e-5)

    # random data: the gradient of the objective (written out, autograd) vanishes at the fit,
    # and a generic optimiser finds nothing lower
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, generator=gen, dtype=torch.float64) * torch.tensor(
        [1.0, 10.0, 0.1, 1.0], dtype=torch.float64
    )
    x[:, 3] = 5.0  # a constant feature gets weight 0
    noise = torch.randn(300, generator=gen, dtype=torch.float64)
    y = (x[:, 0] + 0.1 * x[:, 1] + noise > 0).double()
    w, b = fit_logistic(x, y, l2=1e-2)
    assert float(w[3]) == 0.0
    mean, std = x[:, :3].mean(0), x[:, :3].std(0, unbiased=False)
    xs = torch.cat([torch.ones(300, 1, dtype=torch.float64), (x[:, :3] - mean) / std], 1)

    def objective(theta):  # standardised features, the bias penalised too
        z = xs @ theta
        return (torch.nn.functional.softplus(z) - y * z).mean() + 0.005 * theta.pow(2).sum()

    ours = torch.cat([torch.tensor([b + float((w[:3] * mean).sum())]).double(), w[:3] * std])
    ours.requires_grad_(True)
    objective(ours).backward()
    assert float(ours.grad.abs().max()) < 1e-9
    theta = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = objective(theta)
        loss.backward()
        return loss

    opt.step(closure)
    assert float(objective(theta)) >= float(objective(ours)) - 1e-12
    assert torch.allclose(theta.detach(), ours.detach(), atol=1e-4)


def test_logistic_fit_is_finite_and_deterministic_on_separable_and_constant_labels():
    x = torch.tensor([[-2.0], [-1.0], [1.0], [2.0]])
    y = torch.tensor([0, 0, 1, 1])
    w, b = fit_logistic(x, y)
    assert torch.isfinite(w).all() and math.isfinite(b) and float(w[0]) > 0
    assert torch.equal(fit_logistic(x, y)[0], w)
    w, b = fit_logistic(x, torch.ones(4))  # every label the same
    assert math.isfinite(b) and b > 0
    with pytest.raises(ValueError, match="l2 must be > 0"):
        fit_logistic(x, y, l2=0.0)


# ----------------------------------------------------------------------------- the threshold


def brute_force(scores, costs, errors, max_errors):
    """Every distinct score as a threshold (and 'never'): the cheapest within the budget
    (ties: fewer errors, then the higher threshold)."""
    n, e = scores.shape
    best = None
    for t in sorted({float(v) for v in scores.ravel()} | {math.inf}, reverse=True):
        passes = scores >= np.float32(t)
        at = np.where(passes.any(axis=1), passes.argmax(axis=1), e)
        cost, err = float(costs[at].sum()), float(errors[np.arange(n), at].sum())
        if err <= max_errors + 1e-9 and (best is None or (cost, err) < best[:2]):
            best = (cost, err, t)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_threshold_search_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, e = 30, 4
    scores = (rng.integers(0, 12, size=(n, e)) / 11).astype(np.float32)  # many ties
    errors = (rng.random((n, e + 1)) < np.linspace(0.5, 0.1, e + 1)).astype(np.float64)
    costs = exit_costs([1, 2, 4, 5, 6], head_cost=0.1 * (seed % 2))
    for budget in (float(errors[:, -1].sum()), errors[:, -1].sum() + 2.0, 1e9):
        cut = best_threshold(scores, costs, errors, budget)
        expected = brute_force(scores, costs, errors, budget)
        assert (cut.cost, cut.errors) == pytest.approx(expected[:2]), (budget, cut, expected)
        for t in (cut.high, np.nextafter(np.float32(cut.low), np.float32(np.inf))):
            passes = scores >= np.float32(t)  # any threshold in (low, high] gives what was counted
            at = np.where(passes.any(axis=1), passes.argmax(axis=1), e)
            assert float(costs[at].sum()) == pytest.approx(cut.cost)
            assert float(errors[np.arange(n), at].sum()) == pytest.approx(cut.errors)


def test_probability_threshold_lands_in_the_cut():
    for low, high in [(-0.5, 2.0), (3.0, 3.0000002), (-1e-7, 0.0), (10.0, 10.000001)]:
        low, high = float(np.float32(low)), float(np.float32(high))
        t = probability_threshold(Cut(low, high, 0.0, 0.0))
        assert 0 < t < 1 and low < probability_logit(t) <= high, (low, high, t)
    assert probability_threshold(Cut(1.0, math.inf, 0.0, 0.0)) == NEVER
    assert probability_threshold(Cut(-math.inf, 1.0, 0.0, 0.0)) == 0.0
    assert probability_logit(0.0) == -math.inf and probability_logit(1.0) == math.inf


def test_exit_costs_count_every_shallow_head():
    assert exit_costs([2, 4, 6], 0.5).tolist() == [2.5, 5.0, 7.0]


# ----------------------------------------------------------------------------- cross-fitting


def test_cross_fit_scores_each_fold_with_a_model_that_never_saw_it():
    """Out-of-fold scores of a fold do not move when that fold's labels (its final exit's
    predictions) change; the model fitted on every row does."""
    exits, _ = random_exits(100, [1, 2, 3, 4], k=2, seed=4)
    fit = cross_fit(exits)
    folds = fold_ids(100, 5, seed=0)
    changed = list(exits)
    last = exits[-1][1].clone()
    last[folds.eq(2)] = -last[folds.eq(2)]  # flip fold 2's final predictions
    changed[-1] = (exits[-1][0], last)
    refit = cross_fit(changed)
    assert torch.equal(refit.scores[folds.eq(2)], fit.scores[folds.eq(2)])
    assert not torch.equal(refit.scores[folds.ne(2)], fit.scores[folds.ne(2)])
    assert refit.model.weights != fit.model.weights
    again = cross_fit(exits)  # deterministic
    assert torch.equal(again.scores, fit.scores) and again.model == fit.model


@pytest.mark.parametrize("constraint", ["agreement", "accuracy"])
def test_calibration_thresholds_the_out_of_fold_scores(constraint):
    exits, labels = random_exits(300, [1, 2, 3, 4, 5, 6], k=2, seed=5)
    fit = cross_fit(exits)
    final = exits[-1][1].argmax(-1)
    reference = final if constraint == "agreement" else labels
    errors = torch.stack([x.argmax(-1).ne(reference) for _, x in exits], 1).double().numpy()
    costs = exit_costs([layer for layer, _ in exits], 0.0)
    speeds = []
    for drop in (0.0, 1.0, 5.0):
        cal = calibrate("learned", exits, labels, drop, constraint)
        assert isinstance(cal.policy, LearnedPolicy) and cal.policy.weights == fit.model.weights
        budget = errors[:, -1].sum() + drop * 3
        cut = best_threshold(fit.scores.numpy(), costs, errors, budget)
        assert cal.policy.threshold == probability_threshold(cut)
        # on the out-of-fold decisions the target holds
        passes = fit.scores.numpy() >= np.float32(probability_logit(cal.policy.threshold))
        at = np.where(passes.any(1), passes.argmax(1), 5)
        assert errors[np.arange(300), at].sum() <= budget + 1e-9
        assert cal == evaluate(exits, labels, cal.policy)
        speeds.append(cal.mean_exit_layer)
    assert speeds[0] >= speeds[1] >= speeds[2] and speeds[2] < 6
    with pytest.raises(ValueError, match="patience goes beside a per-exit"):
        calibrate("learned", exits, labels, 1.0, patience=1)


def test_risk_control_certifies_a_learned_policy_on_the_other_half():
    exits, _ = random_exits(600, [1, 2, 3, 4, 5, 6], k=2, seed=6)
    result = risk_controlled_learned(exits, 0.05, 0.1, drops=(0.0, 1.0, 3.0, 6.0))
    assert result.examples == 300 and result.passed >= 1
    assert isinstance(result.policy, LearnedPolicy) and result.disagreement <= 0.05
    assert binomial_cdf(round(result.disagreement * 300), 300, 0.05) == pytest.approx(
        result.p_value
    )
    assert risk_controlled_kind("learned", exits, 0.05, 0.1).examples == 300
    family = learned_family(exits, (0.0, 2.0, 8.0))
    assert [p.threshold for p in family] == sorted((p.threshold for p in family), reverse=True)


# ----------------------------------------------------------------------------- the policy


def test_spec_round_trip_and_errors():
    assert POLICIES["learned"] is LearnedPolicy
    assert parse_policy(POLICY.spec) == POLICY
    assert POLICY.spec.startswith("learned:0.7;bias=-1.0;maxprob=2.0;margin=1.0;")
    assert parse_policy("learned:" + POLICY.value.replace(";", " ; ")) == POLICY
    assert POLICY.with_threshold(NEVER).never_exits(3) and not POLICY.never_exits(3)
    weights = ";".join(f"{f}=1" for f in FEATURES)
    for bad, message in [
        ("learned:0.5", "no weight for bias, maxprob"),
        (f"learned:0.5;bias=0;{weights};depth=2", "unknown feature 'depth'"),
        (f"learned:x;bias=0;{weights}", "'x' is not a threshold"),
        (f"learned:-1;bias=0;{weights}", "threshold must be a number >= 0"),
        (f"learned:0.5;bias=0;{weights};run=2", "bad weight 'run=2'"),
        (f"learned:0.5;bias=nan;{weights}", "must be finite"),
    ]:
        with pytest.raises(ValueError, match=f"bad exit policy .*{message}"):
            parse_policy(bad)


def test_batched_decisions_equal_a_per_example_loop():
    exits, _ = random_exits(64, [1, 2, 3, 4, 5], k=3, seed=9)
    policy = cross_fit(exits).model.with_threshold(0.8)
    layers, preds = simulate_exits(exits, policy)
    assert 1 < len(set(layers.tolist()))
    features = split_features([x for _, x in exits[:-1]])
    batched = policy.logit(features)
    for row in range(64):  # a row's logit does not depend on the batch, bit for bit
        assert torch.equal(policy.logit(features[row : row + 1]), batched[row : row + 1])
        alone = split_features([x[row : row + 1] for _, x in exits[:-1]])
        assert torch.equal(alone, features[row : row + 1])
    for row in range(64):
        alone, _ = simulate_exits([(layer, x[row : row + 1]) for layer, x in exits], policy)
        assert int(alone) == int(layers[row])
        assert naive_exit(policy, exits, row) == int(layers[row]), row


def test_saved_file_round_trip_and_a_bad_file_is_named(tmp_path):
    ckpt = tmp_path / "checkpoint_best.pt"
    ckpt.write_bytes(b"")
    other = POLICY.with_threshold(0.9)
    write_policy(ckpt, POLICY, dtype="fp32", fingerprint="abc",
                 by_dtype={"fp32": {"policy": POLICY}, "int8": {"policy": other}})  # fmt: skip
    saved = read_policy(ckpt)
    assert saved.policy == POLICY and saved.for_dtype("int8") == other
    record = json.loads((tmp_path / POLICY_FILE).read_text())
    assert record["policy"] == POLICY.spec and "maxprob=2.0" in record["policy"]
    record["policy"] = record["policy"].replace(";run=0.25", "")
    (tmp_path / POLICY_FILE).write_text(json.dumps(record))
    with pytest.raises(
        ValueError, match=f"{tmp_path / POLICY_FILE}: bad exit policy .*no weight for run"
    ):
        read_policy(ckpt)


# ----------------------------------------------------------------------------- on a model


@pytest.fixture
def tiny_checkpoint(tiny_built, tiny_data, tmp_path, monkeypatch) -> Path:
    """``tmp_path/model/model.pt`` with its dictionaries (as test_inference_loader's)."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    model, _, cfg = tiny_built
    folder = tmp_path / "model"
    for sub in ("input0", "label"):
        (folder / sub).mkdir(parents=True)
        shutil.copy(tiny_data / sub / "dict.txt", folder / sub / "dict.txt")
    torch.save(
        {
            "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "model": model.state_dict(),
            "optimizer_history": [{"criterion_name": "SentencePredictionCriterion",
                                   "optimizer_name": "FairseqAdam",
                                   "lr_scheduler_state": {"best": None}, "num_updates": 0}],
            "extra_state": {},
        },
        folder / "model.pt",
    )  # fmt: skip
    return folder / "model.pt"


def test_model_and_hub_run_a_fitted_policy(tiny_built, tiny_checkpoint):
    """Fitted on the model's own exits: the batched loop takes the one-pass simulation's
    decisions, each row alone too; the hub runs the saved policy by default; a bad saved file
    stops the load, naming the file."""
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, [1 + i % 14 for i in range(64)], seed=3)
    with torch.no_grad():
        exits = [
            (o.layer, o.logits) for o in model.exit_outputs(tokens, classification_head_name=HEAD)
        ]
    reference = exits[-1][1].argmax(-1)
    policy = calibrate_learned(exits, reference, 20.0)
    layers, preds = simulate_exits(exits, policy)
    assert len(set(layers.tolist())) > 1, layers
    with torch.no_grad():
        result = model.early_exit(tokens, policy)
        alone = [model.early_exit(r[r.ne(1)].unsqueeze(0), policy) for r in tokens[:16]]
    assert torch.equal(result.exit_layers, layers) and torch.equal(result.predictions, preds)
    assert [int(r.exit_layers) for r in alone] == layers[:16].tolist()

    folder = str(tiny_checkpoint.parent)
    weights = model_fingerprint(read_checkpoint(tiny_checkpoint)["model"])
    write_policy(tiny_checkpoint, policy, dtype="fp32", fingerprint=weights)
    hub = MultiExitRobertaModel.from_pretrained(folder, "model.pt", ".", bpe=None)
    assert hub.default_policy == policy
    ran = hub.predict_early_exit(HEAD, tokens)
    assert torch.equal(ran.exit_layers, layers) and torch.equal(ran.predictions, preds)

    file = tiny_checkpoint.parent / POLICY_FILE
    file.write_text(file.read_text().replace("maxprob=", "maxprb="))
    with pytest.raises(
        CheckpointError, match=f"{file}: bad exit policy .*unknown feature 'maxprb'"
    ):
        load_for_inference(tiny_checkpoint, tiny_checkpoint.parent, request=Request())
