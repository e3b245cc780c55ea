"""Early-exit policies, batched, in pure torch (no fairseq import).

A policy decides, for every row of a batch, whether the example leaves the network at the
current exit. The caller (``MultiExitRobertaModel.early_exit``) walks the exits in layer
order and, at each one, calls ``decide`` with the logits of the rows still running::

    state = policy.init_state(batch_size, device)
    for each shallow exit:
        exit_mask, state = policy.decide(logits, state)   # logits: B' x K
        keep = (~exit_mask).nonzero().squeeze(1)
        state = {k: v.index_select(0, keep) for k, v in state.items()}

Every tensor in ``state`` is per row (first dimension = rows still running), so the caller can
drop the rows that exited by indexing the state like the hidden states. Policies themselves are
immutable dataclasses; all per-call information lives in ``state``.

Policies:

* ``EntropyPolicy(threshold)`` (DeeBERT): exit when the entropy (nats) of ``softmax(logits)``
  is ``< threshold``. ``threshold=0`` never exits, ``threshold=inf`` always exits.
* ``MaxProbPolicy(threshold)``: exit when ``max softmax(logits) >= threshold``.
  ``threshold=0`` always exits; a threshold above 1 never exits.
* ``PatiencePolicy(patience)`` (PABEE): a per-row counter of consecutive exits whose argmax
  equals the previous exit's argmax (0 at the first exit, which has no predecessor; reset to
  0 when the prediction changes); exit when the counter reaches ``patience``. Patience ``t``
  exits at the ``(t+1)``-th exit at the earliest; patience 0 exits at the first exit.

For a single running row the loop calls ``decide_row`` instead (one host sync, a scalar
decision; the same decision as ``decide``): entropy and maxprob compute the softmax of the
row's logits in Python (float64) and fall back to ``decide`` when the value lies within a
guard band around the threshold, where float32 rounding could flip the comparison.

``parse_policy("entropy:0.3" | "maxprob:0.9" | "patience:2")`` builds one from a string.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ExitPolicy",
    "EntropyPolicy",
    "MaxProbPolicy",
    "PatiencePolicy",
    "PolicyState",
    "parse_policy",
    "as_policy",
    "softmax_entropy",
]

PolicyState = dict[str, Tensor]
"""Per-row policy state: every tensor has the batch (rows still running) as first dim."""


def softmax_entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of ``softmax(logits)`` per row, computed in float32.

    Args:
        logits: B x K.
    Returns:
        B, float32, ``>= 0`` (terms with probability 0 contribute 0).
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)
    p = log_p.exp()
    plogp = torch.where(p > 0, p * log_p, 0.0)
    return -plogp.sum(dim=-1)


def _host_softmax(values: list[float]) -> tuple[float, list[float], float] | None:
    """``(max, exp(v - max) per class, their sum)`` of one row's logits in float64, or None
    when a logit is not finite (the caller then decides in torch)."""
    if not all(math.isfinite(v) for v in values):
        return None
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return top, exps, sum(exps)


def _near(value: float, threshold: float, num_classes: int) -> bool:
    """True when float32 rounding of ``value`` (an entropy or a probability computed in
    float64 here, in float32 by ``decide``) or of ``threshold`` could flip a comparison.

    The float32 error of the softmax entropy is below ``~1e-7 * (1 + log K)^2``; the band is
    100 times wider, and ``1e-5`` absolute covers thresholds that round to 0 in float32.
    """
    band = 1e-5 * (1.0 + math.log(max(num_classes, 1))) ** 2 + 1e-5 * abs(threshold)
    return abs(value - threshold) <= band


def _check_logits(logits: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be B x K, got shape {tuple(logits.shape)}")


class ExitPolicy(ABC):
    """Common interface of the exit policies."""

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> PolicyState:
        """Initial per-row state for ``batch_size`` rows (empty for stateless policies)."""
        return {}

    def never_exits(self, num_shallow_exits: int) -> bool:
        """True when no row can leave at any of ``num_shallow_exits`` shallow exits, whatever
        the logits (the loop then runs the plain full-depth forward)."""
        return num_shallow_exits == 0

    def init_row_state(self, device: torch.device | str | None = None) -> Any:
        """Initial state of a single row for ``decide_row`` (opaque to the caller)."""
        return self.init_state(1, device)

    def decide_row(self, logits: Tensor, state: Any) -> tuple[bool, Any]:
        """``decide`` for a single row: 1 x K logits -> ``(leaves now, new row state)``.

        One host sync. The default runs ``decide`` on the 1-row state of ``init_row_state``;
        the built-in policies decide on the host (see the module docstring).
        """
        exit_mask, state = self.decide(logits, state)
        return bool(exit_mask[0]), state

    @abstractmethod
    def decide(self, logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
        """Decide which rows exit at the current exit.

        Args:
            logits: B x K logits of the current exit for the rows still running.
            state: per-row state for those B rows (from ``init_state`` or the previous call,
                indexed with the rows that stayed).
        Returns:
            ``(exit_mask, new_state)``: exit_mask is a B bool tensor (True = leaves now);
            new_state holds B-row tensors (the caller removes the exiting rows itself).
        """


@dataclass(frozen=True)
class EntropyPolicy(ExitPolicy):
    """DeeBERT: exit when the entropy (nats) of ``softmax(logits)`` is below ``threshold``.

    ``threshold`` must be ``>= 0``; 0 never exits, ``float("inf")`` always exits.
    """

    threshold: float

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool):
            raise ValueError(f"entropy threshold must be a number, got {self.threshold!r}")
        if math.isnan(self.threshold) or self.threshold < 0:
            raise ValueError(f"entropy threshold must be >= 0, got {self.threshold}")

    def never_exits(self, num_shallow_exits: int) -> bool:
        """Entropy is ``>= 0``, so a threshold of 0 never lets a row out."""
        return self.threshold == 0 or num_shallow_exits == 0

    def decide(self, logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
        _check_logits(logits)
        return softmax_entropy(logits) < self.threshold, state

    def decide_row(self, logits: Tensor, state: Any) -> tuple[bool, Any]:
        """Entropy ``log s - sum(e * (v - max)) / s`` in float64 (``e = exp(v - max)``,
        ``s = sum(e)``); ``decide`` when it is near the threshold or a logit is not finite."""
        values = logits[0].tolist()
        soft = _host_softmax(values)
        if soft is not None:
            top, exps, total = soft
            spread = sum(e * (v - top) for e, v in zip(exps, values) if e > 0.0)
            entropy = math.log(total) - spread / total
            if not _near(entropy, self.threshold, len(values)):
                return entropy < self.threshold, state
        return super().decide_row(logits, state)


@dataclass(frozen=True)
class MaxProbPolicy(ExitPolicy):
    """Exit when the largest softmax probability is ``>= threshold``.

    ``threshold`` must be ``>= 0``: 0 always exits, a value above 1 never exits (``parse_policy``
    only accepts ``[0, 1]``, so a typo such as ``maxprob:90`` is caught on the command line).
    """

    threshold: float

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool):
            raise ValueError(f"maxprob threshold must be a number, got {self.threshold!r}")
        if math.isnan(self.threshold) or self.threshold < 0:
            raise ValueError(f"maxprob threshold must be >= 0, got {self.threshold}")

    def never_exits(self, num_shallow_exits: int) -> bool:
        """A softmax probability is ``<= 1``, so a threshold above 1 never lets a row out."""
        return self.threshold > 1 or num_shallow_exits == 0

    def decide(self, logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
        _check_logits(logits)
        max_prob = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
        return max_prob >= self.threshold, state

    def decide_row(self, logits: Tensor, state: Any) -> tuple[bool, Any]:
        """Largest probability ``1 / sum(exp(v - max))`` in float64; ``decide`` when it is
        near the threshold or a logit is not finite."""
        values = logits[0].tolist()
        soft = _host_softmax(values)
        if soft is not None:
            max_prob = 1.0 / soft[2]
            if not _near(max_prob, self.threshold, len(values)):
                return max_prob >= self.threshold, state
        return super().decide_row(logits, state)


@dataclass(frozen=True)
class PatiencePolicy(ExitPolicy):
    """PABEE: exit once ``patience`` consecutive exits repeated the previous exit's argmax.

    State: ``counter`` (B, long; 0 at start) and ``prev_pred`` (B, long; -1 = no previous
    exit). At each exit ``counter = counter + 1`` if ``argmax == prev_pred`` else 0, and rows
    with ``counter >= patience`` exit. Patience ``t`` exits at the ``(t+1)``-th exit at the
    earliest.
    """

    patience: int

    def __post_init__(self) -> None:
        if not isinstance(self.patience, int) or isinstance(self.patience, bool):
            raise ValueError(f"patience must be an integer, got {self.patience!r}")
        if self.patience < 0:
            raise ValueError(f"patience must be >= 0, got {self.patience}")

    def never_exits(self, num_shallow_exits: int) -> bool:
        """Patience ``t`` exits at the ``(t+1)``-th shallow exit at the earliest."""
        return self.patience >= num_shallow_exits

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> PolicyState:
        return {
            "counter": torch.zeros(batch_size, dtype=torch.long, device=device),
            "prev_pred": torch.full((batch_size,), -1, dtype=torch.long, device=device),
        }

    def decide(self, logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
        _check_logits(logits)
        pred = logits.argmax(dim=-1)
        same = pred.eq(state["prev_pred"])
        counter = torch.where(same, state["counter"] + 1, torch.zeros_like(state["counter"]))
        return counter >= self.patience, {"counter": counter, "prev_pred": pred}

    def init_row_state(self, device: torch.device | str | None = None) -> tuple[int, int]:
        """``(counter, prev_pred)`` of one row, as Python ints."""
        return 0, -1

    def decide_row(self, logits: Tensor, state: tuple[int, int]) -> tuple[bool, tuple[int, int]]:
        """The counter update of ``decide`` on the host: argmax of the row's logits (the first
        maximum, as ``torch.argmax``; a NaN row asks torch)."""
        values = logits[0].tolist()
        if any(v != v for v in values):  # NaN: torch.argmax's rule
            pred = int(logits[0].argmax())
        else:
            pred = max(range(len(values)), key=values.__getitem__)
        counter, prev_pred = state
        counter = counter + 1 if pred == prev_pred else 0
        return counter >= self.patience, (counter, pred)


_POLICY_SYNTAX = '"entropy:<threshold>", "maxprob:<threshold>" or "patience:<int>"'


def parse_policy(spec: str) -> ExitPolicy:
    """Build a policy from ``"entropy:0.3"``, ``"maxprob:0.9"`` or ``"patience:2"``.

    The name is case-insensitive; surrounding spaces are ignored. Raises ``ValueError`` for an
    unknown name, a missing/unparsable value, a negative threshold, a maxprob threshold outside
    ``[0, 1]`` or a patience that is not an integer ``>= 0``.
    """
    if not isinstance(spec, str):
        raise ValueError(f"exit policy must be a string like {_POLICY_SYNTAX}, got {spec!r}")
    name, sep, value = spec.strip().partition(":")
    name, value = name.strip().lower(), value.strip()
    if not sep or not value:
        raise ValueError(f"bad exit policy {spec!r}: expected {_POLICY_SYNTAX}")
    if name == "patience":
        try:
            patience = int(value)
        except ValueError:
            raise ValueError(
                f"bad exit policy {spec!r}: patience must be an integer >= 0"
            ) from None
        return PatiencePolicy(patience)
    if name not in ("entropy", "maxprob"):
        raise ValueError(f"unknown exit policy {name!r} in {spec!r}: expected {_POLICY_SYNTAX}")
    try:
        threshold = float(value)
    except ValueError:
        raise ValueError(f"bad exit policy {spec!r}: threshold must be a number") from None
    if name == "maxprob":
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"bad exit policy {spec!r}: maxprob threshold must be in [0, 1]")
        return MaxProbPolicy(threshold)
    return EntropyPolicy(threshold)


def as_policy(policy: ExitPolicy | str) -> ExitPolicy:
    """Return ``policy`` itself, or ``parse_policy(policy)`` for a string."""
    if isinstance(policy, ExitPolicy):
        return policy
    return parse_policy(policy)
