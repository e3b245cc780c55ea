"""Flag checks of ``acl-fairseq-sweep``, run before any model or data is loaded."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

THRESHOLD_RANGES = {
    "entropy": "a number >= 0 (nats; inf always exits)",
    "maxprob": "a number in [0, 1]",
    "patience": "an integer >= 0",
}


def check_thresholds(kind: str, thresholds: Sequence[float]) -> None:
    """Raise ``ValueError`` (naming ``--thresholds``) for a threshold ``kind`` does not accept,
    the ranges of ``acl_fairseq.early_exit.policies.parse_policy``."""
    for t in thresholds:
        if kind == "entropy":
            bad = math.isnan(t) or t < 0
        elif kind == "maxprob":
            bad = not 0.0 <= t <= 1.0
        else:
            bad = math.isnan(t) or math.isinf(t) or t < 0 or t != int(t)
        if bad:
            raise ValueError(
                f"--thresholds: {t:g} is not a valid {kind} threshold: each must be "
                f"{THRESHOLD_RANGES[kind]} (--policy {kind})"
            )


def check_split(data: str | Path, split: str) -> None:
    """Raise ``ValueError`` (naming ``--split`` / ``--data``) unless ``split`` is binarized."""
    input0 = Path(data) / "input0"
    if not input0.is_dir():
        raise ValueError(f"--data {data}: no input0/ folder (a binarized sentence_prediction dir)")
    if not (input0 / f"{split}.idx").is_file():
        found = ", ".join(sorted(p.stem for p in input0.glob("*.idx"))) or "none"
        raise ValueError(
            f"--split {split}: {input0}/{split}.bin/.idx not found (splits there: {found}); "
            "pick one with --split"
        )
