"""What runs at inference, decided once: the backend, the precision, the early-exit policy and
the sentence that says why.

``decide`` turns what the user asked (``Request``: ``--backend``, ``--dtype``, ``--policy`` of
``acl-fairseq-predict``, the same arguments of ``from_pretrained``), the checkpoint's saved
choice (``early_exit_policy.json``, read once by the loader and kept only when it was chosen
on these weights) and what the model can do into a ``Plan``. The loader
(``load_for_inference(..., request=...)``) calls it once and builds the model for it; predict,
the hub and the demo's read-back of the sweep's choice all run ``Loaded.plan``.

The rules (docs/inference.md, "What runs"):

* policy: the one asked for; ``none``: full depth; ``saved`` (or nothing asked, when the saved
  choice fits a multi-exit classifier): the saved policy chosen at the plan's precision;
* precision: the one asked for, else the saved choice's default precision, else fp32 (on ONNX
  Runtime, which runs fp32 and int8, a saved bf16 becomes fp32);
* backend: the one asked for, else the one the saved policy was chosen on when that policy
  runs, else fairseq (torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..early_exit.policies import ExitPolicy, parse_policy
from ..errors import AclValueError
from ..runtime.onnx_runtime import BACKENDS, ORT_DTYPES
from ..runtime.precision import check_precision
from .saved_policy import POLICY_FILE, SavedPolicy

__all__ = ["FULL_DEPTH", "FAIRSEQ", "ONNXRUNTIME", "Plan", "PlanError", "Request", "decide"]

FAIRSEQ, ONNXRUNTIME = BACKENDS
FULL_DEPTH = "full depth"
SAVED, NONE = "saved", "none"


class PlanError(AclValueError):
    """What was asked cannot run on this checkpoint; the message names the flag and the fix."""


@dataclass(frozen=True)
class Request:
    """What the user asked for; None: not given (the saved choice, else the default).

    ``policy``: an ``ExitPolicy``, a ``parse_policy`` string, ``"none"`` (full depth) or
    ``"saved"`` (the saved policy, which must exist)."""

    backend: str | None = None
    dtype: str | None = None
    policy: ExitPolicy | str | None = None

    def checked(self) -> Request:
        """The request with its policy parsed and its names checked (``PlanError`` naming the
        flag); before anything is loaded."""
        if self.backend is not None and self.backend not in BACKENDS:
            raise PlanError(f"--backend {self.backend}: must be one of {', '.join(BACKENDS)}")
        dtype = None
        if self.dtype is not None:
            try:
                dtype = check_precision(self.dtype)
            except ValueError:
                raise PlanError(f"--dtype {self.dtype}: must be one of fp32, bf16, int8") from None
        if self.backend == ONNXRUNTIME and dtype not in (None, *ORT_DTYPES):
            raise PlanError(f"--backend onnxruntime runs fp32 or int8, not --dtype {dtype}")
        policy = self.policy
        if isinstance(policy, str):
            name = policy.strip().lower()
            if name in (SAVED, NONE):
                policy = name
            else:
                try:
                    policy = parse_policy(policy)
                except ValueError as e:
                    raise PlanError(f"--policy: {e}") from None
        return Request(self.backend, dtype, policy)

    @property
    def reads_saved(self) -> bool:
        """Whether anything asked for defaults to the saved choice (so the file is read)."""
        return self.policy in (None, SAVED) or self.dtype is None or self.backend is None


@dataclass(frozen=True)
class Plan:
    """What runs: ``backend`` (fairseq or onnxruntime), ``dtype``, ``policy`` (None: full
    depth, the plain forward), its name in a summary (``label``) and the line that says why
    (``why``); ``saved``: the saved choice when it was read and fits these weights."""

    backend: str
    dtype: str
    policy: ExitPolicy | None
    label: str
    why: str
    saved: SavedPolicy | None = None

    @property
    def onnxruntime(self) -> bool:
        return self.backend == ONNXRUNTIME


def decide(
    request: Request,
    saved: SavedPolicy | None,
    saved_note: str = "",
    *,
    shallow_exits: bool = True,
    regression: bool = False,
    what: str = "the checkpoint",
    model_kind: str = "a model without shallow exits",
) -> Plan:
    """The plan for ``request`` (``Request.checked``) on a checkpoint whose saved choice is
    ``saved`` (None: no file, or one not chosen on its weights: ``saved_note`` says why), whose
    model has shallow exits (``shallow_exits``) and is a classifier (not ``regression``);
    ``what`` names the checkpoint and ``model_kind`` its model in an error.

    Raises:
        PlanError: a policy asked for that this model cannot run, or ``--policy saved``
            without a usable saved choice.
    """
    asked = request.policy
    if asked == SAVED and saved is None:
        reason = saved_note or (
            f"no {POLICY_FILE} next to {what}; write one with acl-fairseq-sweep CHECKPOINT "
            "DATA --max-accuracy-drop D (or --target-speedup S), or give a policy such as "
            "entropy:0.3"
        )
        raise PlanError(f"--policy saved: {reason}")
    early_exit_possible = shallow_exits and not regression
    if isinstance(asked, ExitPolicy) or asked == SAVED:
        _check_early_exit(asked, shallow_exits, regression, f"{what} holds {model_kind}")
    from_saved = saved is not None and (asked == SAVED or (asked is None and early_exit_possible))

    dtype = request.dtype or (saved.dtype if saved is not None else "fp32")
    backend = request.backend
    if backend is None:
        chosen_on = saved.backend_at(dtype) if from_saved else None
        backend = chosen_on if chosen_on in BACKENDS else FAIRSEQ
    if backend == ONNXRUNTIME and dtype not in ORT_DTYPES:
        dtype = "fp32"  # a saved bf16 default: ONNX Runtime runs fp32 or int8

    if isinstance(asked, ExitPolicy):
        return Plan(backend, dtype, asked, asked.spec, asked.spec, saved)
    if asked == NONE:
        return Plan(backend, dtype, None, FULL_DEPTH, "full depth (--policy none)", saved)
    if from_saved:
        policy, note = saved.policy_at(dtype)
        why = (
            f"{policy.spec} (saved in {saved.path}: {saved.describe()}"
            f"{note and '; ' + note}; --policy none for full depth)"
        )
        return Plan(backend, dtype, policy, policy.spec, why, saved)
    if saved is not None:
        why = "full depth (the saved policy needs a multi-exit classifier)"
    elif saved_note:
        why = f"full depth, not the saved policy: {saved_note}"
    else:
        why = f"full depth (no {POLICY_FILE} next to the checkpoint)"
    return Plan(backend, dtype, None, FULL_DEPTH, why, saved)


def _check_early_exit(
    asked: ExitPolicy | str, shallow_exits: bool, regression: bool, what: str
) -> None:
    shown = asked.spec if isinstance(asked, ExitPolicy) else asked
    if regression:
        raise PlanError(
            f"--policy {shown}: early exit needs a classification (not regression) model"
        )
    if not shallow_exits:
        raise PlanError(
            f"--policy {shown}: {what}, so only full depth is possible: drop --policy, or use "
            "a stage-2 checkpoint (a multi-exit criterion, --arch multi_exit_roberta*, whose "
            "exits were trained)"
        )
