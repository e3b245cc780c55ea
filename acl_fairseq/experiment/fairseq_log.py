"""fairseq's JSON log (``--log-format json``): its records, the best dev record of a training
log and the metrics ``fairseq-validate`` printed. The one reader every tool uses."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from acl_fairseq.errors import AclValueError

__all__ = [
    "PROGRESS_KINDS",
    "best_dev",
    "json_records",
    "log_records",
    "numbers",
    "progress_kind",
    "test_metrics",
]

PROGRESS_KINDS = ("train_inner", "valid")
"""The progress lines of fairseq-train: a training interval's and a validation's record."""


def progress_kind(line: str) -> str | None:
    """``train_inner`` or ``valid`` for a progress line of fairseq-train, else None."""
    return next((kind for kind in PROGRESS_KINDS if f"| {kind} |" in line), None)


def json_records(lines: str | Iterable[str], kind: str | None = None) -> list[dict]:
    """JSON records of fairseq's json progress output (its lines, or the whole text);
    ``kind``: only ``| kind |`` lines."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    records = []
    for line in lines:
        if kind is not None and f"| {kind} |" not in line:
            continue
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def log_records(path: str | Path, kind: str | None = None) -> list[dict]:
    """``json_records`` of a log file; an absent file has none."""
    path = Path(path)
    if not path.exists():
        return []
    return json_records(path.read_text(encoding="utf-8").splitlines(), kind)


def numbers(record: dict, prefix: str) -> dict[str, float]:
    """The numeric values of ``record`` whose key starts with ``prefix``, prefix removed."""
    out = {}
    for key, value in record.items():
        if key.startswith(prefix):
            try:
                out[key[len(prefix) :]] = float(value)
            except (TypeError, ValueError):
                continue
    return out


def best_dev(log_text: str, subset: str = "valid") -> dict[str, float]:
    """Metrics of the validation record the best checkpoint was saved at: the highest
    accuracy, the last one among ties (fairseq's ``>=``)."""
    prefix = f"{subset}_"
    records = [
        numbers(r, prefix)
        for r in json_records(log_text.splitlines(), "valid")
        if f"{prefix}accuracy" in r
    ]
    if not records:
        raise AclValueError(
            "no validation record with an accuracy in the training log: did the run validate "
            "(--validate-interval, --disable-validation)?"
        )
    best = records[0]
    for record in records[1:]:
        if record["accuracy"] >= best["accuracy"]:
            best = record
    return best


def test_metrics(output: str, subset: str = "test") -> dict[str, float]:
    """The metrics of the last ``{subset}_accuracy`` record ``fairseq-validate`` printed."""
    records = [r for r in json_records(output.splitlines()) if f"{subset}_accuracy" in r]
    if not records:
        raise ValueError(f"fairseq-validate printed no {subset}_accuracy")
    return numbers(records[-1], f"{subset}_")
