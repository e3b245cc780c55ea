"""The early-exit policy chosen for a checkpoint: ``CHECKPOINT_DIR/early_exit_policy.json``.

Written by ``acl-fairseq-sweep --max-accuracy-drop D | --target-speedup S`` (``deploy``) and
read by ``acl-fairseq-predict`` (``--policy saved``, the default) and by the hub interface
(``from_pretrained(...).predict_early_exit(head, tokens)`` with no policy). The file::

    {"policy": "per_exit_entropy:1=0.05,3=0.21", "dtype": "int8", "exits": [1, 3],
     "chosen_by": {"target": {"max_accuracy_drop": 1.0}, "constraint": "agreement",
                   "method": "calibrated", "head_cost": 0.03, "split": "valid",
                   "examples": 872, "batch_size": 1},
     "checkpoint": "checkpoint_best.pt", "model_sha256": "5f0c...",
     "accuracy": 91.2, "full_accuracy": 91.9, ...,
     "by_dtype": {"int8": {"policy": "...", "accuracy": 91.2, ...},
                  "fp32": {"policy": "...", ...}}}

The file belongs to the folder, the policy to one model: ``model_sha256`` (``model_fingerprint``)
names the weights it was chosen on, so that ``checkpoint_last.pt``, a checkpoint retrained after
the sweep or another model's copied next to it does not run it (``SavedPolicy.mismatch``: why
not, in one line). A copy of the same checkpoint, or one saved without its optimizer state,
keeps its fingerprint.

``policy`` and ``dtype`` are what ``predict`` runs by default (its ``--dtype`` defaults to this
``dtype``, fp32 for a file without one); ``by_dtype`` holds the policy chosen at each precision
the sweep measured (``--dtype bf16`` picks the bf16 one). ``backend`` (``onnxruntime`` when the
sweep chose on the ONNX Runtime segments; each ``by_dtype`` entry has its own, ``backend_at``)
is ``predict``'s default ``--backend``. ``exits`` (the shallow exits whose heads run: the rest
are skipped) and every other field are for the reader. Policies are read through the registry
(``parse_policy``) and precisions through ``check_precision``.

No fairseq import: this is the one reader and writer of that file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic_write import write_text
from ..early_exit.policies import ExitPolicy, parse_policy
from ..runtime.precision import check_precision

__all__ = [
    "FINGERPRINT",
    "POLICY_FILE",
    "SavedPolicy",
    "policy_path",
    "read_policy",
    "write_policy",
]

POLICY_FILE = "early_exit_policy.json"
FINGERPRINT = "model_sha256"
SWEEP = "acl-fairseq-sweep CHECKPOINT DATA --max-accuracy-drop D"


@dataclass(frozen=True)
class SavedPolicy:
    """The file of ``path``: its default policy and precision (parsed), the policy of every
    precision in it, and every other field."""

    policy: ExitPolicy
    path: Path
    fields: dict[str, Any] = field(default_factory=dict)
    dtype: str = "fp32"
    by_dtype: dict[str, ExitPolicy] = field(default_factory=dict)

    def describe(self) -> str:
        """``dtype ..., target ..., split ..., accuracy ..., layer_speedup ...`` (those
        present; the target and split of ``chosen_by`` in newer files)."""
        chosen = self.fields.get("chosen_by") or {}
        values = {"dtype": self.dtype, **chosen, **self.fields}
        keys = ("dtype", "backend", "target", "constraint", "split", "accuracy", "layer_speedup")
        keys += ("warning",)  # the sweep's, on a policy that ignores the row
        return ", ".join(f"{k} {values[k]}" for k in keys if k in values)

    def backend_at(self, dtype: str | None = None) -> str | None:
        """The backend the sweep chose on for precision ``dtype`` (default: the file's default
        precision), or None when the file does not say."""
        dtype = self.dtype if dtype is None else check_precision(dtype)
        entry = (self.fields.get("by_dtype") or {}).get(dtype)
        if isinstance(entry, dict) and "backend" in entry:
            return entry["backend"]
        return self.fields.get("backend") if dtype == self.dtype else None

    def for_dtype(self, dtype: str) -> ExitPolicy | None:
        """The policy chosen at precision ``dtype``, or None when the file has none for it."""
        dtype = check_precision(dtype)
        if dtype in self.by_dtype:
            return self.by_dtype[dtype]
        return self.policy if dtype == self.dtype else None

    def policy_at(self, dtype: str) -> tuple[ExitPolicy, str]:
        """``(policy to run at dtype, note)``: the one chosen at ``dtype``, else the default
        one, with a note saying so (empty when the file has one for ``dtype``)."""
        policy = self.for_dtype(dtype)
        if policy is not None:
            return policy, ""
        return self.policy, (
            f"chosen at {self.dtype}, none for {check_precision(dtype)} in the file: "
            f"acl-fairseq-sweep --dtypes {check_precision(dtype)} chooses one"
        )

    def mismatch(self, fingerprint: str, checkpoint: str | Path) -> str:
        """Why this file's policy is not for ``checkpoint`` (whose weights have
        ``model_fingerprint`` ``fingerprint``), in one line; empty when it was chosen on it."""
        recorded = self.fields.get(FINGERPRINT)
        if recorded == fingerprint:
            return ""
        fix = f"rerun {SWEEP.replace('CHECKPOINT', str(checkpoint))} to choose one for it"
        if not recorded:
            return (
                f"{self.path} does not record the model it was chosen on (written by an older "
                f"acl-fairseq-sweep), so it may not be {checkpoint}'s: {fix}"
            )
        chosen_on = self.fields.get("checkpoint", "another checkpoint")
        return (
            f"{self.path} was chosen on other weights ({chosen_on} as it was then) than "
            f"{checkpoint}'s: {fix}"
        )


def policy_path(checkpoint: str | Path) -> Path:
    """Where the policy of ``checkpoint`` (a file, or its folder) lives."""
    checkpoint = Path(checkpoint)
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    return folder / POLICY_FILE


def write_policy(
    checkpoint: str | Path,
    policy: ExitPolicy,
    dtype: str | None = None,
    by_dtype: dict[str, dict[str, Any]] | None = None,
    fingerprint: str | None = None,
    **fields: Any,
) -> Path:
    """Write ``policy`` (as its ``spec``), its ``dtype`` and ``fields`` next to
    ``checkpoint``; ``by_dtype``: ``{dtype: {"policy": ExitPolicy, **its fields}}``;
    ``fingerprint``: the ``model_fingerprint`` of the checkpoint it was chosen on.

    Returns the path written. The file is written beside and renamed (``atomic_write``): a
    failed write leaves the previous file as it was.
    """
    path = policy_path(checkpoint)
    record: dict[str, Any] = {"policy": policy.spec}
    if dtype is not None:
        record["dtype"] = check_precision(dtype)
    record.update(fields)
    if Path(checkpoint).is_file():
        record.setdefault("checkpoint", Path(checkpoint).name)
    if fingerprint is not None:
        record[FINGERPRINT] = fingerprint
    if by_dtype:
        record["by_dtype"] = {
            check_precision(d): {**entry, "policy": entry["policy"].spec}
            for d, entry in by_dtype.items()
        }
    return write_text(path, json.dumps(record, indent=2, sort_keys=False) + "\n")


def read_policy(checkpoint: str | Path) -> SavedPolicy | None:
    """The saved policy of ``checkpoint``, or ``None`` when there is no file.

    Raises ``ValueError`` naming the file when it is not valid JSON, or a policy or a
    precision in it is bad.
    """
    path = policy_path(checkpoint)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it or rerun the sweep") from None
    if not isinstance(record, dict) or "policy" not in record:
        raise ValueError(f"{path}: no 'policy' field; delete it or rerun the sweep")
    entries = record.get("by_dtype") or {}
    if not isinstance(entries, dict) or not all(
        isinstance(e, dict) and "policy" in e for e in entries.values()
    ):
        raise ValueError(f"{path}: 'by_dtype' must map each dtype to an entry with a 'policy'")
    try:
        policy = parse_policy(record["policy"])
        dtype = check_precision(record.get("dtype", "fp32"))
        by_dtype = {check_precision(d): parse_policy(e["policy"]) for d, e in entries.items()}
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    fields = {k: v for k, v in record.items() if k not in ("policy", "dtype")}
    return SavedPolicy(policy, path, fields, dtype, by_dtype)
