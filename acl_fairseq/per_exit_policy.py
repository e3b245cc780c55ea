"""A policy with its own threshold at every exit, optionally with PABEE's patience (pure torch).

``PerExitPolicy(kind, layers, thresholds, patience=None)`` decides at the shallow exits
``layers`` (1-based encoder layers, increasing; a subset of the model's shallow exits) and at
no other: a row leaves at ``layers[e]`` when its confidence there passes ``thresholds[e]``
(``entropy``: the entropy of ``softmax(logits)`` is below it; ``maxprob``: the top probability
is at least it, as ``EntropyPolicy`` / ``MaxProbPolicy``), or, with ``patience=p``, when the
last ``p`` of these exits repeated the previous one's argmax (``PatiencePolicy``'s counter over
the policy's exits): "patience or confidence".

The exits the policy leaves out are not evaluated at all: their heads need not run (the
policy-level "skip exits" list). The caller evaluates exactly ``policy.layers`` plus the final
exit and calls ``decide`` at each of ``layers`` in order; ``only_policy_exits`` /
``policy_exit_logits`` do that for the loop and the one-pass simulation. State: ``step``
(B, long: how many of the policy's exits the row has passed) and, with patience, PABEE's
``counter`` and ``prev_pred``.

Written as a string (``spec``; ``parse_per_exit`` reads it back)::

    per_exit_entropy:2=0.12,3=0.31,5=0.5            # exits 2, 3, 5 (1, 4 skipped)
    per_exit_maxprob:1=0.99,2=0.95;patience=2
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .exit_policies import (
    EntropyPolicy,
    ExitPolicy,
    MaxProbPolicy,
    PatiencePolicy,
    PolicyState,
    softmax_entropy,
)

__all__ = [
    "KINDS",
    "PerExitPolicy",
    "only_policy_exits",
    "parse_per_exit",
    "policy_exit_logits",
]

KINDS = ("entropy", "maxprob")
PREFIX = "per_exit_"


@dataclass(frozen=True)
class PerExitPolicy(ExitPolicy):
    """Per-exit thresholds at the shallow exits ``layers``; see the module docstring."""

    kind: str
    layers: tuple[int, ...]
    thresholds: tuple[float, ...]
    patience: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"per-exit policy kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "layers", tuple(int(v) for v in self.layers))
        object.__setattr__(self, "thresholds", tuple(float(v) for v in self.thresholds))
        if len(self.layers) != len(self.thresholds):
            raise ValueError(
                f"per-exit policy: {len(self.layers)} layers but {len(self.thresholds)} thresholds"
            )
        if any(b <= a for a, b in zip(self.layers, self.layers[1:])) or any(
            v < 1 for v in self.layers
        ):
            raise ValueError(f"per-exit policy: layers must increase from 1, got {self.layers}")
        for t in self.thresholds:  # validated by the single-threshold policies
            self._single(t)
        if self.patience is not None:
            PatiencePolicy(self.patience)

    def _single(self, threshold: float) -> ExitPolicy:
        return EntropyPolicy(threshold) if self.kind == "entropy" else MaxProbPolicy(threshold)

    # ------------------------------------------------------------------ properties

    def can_exit(self, index: int) -> bool:
        """True when a row can leave by confidence at the policy's ``index``-th exit."""
        return not self._single(self.thresholds[index]).never_exits(1)

    def never_exits(self, num_shallow_exits: int) -> bool:
        """No exit can fire: every threshold never passes and patience (if any) is never
        reached over the policy's exits."""
        if not self.layers:
            return True
        confident = any(self.can_exit(e) for e in range(len(self.layers)))
        patient = self.patience is not None and self.patience < len(self.layers)
        return not (confident or patient)

    def check_exits(self, shallow_exit_layers: Sequence[int]) -> None:
        """Raise ``ValueError`` unless the policy's exits are among the model's."""
        missing = sorted(set(self.layers) - set(shallow_exit_layers))
        if missing:
            raise ValueError(
                f"policy {self.spec()} decides at layers {missing}, where the model has no "
                f"shallow exit (it has {', '.join(map(str, shallow_exit_layers)) or 'none'})"
            )

    # ------------------------------------------------------------------ decisions

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> PolicyState:
        state = {"step": torch.zeros(batch_size, dtype=torch.long, device=device)}
        if self.patience is not None:
            state.update(PatiencePolicy(self.patience).init_state(batch_size, device))
        return state

    def _too_many(self) -> ValueError:
        return ValueError(
            f"policy {self.spec()} has {len(self.layers)} exits but was asked to decide at "
            "more: evaluate only its exits (only_policy_exits / policy_exit_logits)"
        )

    def _table(self, device: torch.device) -> Tensor:
        """The thresholds as a float32 tensor on ``device`` (cached): the single-threshold
        policies compare float32 values with the threshold rounded to float32 too."""
        cache = self.__dict__.setdefault("_tables", {})
        if device not in cache:
            cache[device] = torch.tensor(self.thresholds, dtype=torch.float32, device=device)
        return cache[device]

    def decide(self, logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
        """Per row, the threshold of the exit the row is at (``step``); no host sync."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be B x K, got shape {tuple(logits.shape)}")
        step = state["step"]
        try:
            limit = self._table(logits.device)[step]
        except IndexError:
            raise self._too_many() from None
        if self.kind == "entropy":
            exit_mask = softmax_entropy(logits) < limit
        else:
            exit_mask = torch.softmax(logits.float(), dim=-1).amax(dim=-1) >= limit
        new_state = {"step": step + 1}
        if self.patience is not None:
            patient, counters = PatiencePolicy(self.patience).decide(
                logits, {"counter": state["counter"], "prev_pred": state["prev_pred"]}
            )
            exit_mask = exit_mask | patient
            new_state.update(counters)
        return exit_mask, new_state

    def init_row_state(self, device: torch.device | str | None = None) -> tuple[int, Any]:
        """``(step, patience row state or None)``."""
        patience = (
            PatiencePolicy(self.patience).init_row_state() if self.patience is not None else None
        )
        return 0, patience

    def decide_row(self, logits: Tensor, state: tuple[int, Any]) -> tuple[bool, tuple[int, Any]]:
        """The single-threshold policies' host decision at this exit (same as ``decide``)."""
        step, patience_state = state
        if step >= len(self.layers):
            raise self._too_many()
        leaves, _ = self._single(self.thresholds[step]).decide_row(logits, None)
        if self.patience is not None:
            patient, patience_state = PatiencePolicy(self.patience).decide_row(
                logits, patience_state
            )
            leaves = leaves or patient
        return leaves, (step + 1, patience_state)

    # ------------------------------------------------------------------ text form

    def spec(self) -> str:
        """The string ``parse_per_exit`` reads back (thresholds at full precision)."""

        def number(t: float) -> str:
            return "inf" if math.isinf(t) else repr(float(t))

        pairs = ",".join(f"{layer}={number(t)}" for layer, t in zip(self.layers, self.thresholds))
        text = f"{PREFIX}{self.kind}:{pairs or 'none'}"
        return text if self.patience is None else f"{text};patience={self.patience}"

    def __str__(self) -> str:
        return self.spec()


def parse_per_exit(spec: str) -> PerExitPolicy:
    """``per_exit_entropy:2=0.1,4=0.3[;patience=P]`` (or ``per_exit_maxprob:...``; ``none``
    for no exit) -> ``PerExitPolicy``. Raises ``ValueError`` naming what is wrong."""
    syntax = "per_exit_entropy:LAYER=T,LAYER=T[;patience=P] (or per_exit_maxprob:...)"
    text = spec.strip()
    head, sep, body = text.partition(":")
    kind = head.strip().lower()[len(PREFIX) :] if head.strip().lower().startswith(PREFIX) else ""
    if not sep or kind not in KINDS:
        raise ValueError(f"bad per-exit policy {spec!r}: expected {syntax}")
    body, _, extra = body.partition(";")
    patience = None
    if extra.strip():
        name, _, value = extra.partition("=")
        if name.strip().lower() != "patience":
            raise ValueError(f"bad per-exit policy {spec!r}: unknown option {name.strip()!r}")
        try:
            patience = int(value)
        except ValueError:
            raise ValueError(f"bad per-exit policy {spec!r}: patience must be an integer") from None
    layers, thresholds = [], []
    if body.strip().lower() != "none":
        for item in body.split(","):
            layer, eq, value = item.partition("=")
            try:
                layers.append(int(layer))
                thresholds.append(float(value))
            except ValueError:
                raise ValueError(
                    f"bad per-exit policy {spec!r}: {item.strip()!r} is not LAYER=THRESHOLD"
                ) from None
            if not eq:
                raise ValueError(f"bad per-exit policy {spec!r}: expected {syntax}")
    return PerExitPolicy(kind, tuple(layers), tuple(thresholds), patience)


def policy_exit_logits(
    exit_logits: Sequence[tuple[int, Tensor]], policy: ExitPolicy
) -> list[tuple[int, Tensor]]:
    """The entries of ``[(layer, N x K)]`` the policy evaluates: its exits and the final one
    (all of them for a policy without ``layers``), for ``exit_curve.simulate_exits``."""
    layers = getattr(policy, "layers", None)
    if layers is None:
        return list(exit_logits)
    available = [layer for layer, _ in exit_logits[:-1]]
    if isinstance(policy, PerExitPolicy):
        policy.check_exits(available)
    keep = set(layers)
    return [(layer, x) for layer, x in exit_logits[:-1] if layer in keep] + [exit_logits[-1]]


@contextlib.contextmanager
def only_policy_exits(model: Any, policy: ExitPolicy) -> Iterator[Any]:
    """Within the block, ``model`` (a ``MultiExitRobertaModel``) evaluates only the policy's
    shallow exits (``model.shallow_exit_layers`` narrowed to ``policy.layers``), so that
    ``model.early_exit(tokens, policy)`` skips the other heads. No-op for other policies."""
    layers = getattr(policy, "layers", None)
    if layers is None:
        yield model
        return
    saved = model.shallow_exit_layers
    if isinstance(policy, PerExitPolicy):
        policy.check_exits(saved)
    model.shallow_exit_layers = tuple(layers)
    try:
        yield model
    finally:
        model.shallow_exit_layers = saved
