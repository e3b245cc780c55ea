"""The batch-1 path (``acl_fairseq.runtime.torch_row``) against the general loop: the same
decisions at every policy kind (host rule or tensor rule, thresholds on a score included), and
on tiny models at every precision the same exits, logits and predictions, bit for bit."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from acl_fairseq.early_exit.learned import FEATURES, LearnedPolicy, split_features
from acl_fairseq.early_exit.per_exit import PerExitEntropyPolicy, PerExitMaxProbPolicy
from acl_fairseq.early_exit.policies import (
    EntropyPolicy,
    ExitPolicy,
    MaxProbPolicy,
    PatiencePolicy,
    softmax_entropy,
)
from acl_fairseq.runtime import row_decider
from acl_fairseq.runtime import torch_row as early_exit_row
from acl_fairseq.runtime.precision import PRECISIONS, prepare_for_inference
from acl_fairseq.runtime.row_decider import RowDecider
from acl_fairseq.runtime.torch_loop import run_early_exit

from tiny_models import HEAD, LENGTHS, build_tiny, tiny_batch


@dataclass(frozen=True)
class MarginPolicy(ExitPolicy):
    """A kind the batch-1 path does not know (decided on the tensor): leaves when logit 0 beats
    logit 1 by more than ``margin``."""

    margin: float = 0.0
    kind: ClassVar[str] = "test_margin"
    value_range: ClassVar[str] = "a number"

    @classmethod
    def from_value(cls, value):
        return cls(float(value))

    @staticmethod
    def default_grid(num_classes, num_shallow_exits):
        return []

    @property
    def value(self):
        return self.margin

    def decide(self, logits, state):
        return (logits[:, 0] - logits[:, 1]) > self.margin, state


def _reference(policy, logits_seq):
    """Each exit's decision by ``policy.decide`` on the tensor, state carried."""
    state = policy.init_state(1, "cpu")
    out = []
    for logits in logits_seq:
        mask, state = policy.decide(logits, state)
        out.append(bool(mask))
    return out


def _logit_sequences(k, exits, count, seed):
    gen = torch.Generator().manual_seed(seed)
    for i in range(count):
        scale = (0.01, 1.0, 8.0, 40.0)[i % 4]
        yield [torch.randn(1, k, generator=gen) * scale for _ in range(exits)]


def _on_score(policy_kind, logits):
    """A threshold equal to the float32 score of ``logits`` (the decision is on a knife's edge)."""
    if policy_kind is EntropyPolicy:
        return float(softmax_entropy(logits)[0])
    return float(MaxProbPolicy.score(logits)[0])


def _count_tensor_decisions(monkeypatch, owner, name) -> dict[str, int]:
    """Counts the calls of ``owner.name`` (a decision handed to the tensor) in ``["tensor"]``."""
    calls = {"tensor": 0}
    method = getattr(owner, name)

    def counting(self, *args):
        calls["tensor"] += 1
        return method(self, *args)

    monkeypatch.setattr(owner, name, counting)
    return calls


def _assert_host_decisions(policies, seq) -> int:
    """Each policy's host decisions along ``seq`` are its tensor decisions; the decisions made."""
    for policy in policies:
        decider = RowDecider(policy, torch.device("cpu"))
        assert decider.hosted
        got = [decider.leave(logits) for logits in seq]
        assert got == _reference(policy, seq), (policy.spec, seq)
    return len(policies) * len(seq)


@pytest.mark.parametrize("k", [2, 3, 7])
def test_host_decisions_equal_the_policies_decisions(k, monkeypatch):
    """Every built-in kind, thresholds at random, at a row's exact float32 score and one float
    either side of it: the host's decisions are the tensor's; near a threshold the tensor
    decides (counted, so both routes run)."""
    calls = _count_tensor_decisions(monkeypatch, RowDecider, "_on_tensor")
    hosted = 0
    for n, seq in enumerate(_logit_sequences(k, 3, 80, seed=k)):
        policies: list[ExitPolicy] = [PatiencePolicy(0), PatiencePolicy(1), PatiencePolicy(2)]
        for single, per_exit in ((EntropyPolicy, PerExitEntropyPolicy),
                                 (MaxProbPolicy, PerExitMaxProbPolicy)):  # fmt: skip
            edge = _on_score(single, seq[n % 3])
            for t in (edge, math.nextafter(edge, 0.0), math.nextafter(edge, 2.0)):
                t = single.clip(t)
                policies.append(single(t))
                thresholds = tuple(
                    t if i == n % 3 else _on_score(single, s) * 0.9 for i, s in enumerate(seq)
                )
                thresholds = tuple(single.clip(v) for v in thresholds)
                policies.append(per_exit((1, 2, 3), thresholds))
                policies.append(per_exit((1, 2, 3), thresholds, patience=1))
        hosted += _assert_host_decisions(policies, seq)
    assert 0 < calls["tensor"] < hosted, calls  # both routes run


def test_host_decisions_with_ties_and_non_finite_logits():
    seqs = [
        [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[2.0, 2.0, 2.0]])],
        [torch.tensor([[float("nan"), 0.0, 1.0]]), torch.tensor([[0.0, float("inf"), 1.0]])],
        [torch.tensor([[float("-inf"), 3.0, 1.0]]), torch.tensor([[0.0, 0.0, 1.0]])],
    ]
    policies = [
        PatiencePolicy(1),
        EntropyPolicy(0.5),
        MaxProbPolicy(0.5),
        PerExitMaxProbPolicy((1, 2), (0.4, 0.9), patience=1),
    ]
    for seq in seqs:
        for policy in policies:
            decider = RowDecider(policy, torch.device("cpu"))
            assert [decider.leave(x) for x in seq] == _reference(policy, seq), policy.spec


@pytest.mark.parametrize("k", [2, 3])
def test_learned_host_decisions_equal_the_policys(k, monkeypatch):
    """The learned kind on the host: random weights, thresholds at random, at a row's exact
    float32 logit and one float either side of it, ties and non-finite logits: its decisions
    and its state (run of agreeing exits) are the tensor's; near the threshold the tensor
    decides (counted, so both routes run)."""
    calls = _count_tensor_decisions(monkeypatch, row_decider._LearnedRow, "on_tensor")
    gen = torch.Generator().manual_seed(k)
    hosted = 0
    seqs = list(_logit_sequences(k, 4, 60, seed=10 + k))
    seqs.append([torch.tensor([[1.0] * k]), torch.tensor([[float("nan")] + [0.0] * (k - 1)])])
    seqs.append([torch.tensor([[2.0] + [0.0] * (k - 1)])] * 4)  # a run of agreeing exits
    for n, seq in enumerate(seqs):
        weights = tuple((torch.randn(len(FEATURES), generator=gen) * 3).tolist())
        base = LearnedPolicy(0.5, weights, float(torch.randn(1, generator=gen)))
        edge = float(base.logit(split_features(seq)[0, n % len(seq)]))  # on a knife's edge
        policies = [base.with_threshold(t) for t in (0.0, 0.3, 0.7, 1.0)]
        if math.isfinite(edge):
            for z in (edge, math.nextafter(edge, -math.inf), math.nextafter(edge, math.inf)):
                p = 1.0 / (1.0 + math.exp(-z))
                policies.append(base.with_threshold(p))
        hosted += _assert_host_decisions(policies, seq)
    assert 0 < calls["tensor"] < hosted, calls


def test_unknown_kind_decides_on_the_tensor():
    decider = RowDecider(MarginPolicy(), torch.device("cpu"))
    assert not decider.hosted
    assert decider.leave(torch.tensor([[2.0, 1.0]]))
    assert not decider.leave(torch.tensor([[1.0, 2.0]]))


def _midpoint(values):
    v = values.sort().values
    return float((v[len(v) // 2 - 1] + v[len(v) // 2]) / 2)


def _policies(model, tokens):
    """One policy of every kind whose rows leave at several exits."""
    exits = model.exit_outputs(tokens)
    entropy = [softmax_entropy(o.logits) for o in exits[:-1]]
    top = [MaxProbPolicy.score(o.logits) for o in exits[:-1]]
    return [
        EntropyPolicy(_midpoint(entropy[0])),
        MaxProbPolicy(_midpoint(top[0])),
        PatiencePolicy(1),
        EntropyPolicy(float(entropy[0][1])),  # row 1 exactly on the threshold at exit 1
        PerExitEntropyPolicy((1, 3), (_midpoint(entropy[0]), _midpoint(entropy[2]))),
        PerExitMaxProbPolicy((2, 3), (_midpoint(top[1]), _midpoint(top[2])), patience=1),
        PerExitEntropyPolicy((1, 2, 3), (1e-30,) * 3, patience=1),
        MarginPolicy(_midpoint(exits[0].logits[:, 0] - exits[0].logits[:, 1])),
        EntropyPolicy(1e-30),  # evaluated everywhere, nobody leaves
        _learned(exits),
    ]


def _learned(exits):
    """A learned policy whose threshold splits the rows at the first exit."""
    weights = {"maxprob": 4.0, "margin": 2.0, "entropy": -1.0, "agree": 1.0, "run": 0.5}
    learned = LearnedPolicy(0.5, tuple(weights.get(f, 0.3) for f in FEATURES), -3.0)
    z = learned.logit(split_features([o.logits for o in exits[:-1]])[:, 0])
    return learned.with_threshold(float(torch.sigmoid(torch.tensor(_midpoint(z)))))


@pytest.mark.parametrize(
    "extra",
    [[], ["--encoder-normalize-before"], ["--exit-pooling", "mean"], ["--exit-head", "linear"],
     ["--exit-head", "linear", "--exit-pooling", "mean"]],
    ids=["postnorm", "prenorm", "mean", "linear", "linear-mean"],
)  # fmt: skip
def test_single_row_path_equals_the_general_loop(tiny_task, tiny_data, extra):
    """Each row alone, at each precision and policy: the batch-1 path's exit, prediction and
    logits equal the general loop's bit for bit, and the rows leave at several exits."""
    _, task = tiny_task
    model, _ = build_tiny(tiny_data, task, extra=extra)
    tokens, rows = tiny_batch(task, LENGTHS + [5, 8, 4, 12])
    with torch.no_grad():
        policies = _policies(model, tokens)
    for dtype in PRECISIONS:
        prepared = prepare_for_inference(copy.deepcopy(model), dtype)
        with torch.inference_mode():
            for policy in policies:
                layers = set()
                for row in rows:
                    args = (prepared, row.unsqueeze(0), policy, HEAD)
                    fast, slow = run_early_exit(*args), run_early_exit(*args, single_row=False)
                    assert torch.equal(fast.exit_layers, slow.exit_layers), (dtype, policy)
                    assert torch.equal(fast.logits, slow.logits), (dtype, policy)
                    assert torch.equal(fast.predictions, slow.predictions), (dtype, policy)
                    layers.add(int(fast.exit_layers))
                if policy != EntropyPolicy(1e-30):
                    assert len(layers) >= 2, (dtype, policy, layers)


def test_batch_one_takes_the_single_row_path(tiny_built, monkeypatch):
    """Batch 1 unpadded takes it; a padded row or a batch does not."""
    model, task, _ = tiny_built
    tokens, rows = tiny_batch(task, [4, 6])
    calls = []
    real = early_exit_row.run_single_row
    monkeypatch.setattr(
        "acl_fairseq.runtime.torch_loop.run_single_row",
        lambda *a: calls.append(1) or real(*a),
    )
    model.early_exit(rows[0].unsqueeze(0), "entropy:0.3")
    assert calls == [1]
    model.early_exit(tokens, "entropy:0.3")
    model.early_exit(tokens[:1], "entropy:0.3")  # row 0 is padded in the batch
    assert calls == [1]


def test_hooks_still_run_on_the_single_row_path(tiny_built):
    """A forward hook on a head's module is honoured (the module is then called, not its
    ``forward``)."""
    model, task, _ = tiny_built
    _, rows = tiny_batch(task, [5])
    seen = []
    dense = model.classification_heads[f"{HEAD}_exit1"].dense
    handle = dense.register_forward_hook(lambda module, inputs, output: seen.append(output))
    try:
        model.early_exit(rows[0].unsqueeze(0), "entropy:1e-30")
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == (1, dense.out_features)
