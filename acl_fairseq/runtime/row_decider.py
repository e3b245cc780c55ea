"""The exit decisions of a policy for one running row, on the host where the kind allows.

At batch 1 each tensor op costs a fixed few microseconds more than its arithmetic, so the
built-in kinds (``entropy``, ``maxprob``, ``patience``, ``per_exit_*``, ``learned``) apply their
rule to the row's logits on the host in float64 (the logits come over once, ``tolist``). The
policy decides in float32 on the tensor, so when a score (the learned kind: its logit) lies
within a bound of its threshold far above float32's rounding (or a logit is not finite, or the
top two tie) the policy's own ``decide`` runs on the tensor: the decisions are the policy's,
exactly. Other kinds always decide on the tensor. Used by the torch loop's batch-1 path and by
the ONNX Runtime backend.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..early_exit.learned import LearnedPolicy, probability_logit
from ..early_exit.per_exit import PerExitEntropyPolicy, PerExitMaxProbPolicy, PerExitPolicy
from ..early_exit.policies import EntropyPolicy, ExitPolicy, MaxProbPolicy, PatiencePolicy

__all__ = ["SLACK", "RowDecider"]

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


class _LearnedRow:
    """``LearnedPolicy``'s decisions for one row: its features (``learned.exit_features``) and
    logit on the host in float64, its state (previous prediction, PABEE's counter, exits
    passed); the policy's ``decide`` on the tensor near the threshold, on a tie or a non-finite
    logit."""

    def __init__(self, policy: LearnedPolicy, device: torch.device) -> None:
        self.policy, self.device = policy, device
        self.weights, self.bias = policy.host_weights()
        self.cut = probability_logit(policy.threshold)  # float32's, as the policy compares
        self.prev, self.counter, self.step = -1, 0.0, 0.0

    def leave(self, logits: Tensor) -> bool:
        values = logits.tolist()[0]
        check = sum(values)
        if check - check != 0.0 or values.count(max(values)) > 1:  # not finite, or a tie
            return self.on_tensor(logits)
        z, bound, state = self._logit(values)
        if abs(z - self.cut) <= bound:  # too close to call in float64
            return self.on_tensor(logits)
        self.prev, self.counter, self.step = state
        return z >= self.cut

    def on_tensor(self, logits: Tensor) -> bool:
        """The policy's own ``decide`` on the host state written as tensors."""
        state = {
            "prev_pred": torch.tensor([self.prev], device=self.device),
            "counter": torch.tensor([self.counter], dtype=torch.float32, device=self.device),
            "step": torch.tensor([self.step], dtype=torch.float32, device=self.device),
        }
        mask, new = self.policy.decide(logits, state)
        self.prev, self.counter = int(new["prev_pred"]), float(new["counter"])
        self.step = float(new["step"])
        return bool(mask)

    def _logit(self, values: list[float]) -> tuple[float, float, tuple[int, float, float]]:
        """``(z, bound, new state)`` for the row's finite logits ``values`` with one top: the
        float64 logit and a bound far above float32's error on it."""
        top = max(values)
        exps = [math.exp(v - top) for v in values]
        total = sum(exps)
        probs = sorted(e / total for e in exps)
        margin = probs[-1] - probs[-2] if len(probs) > 1 else probs[-1]
        entropy = math.log(total) - sum(e * (v - top) for e, v in zip(exps, values)) / total
        pred = values.index(top)
        same = 1.0 if pred == self.prev else 0.0
        counter, step = (self.counter + 1.0) * same, self.step + 1.0
        features = (probs[-1], margin, entropy, same, counter, step)
        z = self.bias + sum(w * f for w, f in zip(self.weights, features))
        size = (
            1.0
            + abs(self.bias)
            + sum(abs(w) * (1.0 + abs(f)) for w, f in zip(self.weights, features))
        )
        bound = SLACK * size * (top - min(values) + len(values) + 1.0)
        return z, bound, (pred, counter, step)


class RowDecider:
    """The exit decisions of ``policy`` for one running row, on the host where the kind is a
    built-in one (``hosted``), else on the tensor; call ``leave`` at the policy's exits only,
    in order."""

    def __init__(self, policy: ExitPolicy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        kind = type(policy)
        self.rule = _RULES.get(kind)
        self.learned = _LearnedRow(policy, device) if kind is LearnedPolicy else None
        self.hosted = self.rule is not None or kind is PatiencePolicy or self.learned is not None
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
        if self.learned is not None:
            return self.learned.leave(logits)
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
