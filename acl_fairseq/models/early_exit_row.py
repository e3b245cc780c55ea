"""The batch-1 path of the early-exit loop: one unpadded row, as few tensor ops per exit as the
same numbers allow (docs/results.md, "What the exits cost at batch 1").

At batch 1 an exit's cost is not its arithmetic but the fixed cost of each tensor op run right
after a layer (its code and the head's weights pushed out of the caches by the layer). The
general loop spends about twenty ops per exit (slicing, a transpose, pooling, two dropouts, the
head's three, the policy's rule, the host sync); this path spends four or five:

* the head (``first`` pooling): position 0 of the running row (``x[0]``, then ``exit_hidden``
  when the model has a final layer norm), ``dense``, activation, ``out_proj``; dropout is the
  identity in eval mode. ``mean`` pooling goes through the general head code;
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
from typing import Any

import torch
from torch import Tensor

from ..early_exit.per_exit import PerExitEntropyPolicy, PerExitMaxProbPolicy, PerExitPolicy
from ..early_exit.policies import EntropyPolicy, ExitPolicy, MaxProbPolicy, PatiencePolicy
from .types import EarlyExitResult

__all__ = ["RowDecider", "run_single_row"]

SLACK = 1e-5
"""A float64 score this close to its threshold (scaled by ``_margin``) is decided in float32 on
the tensor; float32's own error is below a hundredth of it."""

_SCORES = {EntropyPolicy: "entropy", MaxProbPolicy: "maxprob"}
_PER_EXIT = {PerExitEntropyPolicy: "entropy", PerExitMaxProbPolicy: "maxprob"}


def _scores(values: list[float]) -> tuple[float, float, float]:
    """``(entropy in nats, top probability, margin)`` of ``softmax(values)`` in float64;
    ``margin`` bounds float32's error on either score a hundred times over: about
    ``6e-8 (H + 1)(2R + 3K + 6)`` with ``R`` the logits' range."""
    top = max(values)
    shifted = [v - top for v in values]
    total = math.fsum(math.exp(v) for v in shifted)
    log_total = math.log(total)
    entropy = -math.fsum(math.exp(v - log_total) * (v - log_total) for v in shifted)
    spread = -min(shifted)
    margin = SLACK * (max(entropy, 0.0) + 1.0) * (spread + len(values) + 1.0)
    return max(entropy, 0.0), 1.0 / total, margin


class RowDecider:
    """The exit decisions of ``policy`` for one running row, on the host where the kind is a
    built-in one (``hosted``), else on the tensor; call ``leave`` at the policy's exits only,
    in order."""

    def __init__(self, policy: ExitPolicy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        kind = type(policy)
        self.rule = _SCORES.get(kind) or _PER_EXIT.get(kind)  # type: ignore[call-overload]
        self.hosted = self.rule is not None or kind is PatiencePolicy
        self.step = 0  # the policy's exits passed (per-exit kinds)
        self.counter, self.prev = 0, -1  # PABEE's state (patience, per-exit with patience)
        self.state = None if self.hosted else policy.init_state(1, device)

    def _patience(self) -> int | None:
        policy = self.policy
        if isinstance(policy, PatiencePolicy):
            return policy.patience
        return policy.patience if isinstance(policy, PerExitPolicy) else None

    def _threshold(self) -> float:
        policy = self.policy
        if isinstance(policy, PerExitPolicy):
            return policy.thresholds[self.step]
        return float(policy.threshold)  # type: ignore[attr-defined]

    def _on_tensor(self, logits: Tensor) -> bool:
        """The policy's own ``decide`` on the host state written as tensors."""
        state: dict[str, Tensor] = {}
        if isinstance(self.policy, PerExitPolicy):
            state["step"] = torch.tensor([self.step], device=self.device)
        if self._patience() is not None:
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
        try:
            return self._leave_on_host(logits)
        finally:
            self.step += 1

    def _leave_on_host(self, logits: Tensor) -> bool:
        values = logits.tolist()[0]
        if not all(math.isfinite(v) for v in values):
            return self._on_tensor(logits)
        patience = self._patience()
        patient, counter, prev = False, self.counter, self.prev
        if patience is not None:
            top = max(values)
            if values.count(top) > 1:  # a tie: argmax's choice, on the tensor
                return self._on_tensor(logits)
            prev = values.index(top)
            counter = self.counter + 1 if prev == self.prev else 0
            patient = counter >= patience
        if self.rule is not None:
            entropy, top_probability, margin = _scores(values)
            threshold = self._threshold()
            score = entropy if self.rule == "entropy" else top_probability
            if abs(score - threshold) <= margin:  # too close to call in float64
                return self._on_tensor(logits)
            confident = score < threshold if self.rule == "entropy" else score >= threshold
            patient = patient or confident
        self.counter, self.prev = counter, prev
        return patient


def _row_logits(model: Any, head: Any, x: Tensor) -> Tensor:
    """Logits (1 x K) of ``head`` on the running row's hidden states ``x`` (T x 1 x C),
    ``first`` pooling, eval mode: the numbers of ``pool`` then ``classify``."""
    features = model.exit_hidden(x[0])  # 1 x C
    return head.out_proj(head.activation_fn(head.dense(features)))


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
    decider = RowDecider(policy, device)
    logits, exit_layer = None, num_layers
    for layer_idx, layer in enumerate(encoder.layers, start=1):
        out = layer(x, encoder_padding_mask=None)
        x = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        head = heads.get(layer_idx)
        if head is None:
            continue
        if head.pooling == "first":
            logits = _row_logits(model, head, x)
        else:
            logits = exit_logits(model, head, x, mean)
        if layer_idx == num_layers:
            break
        if decider.leave(logits):
            exit_layer = layer_idx
            break
    assert logits is not None  # the last layer always has an exit
    layers = torch.full((1,), exit_layer, dtype=torch.long, device=device)
    return EarlyExitResult(logits.argmax(dim=-1), layers, logits)
