"""Early-exit policies (no fairseq import): one registry of the kinds, their parsing, names,
ranges and sweep grids.

A policy decides, for every row of a batch, whether the example leaves the network at the
current exit. Its decision is written once, on numpy host arrays, in ``portable.decide``: each
built-in kind hands its rule table there (``ExitPolicy.rule``), and every loop (the torch
loops, the ONNX Runtime loop, the bundle's runner) runs that rule on the exit's logits taken
to the host. ``decide`` here is the same decision for torch tensors (calibration's one-pass
simulation, tests)::

    state = policy.init_state(batch_size, device)
    for each exit the policy decides at:
        exit_mask, state = policy.decide(logits, state)   # logits: B' x K
        keep = (~exit_mask).nonzero().squeeze(1)
        state = {k: v.index_select(0, keep) for k, v in state.items()}

Every tensor in ``state`` is per row (first dimension = rows still running), so the caller can
drop the rows that exited by indexing the state like the hidden states. Policies themselves are
immutable dataclasses; all per-call information lives in ``state``. A kind without a rule
(a registered extension) overrides ``decide`` and ``init_state`` and decides on tensors.

Kinds (``POLICIES``; a new kind is one class here with ``@register_policy``):

* ``entropy:T`` (DeeBERT): exit when the entropy (nats) of ``softmax(logits)`` is ``< T``;
  ``T >= 0``: 0 never exits, ``inf`` always exits.
* ``maxprob:T``: exit when ``max softmax(logits) >= T``; ``T`` in ``[0, 1]``: 0 always exits.
* ``patience:N`` (PABEE): a per-row counter of consecutive exits whose argmax equals the
  previous exit's argmax (0 at the first exit, which has no predecessor; reset to 0 when the
  prediction changes); exit when the counter reaches ``N``. Patience ``N`` exits at the
  ``(N+1)``-th exit at the earliest; patience 0 exits at the first exit.
* ``per_exit_entropy:2=0.1,4=0.3[;patience=P]`` / ``per_exit_maxprob:...`` (``per_exit``):
  a threshold of its own at each exit it names, the other exits skipped (their heads do not
  run), optionally with PABEE's patience beside the thresholds.

Each kind states its values once (``value_range``, checked by the constructor), its default
sweep grid (``default_grid``; ``calibrated`` kinds have none: the sweep calibrates them), its
string form (``spec``, read back by ``parse_policy``) and the shallow exits it decides at
(``exits``: all of the model's by default).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..portable import decide as host

__all__ = [
    "POLICIES",
    "ConfidencePolicy",
    "EntropyPolicy",
    "ExitPolicy",
    "MaxProbPolicy",
    "PatiencePolicy",
    "PolicyState",
    "as_policy",
    "make_policy",
    "parse_policy",
    "policy_kind",
    "register_policy",
    "softmax_entropy",
]

PolicyState = dict[str, Tensor]
"""Per-row policy state: every tensor has the batch (rows still running) as first dim."""

POLICIES: dict[str, type[ExitPolicy]] = {}
"""Every policy kind by name (``entropy``, ``maxprob``, ``patience``, and ``per_exit_entropy``,
``per_exit_maxprob`` registered by ``early_exit.per_exit``)."""

_SYNTAX = '"KIND:VALUE" with KIND one of {kinds} (e.g. "entropy:0.3", "patience:2")'


def on_host(logits: Tensor) -> np.ndarray:
    """B x K logits as the decision reads them: float32 on the host (``ValueError`` unless
    2-D)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be B x K, got shape {tuple(logits.shape)}")
    return logits.detach().float().cpu().numpy()


def host_state(state: PolicyState) -> host.State:
    """A per-row state as the decision keeps it (numpy)."""
    return {k: v.cpu().numpy() for k, v in state.items()}


def tensor_state(state: host.State, device: torch.device | str | None) -> PolicyState:
    """The decision's per-row state as tensors on ``device``."""
    return {k: torch.from_numpy(v).to(device) for k, v in state.items()}


def softmax_entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of ``softmax(logits)`` per row, as the decision computes it
    (``portable.decide.entropy``, float32).

    Args:
        logits: B x K.
    Returns:
        B, float32, ``>= 0`` (terms with probability 0 contribute 0), on the logits' device.
    """
    return torch.from_numpy(host.entropy(on_host(logits))).to(logits.device)


def register_policy(cls: type[ExitPolicy]) -> type[ExitPolicy]:
    """Class decorator: adds ``cls`` to ``POLICIES`` under ``cls.kind``."""
    POLICIES[cls.kind] = cls
    return cls


class ExitPolicy(ABC):
    """Common interface of the exit policies."""

    kind: ClassVar[str]
    """Registry name, the ``KIND`` of ``KIND:VALUE``."""
    value_range: ClassVar[str]
    """The values the kind accepts, in words (the one range check is the constructor's)."""
    calibrated: ClassVar[bool] = False
    """True for kinds whose values are fitted to a split (``calibrate``), not swept on a grid."""

    @classmethod
    @abstractmethod
    def from_value(cls, value: Any) -> ExitPolicy:
        """The policy at ``value`` (a number or its string); ``ValueError`` outside the range."""

    @staticmethod
    @abstractmethod
    def default_grid(num_classes: int, num_shallow_exits: int) -> list[float]:
        """Values swept by default: from 'never exits early' to '(almost) always at exit 1'."""

    @property
    @abstractmethod
    def value(self) -> float | str:
        """The policy's parameter (threshold, patience; a per-exit kind's text)."""

    @property
    def spec(self) -> str:
        """``KIND:VALUE``, full precision: ``parse_policy(p.spec) == p``."""
        value = self.value
        if isinstance(value, float):
            return f"{self.kind}:{'inf' if math.isinf(value) else repr(value)}"
        return f"{self.kind}:{value}"

    def rule(self) -> dict[str, Any] | None:
        """The kind's rule table (``portable.decide``: JSON-able), which every loop and the
        bundle run; None for a kind that decides on tensors itself (overriding ``decide``)."""
        return None

    def decision(self) -> host.Decision | None:
        """``portable.decide.Decision`` of ``rule`` (made once), None without a rule."""
        cache = self.__dict__
        if "_decision" not in cache:
            rule = self.rule()
            cache["_decision"] = host.Decision(rule) if rule is not None else None
        return cache["_decision"]

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> PolicyState:
        """Initial per-row state for ``batch_size`` rows (empty for stateless policies)."""
        decision = self.decision()
        if decision is None:
            return {}
        return tensor_state(decision.init_state(batch_size), device)

    def never_exits(self, num_shallow_exits: int) -> bool:
        """True when no row can leave at any of ``num_shallow_exits`` shallow exits, whatever
        the logits (the loop then runs the plain full-depth forward)."""
        return num_shallow_exits == 0

    def exits(self, shallow_exit_layers: Sequence[int]) -> tuple[int, ...]:
        """The shallow exits (of the model's ``shallow_exit_layers``) the policy decides at, in
        order: the only ones whose heads run. Every one by default; ``ValueError`` when the
        policy names an exit the model does not have."""
        return tuple(shallow_exit_layers)

    def decide(self, logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
        """Decide which rows exit at the current exit: the rule's decision
        (``portable.decide.Decision``) on the host, its result back on the logits' device.

        Args:
            logits: B x K logits of the current exit for the rows still running.
            state: per-row state for those B rows (from ``init_state`` or the previous call,
                indexed with the rows that stayed).
        Returns:
            ``(exit_mask, new_state)``: exit_mask is a B bool tensor (True = leaves now);
            new_state holds B-row tensors (the caller removes the exiting rows itself).
        """
        decision = self.decision()
        if decision is None:
            raise NotImplementedError(f"{type(self).__name__}: no rule; override decide")
        leave, new = decision.decide(on_host(logits), host_state(state))
        return torch.from_numpy(leave).to(logits.device), tensor_state(new, logits.device)

    @classmethod
    def value_name(cls) -> str:
        """What the value is called in messages (``patience``, ``entropy threshold``)."""
        return cls.kind

    @classmethod
    def _bad(cls, value: Any) -> ValueError:
        """The one message of a value outside ``value_range``."""
        return ValueError(f"{cls.value_name()} must be {cls.value_range}, got {value!r}")


@dataclass(frozen=True)
class ConfidencePolicy(ExitPolicy):
    """A stateless policy: a per-row confidence ``score`` of the logits against ``threshold``.

    ``bounds`` are the thresholds allowed (inclusive); ``exits_above``: a row leaves when its
    score is ``>= threshold`` (else when it is ``< threshold``).
    """

    threshold: float
    bounds: ClassVar[tuple[float, float]]
    exits_above: ClassVar[bool]

    def __post_init__(self) -> None:
        low, high = self.bounds
        t = self.threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not low <= t <= high:
            raise self._bad(t)

    @classmethod
    def value_name(cls) -> str:
        return f"{cls.kind} threshold"

    @classmethod
    def from_value(cls, value: Any) -> ConfidencePolicy:
        try:
            threshold = float(value)
        except (TypeError, ValueError):
            raise cls._bad(value) from None
        return cls(threshold)

    @property
    def value(self) -> float:
        return float(self.threshold)

    @staticmethod
    @abstractmethod
    def score(logits: Tensor) -> Tensor:
        """B x K logits -> B confidence scores (float32, ``portable.decide``'s)."""

    @classmethod
    def always_exits(cls) -> float:
        """The threshold every row passes (``inf`` for entropy, 0 for maxprob)."""
        return cls.bounds[0] if cls.exits_above else cls.bounds[1]

    @classmethod
    def clip(cls, threshold: float) -> float:
        """``threshold`` brought into ``bounds``."""
        low, high = cls.bounds
        return max(low, min(high, threshold))

    def rule(self) -> dict[str, Any]:
        return {"kind": self.kind, "threshold": host.json_number(self.threshold)}


@register_policy
@dataclass(frozen=True)
class EntropyPolicy(ConfidencePolicy):
    """DeeBERT: exit when the entropy (nats) of ``softmax(logits)`` is below ``threshold``."""

    kind: ClassVar[str] = "entropy"
    value_range: ClassVar[str] = "a number >= 0 (nats; inf always exits)"
    bounds: ClassVar[tuple[float, float]] = (0.0, math.inf)
    exits_above: ClassVar[bool] = False

    @staticmethod
    def score(logits: Tensor) -> Tensor:
        return softmax_entropy(logits)

    @staticmethod
    def default_grid(num_classes: int, num_shallow_exits: int) -> list[float]:
        """0 .. ln(K) in 10 steps."""
        top = math.log(num_classes)
        return [round(top * i / 10, 4) for i in range(11)]

    def never_exits(self, num_shallow_exits: int) -> bool:
        """Entropy is ``>= 0``, so a threshold of 0 never lets a row out."""
        return self.threshold == 0 or num_shallow_exits == 0


@register_policy
@dataclass(frozen=True)
class MaxProbPolicy(ConfidencePolicy):
    """Exit when the largest softmax probability is ``>= threshold``."""

    kind: ClassVar[str] = "maxprob"
    value_range: ClassVar[str] = "a number in [0, 1]"
    bounds: ClassVar[tuple[float, float]] = (0.0, 1.0)
    exits_above: ClassVar[bool] = True

    @staticmethod
    def score(logits: Tensor) -> Tensor:
        return torch.from_numpy(host.maxprob(on_host(logits))).to(logits.device)

    @staticmethod
    def default_grid(num_classes: int, num_shallow_exits: int) -> list[float]:
        """1.0 .. 1/K in 10 steps (for K = 2: 1.0 .. 0.5)."""
        low = 1.0 / num_classes
        return [round(1.0 - (1.0 - low) * i / 10, 4) for i in range(11)]


@register_policy
@dataclass(frozen=True)
class PatiencePolicy(ExitPolicy):
    """PABEE: exit once ``patience`` consecutive exits repeated the previous exit's argmax.

    State: ``counter`` (B, long; 0 at start) and ``prev_pred`` (B, long; -1 = no previous
    exit). At each exit ``counter = counter + 1`` if ``argmax == prev_pred`` else 0, and rows
    with ``counter >= patience`` exit.
    """

    patience: int
    kind: ClassVar[str] = "patience"
    value_range: ClassVar[str] = "an integer >= 0"

    def __post_init__(self) -> None:
        p = self.patience
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise self._bad(p)

    @classmethod
    def from_value(cls, value: Any) -> PatiencePolicy:
        try:
            number = float(value)
            patience = int(value) if isinstance(value, str) else int(number)
        except (TypeError, ValueError, OverflowError):
            raise cls._bad(value) from None
        if number != patience:
            raise cls._bad(value)
        return cls(patience)

    @property
    def value(self) -> int:  # type: ignore[override]
        return self.patience

    @staticmethod
    def default_grid(num_classes: int, num_shallow_exits: int) -> list[float]:
        """E .. 0 for E shallow exits (patience E never exits early)."""
        return [float(p) for p in range(num_shallow_exits, -1, -1)]

    def never_exits(self, num_shallow_exits: int) -> bool:
        """Patience ``t`` exits at the ``(t+1)``-th shallow exit at the earliest."""
        return self.patience >= num_shallow_exits

    def rule(self) -> dict[str, Any]:
        return {"kind": "patience", "patience": self.patience}


def policy_kind(kind: str) -> type[ExitPolicy]:
    """The class of ``kind`` (a ``POLICIES`` name); ``ValueError`` listing the kinds."""
    if kind not in POLICIES:
        raise ValueError(f"unknown exit policy {kind!r}: expected one of {', '.join(POLICIES)}")
    return POLICIES[kind]


def make_policy(kind: str, value: Any) -> ExitPolicy:
    """The policy of ``kind`` (a ``POLICIES`` name) at ``value`` (a number or its string)."""
    return policy_kind(kind).from_value(value)


def parse_policy(spec: str) -> ExitPolicy:
    """Build a policy from ``KIND:VALUE``: ``"entropy:0.3"``, ``"maxprob:0.9"``, ``"patience:2"``,
    ``"per_exit_entropy:2=0.1,4=0.3"``.

    The kind is case-insensitive; surrounding spaces are ignored. Raises ``ValueError`` naming
    ``spec`` for an unknown kind, a missing value or a value outside the kind's range.
    """
    syntax = _SYNTAX.format(kinds=", ".join(POLICIES))
    if not isinstance(spec, str):
        raise ValueError(f"exit policy must be a string {syntax}, got {spec!r}")
    kind, sep, value = spec.strip().partition(":")
    kind, value = kind.strip().lower(), value.strip()
    if not sep or not value:
        raise ValueError(f"bad exit policy {spec!r}: expected {syntax}")
    try:
        return make_policy(kind, value)
    except ValueError as e:
        raise ValueError(f"bad exit policy {spec!r}: {e}") from None


def as_policy(policy: ExitPolicy | str) -> ExitPolicy:
    """Return ``policy`` itself, or ``parse_policy(policy)`` for a string."""
    if isinstance(policy, ExitPolicy):
        return policy
    return parse_policy(policy)
