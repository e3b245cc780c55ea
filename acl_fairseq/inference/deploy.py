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

``choose`` returns the policy and how it was chosen, and refuses one that would be slower than
full depth by its cost in layers (``--head-cost`` per exit evaluated); ``check_measured`` refuses
one that the sweep timed slower than full depth. ``save`` writes every precision's choice to
``early_exit_policy.json`` (``saved_policy``), the first precision as the default, tied to the
checkpoint's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor

from ..early_exit.calibrate import CONSTRAINTS, calibrate, evaluate
from ..early_exit.evidence import check_split, degenerate
from ..early_exit.policies import ExitPolicy, make_policy
from ..early_exit.risk_control import risk_controlled_kind
from ..early_exit.thresholds import ExitLogits, TargetError, choose_row
from ..runtime.onnx_runtime import BACKENDS
from .saved_policy import write_policy

__all__ = [
    "Choice",
    "DeployTarget",
    "HeadCosts",
    "check_measured",
    "choose",
    "entry",
    "head_costs",
    "save",
]

ORT_BACKEND = BACKENDS[1]


class HeadCosts(NamedTuple):
    """``--head-cost``: an exit head's cost in layers, by precision or on ONNX Runtime (whose
    exits are session boundaries), else ``default``."""

    default: float
    own: dict[str, float]

    def at(self, dtype: str, backend: str = "fairseq") -> float:
        """The cost for ``dtype`` on ``backend``: the backend's own for onnxruntime, else the
        precision's, else the default."""
        if backend == ORT_BACKEND and ORT_BACKEND in self.own:
            return self.own[ORT_BACKEND]
        return self.own.get(dtype, self.default)


def head_costs(text: str) -> HeadCosts:
    """``COST`` for every precision and backend, then ``NAME=COST`` for one: a precision
    (fp32, bf16, int8) or ``onnxruntime`` (``ort``), e.g. ``0.1,int8=0.2,onnxruntime=0.4``.
    Raises ``ValueError`` naming ``--head-cost``."""
    from ..runtime.precision import check_precision

    default, own = 0.0, {}
    for item in (v.strip() for v in text.split(",")):
        name, _, value = item.rpartition("=")
        try:
            cost = float(value)
        except ValueError:
            raise ValueError(f"--head-cost: {item!r} is not COST or NAME=COST") from None
        if not cost >= 0:
            raise ValueError(f"--head-cost must be >= 0 layers, got {item!r}")
        if name in (ORT_BACKEND, "ort"):
            own[ORT_BACKEND] = cost
        elif name:
            try:
                own[check_precision(name)] = cost
            except ValueError:
                raise ValueError(
                    f"--head-cost: unknown name {name!r} (fp32, bf16, int8 or onnxruntime)"
                ) from None
        else:
            default = cost
    return HeadCosts(default, own)


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

    A choice that lets every row leave at its first exit whatever its confidence
    (``evidence.degenerate``) carries a ``warning`` in its evidence (printed, and saved).

    Raises:
        TargetError: nothing meets the target, or only full depth does (the message names
            the flag and what to change).
        TooLittleEvidence: ``split`` is too small for the kind (``evidence.check_split``).
    """
    target.check()
    if len(exit_logits) < 2:
        raise ValueError("early exit needs a shallow exit: the model has only its final exit")
    check_split(exit_logits, targets, kind, split)
    choice = _choose(kind, exit_logits, targets, target, rows, split)
    why = degenerate(choice.policy, exit_logits)
    if why:
        choice = choice._replace(evidence={**choice.evidence, "warning": why})
    return choice


def _choose(
    kind: str,
    exit_logits: ExitLogits,
    targets: Tensor,
    target: DeployTarget,
    rows: Sequence[dict[str, Any]],
    split: str,
) -> Choice:
    """``choose`` once the split is checked."""
    if target.target_speedup is not None:
        row = choose_row(rows, target_speedup=target.target_speedup, constraint=target.constraint)
        choice = Choice(make_policy(row["policy"], row["threshold"]), "swept", {})
        return _paying(choice, None, exit_logits, target, split, targets)
    drop = float(target.max_accuracy_drop)  # type: ignore[arg-type]
    n = int(targets.numel())
    if target.risk_control is not None:
        delta = target.risk_control
        result = risk_controlled_kind(kind, exit_logits, drop / 100.0, delta, split)
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
        return _paying(Choice(result.policy, "risk control", evidence), None, exit_logits,
                       target, split, targets)  # fmt: skip
    cal = calibrate(
        kind, exit_logits, targets, drop, target.constraint, target.head_cost, target.patience,
        split,
    )  # fmt: skip
    if cal.policy.never_exits(len(exit_logits) - 1):
        raise TargetError(
            f"--max-accuracy-drop {drop:g} (--constraint {target.constraint}): on {split} no "
            f"{kind} policy lets a row leave before the last layer within {drop:g} points, so "
            "early exit would save nothing: allow a larger drop, or train the shallow exits "
            "longer"
        )
    return _paying(Choice(cal.policy, "calibrated", {}), cal.cost, exit_logits, target, split)


def _paying(
    choice: Choice,
    cost: float | None,
    exit_logits: ExitLogits,
    target: DeployTarget,
    split: str,
    targets: Tensor | None = None,
) -> Choice:
    """``choice`` when its cost (mean exit layer + ``--head-cost`` per exit evaluated; None:
    evaluated here) is below full depth's; else a ``TargetError`` naming the flags that change
    it."""
    if target.head_cost == 0:
        return choice
    if cost is None:
        cost = evaluate(exit_logits, targets, choice.policy, target.head_cost).cost
    layers = exit_logits[-1][0]
    if cost < layers:
        return choice
    raise TargetError(
        f"{choice.policy.spec} ({choice.method}) costs {cost:.2f} layers per row on {split} "
        f"with its exit heads (--head-cost {target.head_cost:g} layers each) against {layers} "
        "at full depth: early exit would be slower than no early exit. Use a per-exit kind "
        "(--policy per_exit_entropy leaves out the exits that do not pay), allow a larger "
        "--max-accuracy-drop, or check --head-cost"
    )


def check_measured(
    policy: ExitPolicy, early_ms: float, full_ms: float, batch_size: int, split: str
) -> None:
    """``TargetError`` when the sweep timed ``policy`` (``early_ms`` per row, at
    ``batch_size`` on ``split``) no faster than full depth (``full_ms``): it is not deployed."""
    if early_ms < full_ms:
        return
    raise TargetError(
        f"{policy.spec} ran {early_ms:.3f} ms per row at batch {batch_size} on {split} against "
        f"{full_ms:.3f} ms at full depth, timed on this machine: early exit would be slower "
        "than no early exit, so it is not deployed. Give the exits' measured --head-cost "
        "(benchmarks/exit_cost_batch1.py) so that a per-exit kind leaves out the exits that do "
        "not pay, allow a larger --max-accuracy-drop, or time on an idle machine (--repeats 0 "
        "chooses without timing)"
    )


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
