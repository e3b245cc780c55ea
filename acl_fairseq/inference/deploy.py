"""The policy to deploy, chosen per precision from one pass over every exit, and its file.

``DeployTarget`` holds what the user asked for (``acl-fairseq-sweep``'s flags):

* ``--max-accuracy-drop D`` with ``--constraint agreement`` (the default): the fastest policy
  of the kind that changes at most D percent of the final exit's predictions on the split
  (so its accuracy is at most D points lower there), found exactly (``calibrate``);
  ``--constraint accuracy``: within D points of the final exit's accuracy on the split, which
  over-fits a small dev split (docs/results.md, "Exit policies chosen on dev").
* ``--risk-control DELTA`` (with D): the most aggressive policy whose disagreement with the full
  model is *certified* at most D percent with probability ``1 - DELTA`` (``risk_control``):
  conservative, but a guarantee for new data like the split.
* ``--target-speedup S``: the most accurate (``agreement``: most agreeing) swept row whose
  layer-count speed-up is at least S (``thresholds.choose_row``).

``choose`` returns the policy and how it was chosen; ``save`` writes every precision's choice
to ``early_exit_policy.json`` (``saved_policy``), the first precision as the default, tied to
the checkpoint's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor

from ..early_exit.calibrate import CONSTRAINTS, calibrate, evaluate
from ..early_exit.policies import ExitPolicy, make_policy
from ..early_exit.risk_control import risk_controlled_kind
from ..early_exit.thresholds import ExitLogits, TargetError, choose_row
from .saved_policy import write_policy

__all__ = ["Choice", "DeployTarget", "choose", "entry", "save"]


@dataclass(frozen=True)
class DeployTarget:
    """What the deployed policy must meet; ``check`` names the flag of a bad combination."""

    max_accuracy_drop: float | None = None
    target_speedup: float | None = None
    constraint: str = CONSTRAINTS[0]
    risk_control: float | None = None  # delta
    head_cost: float = 0.0
    patience: int | None = None  # beside a per-exit kind's thresholds

    def check(self) -> None:
        """``ValueError`` naming the flag for a target that cannot be met as asked."""
        if (self.max_accuracy_drop is None) == (self.target_speedup is None):
            raise ValueError("give one of --max-accuracy-drop and --target-speedup, not both")
        if self.max_accuracy_drop is not None and not self.max_accuracy_drop >= 0:
            raise ValueError(
                f"--max-accuracy-drop must be >= 0 points, got {self.max_accuracy_drop}"
            )
        if self.target_speedup is not None and not self.target_speedup >= 1:
            raise ValueError(
                f"--target-speedup must be >= 1 (layer-count), got {self.target_speedup}"
            )
        if self.constraint not in CONSTRAINTS:
            raise ValueError(f"--constraint must be one of {', '.join(CONSTRAINTS)}")
        if self.risk_control is not None:
            if not 0 < self.risk_control < 1:
                raise ValueError(f"--risk-control DELTA must be in (0, 1), got {self.risk_control}")
            if self.max_accuracy_drop is None or not 0 < self.max_accuracy_drop < 100:
                raise ValueError(
                    "--risk-control certifies a disagreement rate: give --max-accuracy-drop D "
                    "with 0 < D < 100 (percent of predictions that may change)"
                )
            if self.constraint != "agreement":
                raise ValueError(
                    "--risk-control certifies the agreement with the full model: drop "
                    "--constraint accuracy"
                )
        if not self.head_cost >= 0:
            raise ValueError(f"--head-cost must be >= 0 layers, got {self.head_cost}")

    def describe(self) -> dict[str, Any]:
        """The fields of ``chosen_by`` in the saved file."""
        target = (
            {"max_accuracy_drop": self.max_accuracy_drop}
            if self.max_accuracy_drop is not None
            else {"target_speedup": self.target_speedup}
        )
        out: dict[str, Any] = {"target": target, "constraint": self.constraint}
        if self.risk_control is not None:
            out["risk_control_delta"] = self.risk_control
        if self.head_cost:
            out["head_cost"] = self.head_cost
        return out


class Choice(NamedTuple):
    """The policy to deploy, how it was chosen (``calibrated``, ``risk control`` or
    ``swept``) and that method's evidence."""

    policy: ExitPolicy
    method: str
    evidence: dict[str, Any]


def choose(
    kind: str,
    exit_logits: ExitLogits,
    targets: Tensor,
    target: DeployTarget,
    rows: Sequence[dict[str, Any]] = (),
    split: str = "the split",
) -> Choice:
    """The ``kind`` policy to deploy for ``target``, from one pass over ``split``
    (``rows``: that pass's sweep rows, for ``--target-speedup``).

    Raises:
        TargetError: nothing meets the target, or only full depth does (the message names
            the flag and what to change).
    """
    target.check()
    if len(exit_logits) < 2:
        raise ValueError("early exit needs a shallow exit: the model has only its final exit")
    if target.target_speedup is not None:
        row = choose_row(rows, target_speedup=target.target_speedup, constraint=target.constraint)
        return Choice(make_policy(row["policy"], row["threshold"]), "swept", {})
    drop = float(target.max_accuracy_drop)  # type: ignore[arg-type]
    n = int(targets.numel())
    if target.risk_control is not None:
        delta = target.risk_control
        result = risk_controlled_kind(kind, exit_logits, drop / 100.0, delta)
        if result.passed == 0:
            halves = (
                " (fitted on one half, certified on the other)"
                if "per_exit" in kind or kind == "learned"
                else ""
            )
            raise TargetError(
                f"--risk-control {delta:g}: no {kind} policy{halves} is certified to change "
                f"at most {drop:g}% of the predictions with probability {1 - delta:g} on the "
                f"{n} rows of {split}: allow a larger --max-accuracy-drop or DELTA, use a "
                "larger split, or drop --risk-control"
            )
        evidence = {
            "disagreement": round(100.0 * result.disagreement, 4),
            "p_value": result.p_value,
            "certified_rows": result.examples,
        }
        return Choice(result.policy, "risk control", evidence)
    cal = calibrate(
        kind, exit_logits, targets, drop, target.constraint, target.head_cost, target.patience
    )
    if cal.policy.never_exits(len(exit_logits) - 1):
        raise TargetError(
            f"--max-accuracy-drop {drop:g} (--constraint {target.constraint}): on {split} no "
            f"{kind} policy lets a row leave before the last layer within {drop:g} points, so "
            "early exit would save nothing: allow a larger drop, or train the shallow exits "
            "longer"
        )
    return Choice(cal.policy, "calibrated", {})


def entry(
    choice: Choice,
    exit_logits: ExitLogits,
    targets: Tensor,
    head_cost: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """The saved file's entry of one precision: the policy, the shallow exits it evaluates, what
    it does on the split (``calibrate.evaluate``), its method's evidence, and ``extra``."""
    result = evaluate(exit_logits, targets, choice.policy, head_cost)
    shallow = [layer for layer, _ in exit_logits[:-1]]
    return {
        "policy": choice.policy,
        "exits": list(choice.policy.exits(shallow)),
        "method": choice.method,
        **choice.evidence,
        "accuracy": round(result.accuracy, 4),
        "full_accuracy": round(result.full_accuracy, 4),
        "agreement": round(result.agreement, 4),
        "mean_exit_layer": round(result.mean_exit_layer, 4),
        "layer_speedup": round(result.layer_speedup, 4),
        **extra,
    }


def save(
    checkpoint: str | Path,
    entries: dict[str, dict[str, Any]],
    target: DeployTarget,
    fingerprint: str,
    **chosen_by: Any,
) -> Path:
    """Write ``entries`` (``{dtype: entry(...)}``, the first the default) next to
    ``checkpoint`` (whose weights have ``model_fingerprint`` ``fingerprint``), with how they
    were chosen (``target`` and ``chosen_by``: split, examples, batch size)."""
    dtype, first = next(iter(entries.items()))
    fields = {k: v for k, v in first.items() if k != "policy"}
    return write_policy(
        checkpoint,
        first["policy"],
        dtype=dtype,
        chosen_by={**target.describe(), **chosen_by},
        **fields,
        by_dtype=entries,
        fingerprint=fingerprint,
    )
