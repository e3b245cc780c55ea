"""Per-exit thresholds, optionally with PABEE's patience: two kinds of the policy registry.

``per_exit_entropy:2=0.12,3=0.31,5=0.5`` decides at the shallow exits 2, 3 and 5 and at no
other: a row leaves at exit 2 when the entropy of its ``softmax`` there is below 0.12 (the rule
of ``EntropyPolicy``), at exit 3 below 0.31, ... (``per_exit_maxprob``: the top probability at
least the exit's threshold, as ``MaxProbPolicy``). The exits the policy does not name are not
evaluated at all: their heads do not run (``exits``: the policy-level skip list). With
``;patience=P`` a row also leaves once ``P`` of the policy's exits in a row repeated the
previous one's argmax (``PatiencePolicy``'s counter over the policy's exits): "patience or
confidence". ``per_exit_entropy:none`` never leaves early.

The thresholds are fitted to a labelled split by ``early_exit.calibrate`` (``calibrated``: the
sweep has no grid for these kinds). Each threshold is checked by the single-threshold kind's
own constructor, the patience by ``PatiencePolicy``'s. The decision is the rule's
(``portable.decide``): state per row ``step`` (how many of the policy's exits the row has
passed) and, with patience, PABEE's ``counter`` and ``prev_pred``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..portable import decide as host
from .policies import (
    ConfidencePolicy,
    EntropyPolicy,
    ExitPolicy,
    MaxProbPolicy,
    PatiencePolicy,
    register_policy,
)

__all__ = ["PerExitEntropyPolicy", "PerExitMaxProbPolicy", "PerExitPolicy", "per_exit_policy"]

PREFIX = "per_exit_"


@dataclass(frozen=True)
class PerExitPolicy(ExitPolicy):
    """A threshold per named shallow exit (``layers``, increasing), optional patience; see the
    module docstring. ``single`` is the kind whose rule applies at each exit."""

    layers: tuple[int, ...]
    thresholds: tuple[float, ...]
    patience: int | None = None
    single: ClassVar[type[ConfidencePolicy]]
    calibrated: ClassVar[bool] = True
    value_range: ClassVar[str] = (
        "LAYER=THRESHOLD pairs with increasing layers (e.g. 2=0.1,4=0.3) or none, optionally "
        "followed by ;patience=P"
    )

    def __post_init__(self) -> None:
        try:
            layers = tuple(int(v) for v in self.layers)
            thresholds = tuple(float(v) for v in self.thresholds)
        except (TypeError, ValueError):
            raise self._bad(self.value_text(self.layers, self.thresholds)) from None
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "thresholds", thresholds)
        if len(layers) != len(thresholds):
            raise ValueError(f"{self.kind}: {len(layers)} layers but {len(thresholds)} thresholds")
        if any(b <= a for a, b in zip(layers, layers[1:])) or any(v < 1 for v in layers):
            raise ValueError(f"{self.kind}: layers must increase from 1, got {layers}")
        for t in thresholds:  # the single-threshold kind's range check
            self.single(t)
        if self.patience is not None:
            PatiencePolicy(self.patience)

    # ------------------------------------------------------------------ text form

    @staticmethod
    def value_text(layers: Sequence[Any], thresholds: Sequence[Any], patience: Any = None) -> str:
        def number(t: Any) -> str:
            return "inf" if isinstance(t, float) and math.isinf(t) else repr(t)

        pairs = ",".join(f"{layer}={number(t)}" for layer, t in zip(layers, thresholds))
        return (pairs or "none") + ("" if patience is None else f";patience={patience}")

    @property
    def value(self) -> str:
        """``2=0.12,3=0.31[;patience=P]`` (thresholds at full precision), ``none`` for no exit."""
        return self.value_text(self.layers, self.thresholds, self.patience)

    @classmethod
    def from_value(cls, value: Any) -> PerExitPolicy:
        text = str(value).strip()
        body, _, extra = text.partition(";")
        patience = None
        if extra.strip():
            name, eq, number = extra.partition("=")
            if name.strip().lower() != "patience" or not eq:
                raise ValueError(f"{cls.kind}: unknown option {extra.strip()!r} (only patience=P)")
            try:
                patience = int(number)
            except ValueError:
                raise ValueError(
                    f"{cls.kind}: patience must be an integer, got {number!r}"
                ) from None
        layers, thresholds = [], []
        if body.strip().lower() != "none":
            for item in body.split(","):
                layer, eq, threshold = item.partition("=")
                try:
                    layers.append(int(layer))
                    thresholds.append(float(threshold))
                except ValueError:
                    eq = ""
                if not eq:
                    raise cls._bad(text)
        return cls(tuple(layers), tuple(thresholds), patience)

    @staticmethod
    def default_grid(num_classes: int, num_shallow_exits: int) -> list[float]:
        """None: the thresholds are calibrated on a split (``early_exit.calibrate``)."""
        return []

    # ------------------------------------------------------------------ exits

    def exits(self, shallow_exit_layers: Sequence[int]) -> tuple[int, ...]:
        missing = sorted(set(self.layers) - set(shallow_exit_layers))
        if missing:
            have = ", ".join(map(str, shallow_exit_layers)) or "none"
            raise ValueError(
                f"policy {self.spec} decides at layer(s) {missing}, where the model has no "
                f"shallow exit (it has {have}): calibrate it again on this checkpoint "
                "(acl-fairseq-sweep)"
            )
        return self.layers

    def never_exits(self, num_shallow_exits: int) -> bool:
        """No row can leave: no threshold ever passes and patience (if any) is never reached
        over the policy's own exits (``num_shallow_exits`` is not used)."""
        confident = any(not self.single(t).never_exits(1) for t in self.thresholds)
        patient = self.patience is not None and self.patience < len(self.layers)
        return not (confident or patient)

    # ------------------------------------------------------------------ decisions

    def rule(self) -> dict[str, Any]:
        """Call the decision at the policy's ``exits`` only, in order (a call past them is a
        ``ValueError``)."""
        return {
            "kind": self.kind,
            "layers": list(self.layers),
            "thresholds": [host.json_number(t) for t in self.thresholds],
            "patience": self.patience,
        }


@register_policy
@dataclass(frozen=True)
class PerExitEntropyPolicy(PerExitPolicy):
    """``EntropyPolicy``'s rule with a threshold per exit."""

    kind: ClassVar[str] = "per_exit_entropy"
    single: ClassVar[type[ConfidencePolicy]] = EntropyPolicy


@register_policy
@dataclass(frozen=True)
class PerExitMaxProbPolicy(PerExitPolicy):
    """``MaxProbPolicy``'s rule with a threshold per exit."""

    kind: ClassVar[str] = "per_exit_maxprob"
    single: ClassVar[type[ConfidencePolicy]] = MaxProbPolicy


def per_exit_policy(
    single_kind: str,
    layers: Sequence[int],
    thresholds: Sequence[float],
    patience: int | None = None,
) -> PerExitPolicy:
    """The per-exit policy of the single kind ``entropy`` or ``maxprob``."""
    kinds = {cls.single.kind: cls for cls in (PerExitEntropyPolicy, PerExitMaxProbPolicy)}
    if single_kind not in kinds:
        raise ValueError(f"per-exit thresholds exist for {sorted(kinds)}, not {single_kind!r}")
    return kinds[single_kind](tuple(layers), tuple(thresholds), patience)
