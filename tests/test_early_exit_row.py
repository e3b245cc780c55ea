"""The batch-1 path (``acl_fairseq.runtime.torch_row``) against the general loop: on tiny
models at every precision and policy kind (a rule's, or a kind deciding on tensors) the same
exits, logits and predictions, bit for bit. The decision itself: test_portable_decide.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
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
from acl_fairseq.portable.decide import Decision
from acl_fairseq.runtime import torch_row as early_exit_row
from acl_fairseq.runtime.precision import PRECISIONS, prepare_for_inference
from acl_fairseq.runtime.rows import TensorDecider, host_decider
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


def test_a_kind_without_a_rule_decides_on_the_tensor():
    """The loops' decider of a kind without a rule is its own ``decide`` on tensors; a built-in
    kind's is its rule's ``portable.decide.Decision``."""
    decider = host_decider(MarginPolicy(), "cpu")
    assert isinstance(decider, TensorDecider)
    state = decider.init_state(2)
    leave, _ = decider.decide(np.array([[2.0, 1.0], [1.0, 2.0]], dtype=np.float32), state)
    assert leave.dtype == bool and leave.tolist() == [True, False]
    assert isinstance(host_decider(EntropyPolicy(0.3)), Decision)


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
