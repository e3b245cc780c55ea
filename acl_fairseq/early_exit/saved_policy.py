"""The early-exit policy chosen for a checkpoint: ``CHECKPOINT_DIR/early_exit_policy.json``.

Written by ``acl-fairseq-sweep --max-accuracy-drop D | --target-speedup S`` and read by
``acl-fairseq-predict`` (``--policy saved``, the default) and by the hub interface
(``from_pretrained(...).predict_early_exit(head, tokens)`` with no policy). The file::

    {"policy": "entropy:0.21", "target": {"max_accuracy_drop": 1.0},
     "checkpoint": "checkpoint_best.pt", "split": "valid", "examples": 872,
     "accuracy": 91.2, "full_accuracy": 91.9, "mean_exit_layer": 5.1,
     "layer_speedup": 2.35}

No fairseq import: this is the one reader and writer of that file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .policies import ExitPolicy, parse_policy

__all__ = ["POLICY_FILE", "SavedPolicy", "policy_path", "read_policy", "write_policy"]

POLICY_FILE = "early_exit_policy.json"


@dataclass(frozen=True)
class SavedPolicy:
    """The file of ``path``: its policy (parsed) and every other field."""

    policy: ExitPolicy
    path: Path
    fields: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """``target ..., split ..., accuracy ..., layer_speedup ...`` (those present)."""
        keys = ("target", "split", "accuracy", "layer_speedup")
        return ", ".join(f"{k} {self.fields[k]}" for k in keys if k in self.fields)


def policy_path(checkpoint: str | Path) -> Path:
    """Where the policy of ``checkpoint`` (a file, or its folder) lives."""
    checkpoint = Path(checkpoint)
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    return folder / POLICY_FILE


def write_policy(checkpoint: str | Path, policy: ExitPolicy, **fields: Any) -> Path:
    """Write ``policy`` (as ``policy.spec``) and ``fields`` next to ``checkpoint``.

    Returns the path written.
    """
    path = policy_path(checkpoint)
    record = {"policy": policy.spec, **fields}
    if Path(checkpoint).is_file():
        record.setdefault("checkpoint", Path(checkpoint).name)
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_policy(checkpoint: str | Path) -> SavedPolicy | None:
    """The saved policy of ``checkpoint``, or ``None`` when there is no file.

    Raises ``ValueError`` naming the file when it is not valid JSON or its policy is bad.
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
    try:
        policy = parse_policy(record["policy"])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return SavedPolicy(policy, path, {k: v for k, v in record.items() if k != "policy"})
