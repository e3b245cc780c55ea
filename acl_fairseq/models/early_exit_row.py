"""The batch-1 path of the early-exit loop: one unpadded row, as few tensor ops per exit as the
same numbers allow (docs/results.md, "What the exits cost at batch 1").

At batch 1 an exit's cost is not its arithmetic but the fixed cost of each tensor op run right
after a layer (its code and the head's weights pushed out of the caches by the layer). The
general loop spends about twenty ops per exit (slicing, a transpose, pooling, two dropouts, the
head's three, the policy's rule, the host sync); this path spends four or five:

* the head (``first`` pooling): position 0 of the running row (``x.select(0, 0)``, then
  ``exit_hidden``: the final layer norm of a pre-norm model), ``dense``, activation,
  ``out_proj`` (their ``forward`` when no hook is set); dropout is the identity in eval mode.
  ``mean`` pooling goes through the general head code;
* the decision (``RowDecider``): the logits come to the host once (``tolist``) and the built-in
  kinds (``entropy``, ``maxprob``, ``patience``, ``per_exit_*``) apply their rule there in
  float64. The policy decides in float32 on the tensor, so when a score lies within a bound of
  its threshold far above float32's rounding (or a logit is not finite, or the top two tie)
  the policy's own ``decide`` runs on the tensor: the decisions are the policy's, exactly.
  Other kinds always decide on the tensor (one ``decide`` and one sync per exit).

Logits, exits and predictions equal the general loop's bit for bit (the tests compare both on
every kind and precision).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..early_exit.per_exit import PerExitEntropyPolicy, PerExitMaxProbPolicy, PerExitPolicy
from ..early_exit.policies import EntropyPolicy, ExitPolicy, MaxProbPolicy, PatiencePolicy
from .types import EarlyExitResult

__all__ = ["RowDecider", "run_single_row"]

SLACK = 1e-5
"""A float64 score closer than ``SLACK (H + 1)(R + K + 1)`` to its threshold (``H`` the entropy,
``R`` the logits' range, ``K`` the classes) is decided in float32 on the tensor. Float32's
error on either score is about ``6e-8 (H + 1)(2R + 3K + 6)``: a hundredth of it or less."""

_RULES = {
    EntropyPolicy: "entropy",
    MaxProbPolicy: "maxprob",
    PerExitEntropyPolicy: "entropy",
    PerExitMaxProbPolicy: "maxprob",
}


class RowDecider:
    """The exit decisions of ``policy`` for one running row, on the host where the kind is a
    built-in one (``hosted``), else on the tensor; call ``leave`` at the policy's exits only,
    in order."""

    def __init__(self, policy: ExitPolicy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        kind = type(policy)
        self.rule = _RULES.get(kind)
        self.hosted = self.rule is not None or kind is PatiencePolicy
        self.per_exit = isinstance(policy, PerExitPolicy)
        self.patience: int | None = getattr(policy, "patience", None)
        if self.per_exit:
            self.thresholds = tuple(policy.thresholds)  # type: ignore[attr-defined]
        elif self.rule is not None:
            self.thresholds = (float(policy.threshold),)  # type: ignore[attr-defined]
        self.step = 0  # the policy's exits passed (per-exit kinds)
        self.counter, self.prev = 0, -1  # PABEE's state (patience, per-exit with patience)
        self.state = None if self.hosted else policy.init_state(1, device)

    def _on_tensor(self, logits: Tensor, step: int) -> bool:
        """The policy's own ``decide`` on the host state written as tensors."""
        state: dict[str, Tensor] = {}
        if self.per_exit:
            state["step"] = torch.tensor([step], device=self.device)
        if self.patience is not None:
            state["counter"] = torch.tensor([self.counter], device=self.device)
            state["prev_pred"] = torch.tensor([self.prev], device=self.device)
        mask, new = self.policy.decide(logits, state)
        if "counter" in new:
            self.counter, self.prev = int(new["counter"]), int(new["prev_pred"])
        return bool(mask)

    def leave(self, logits: Tensor) -> bool:
        """Whether the row leaves at this exit (``logits``: 1 x K float32)."""
        if not self.hosted:
            mask, self.state = self.policy.decide(logits, self.state)
            return bool(mask)
        step = self.step
        self.step = step + 1
        values = logits.tolist()[0]
        check = sum(values)
        if check - check != 0.0:  # a logit is inf or nan
            return self._on_tensor(logits, step)
        top = max(values)
        leaves, counter, prev = False, self.counter, self.prev
        if self.patience is not None:
            if values.count(top) > 1:  # a tie: argmax's choice, on the tensor
                return self._on_tensor(logits, step)
            prev = values.index(top)
            counter = counter + 1 if prev == self.prev else 0
            leaves = counter >= self.patience
        if self.rule is not None:
            exps = [math.exp(v - top) for v in values]
            total = sum(exps)
            entropy = max(
                math.log(total) - sum(e * (v - top) for e, v in zip(exps, values)) / total, 0.0
            )
            margin = SLACK * (entropy + 1.0) * (top - min(values) + len(values) + 1.0)
            threshold = self.thresholds[step if self.per_exit else 0]
            score = entropy if self.rule == "entropy" else 1.0 / total
            if abs(score - threshold) <= margin:  # too close to call in float64
                return self._on_tensor(logits, step)
            leaves = leaves or (score < threshold if self.rule == "entropy" else score >= threshold)
        self.counter, self.prev = counter, prev
        return leaves


def _hooks_anywhere() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _forward(module: Any, hooks: bool) -> Any:
    """``module.forward`` when no hook is registered on it or globally (``hooks``), else the
    module itself (its hooks run)."""
    if hooks or module._forward_hooks or module._forward_pre_hooks:
        return module
    return module.forward


def _row_head(model: Any, head: Any, hooks: bool) -> Callable[[Tensor], Tensor]:
    """``x`` (T x 1 x C, the running row's hidden states) -> logits (1 x K) of ``head``,
    ``first`` pooling, eval mode: the numbers of ``pool`` then ``classify``."""
    dense, out_proj = _forward(head.dense, hooks), _forward(head.out_proj, hooks)
    activation, exit_hidden = head.activation_fn, model.exit_hidden
    return lambda x: out_proj(activation(dense(exit_hidden(x.select(0, 0)))))


def run_single_row(
    model: Any,
    src_tokens: Tensor,
    policy: ExitPolicy,
    heads: dict[int, Any],
    exit_logits: Any,
) -> EarlyExitResult:
    """Early exit of one unpadded row (``src_tokens``: 1 x T); ``heads``: ``{layer: head}`` of
    the exits to evaluate, the last layer's included; ``exit_logits(model, head, x, mean)``:
    the general loop's head (for ``mean`` pooling)."""
    from .pooling import MeanWeights

    num_layers = int(model.num_layers)
    encoder = model.encoder.sentence_encoder
    device = src_tokens.device
    x, _ = encoder.forward_embedding(src_tokens)
    x = x.transpose(0, 1)  # T x 1 x C
    mean = None
    if any(head.pooling == "mean" for head in heads.values()):
        mean = MeanWeights(src_tokens.new_zeros(src_tokens.shape, dtype=torch.bool), False)
    hooks = _hooks_anywhere()
    row_heads = {
        layer: _row_head(model, head, hooks)
        for layer, head in heads.items()
        if head.pooling == "first"
    }
    decider = RowDecider(policy, device)
    logits, exit_layer = None, num_layers
    for layer_idx, layer in enumerate(encoder.layers, start=1):
        out = layer(x, encoder_padding_mask=None)
        x = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        if layer_idx not in heads:
            continue
        row_head = row_heads.get(layer_idx)
        logits = row_head(x) if row_head else exit_logits(model, heads[layer_idx], x, mean)
        if layer_idx == num_layers:
            break
        if decider.leave(logits):
            exit_layer = layer_idx
            break
    assert logits is not None  # the last layer always has an exit
    layers = torch.full((1,), exit_layer, dtype=torch.long, device=device)
    return EarlyExitResult(logits.argmax(dim=-1), layers, logits)
