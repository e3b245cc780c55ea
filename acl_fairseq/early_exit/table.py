"""The early-exit sweep's table: its columns, Markdown for the terminal, and the TSV/CSV file
(``write_table``) with its reader (``read_sweep``, also of older tables: a
``wallclock_speedup`` column, no ``dtype`` or ``agreement``)."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic_write import open_atomic

#: Columns of the written table, in order (``exit_share`` only goes to the file).
COLUMNS = (
    "dtype",
    "batch_size",
    "policy",
    "threshold",
    "examples",
    "accuracy",
    "agreement",
    "mean_exit_layer",
    "layer_speedup",
    "full_ms",
    "early_ms",
    "wall_speedup",
    "fraction_of_ideal",
    "exit_share",
)


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "exit_share":
        return ",".join(f"{layer}:{share:.3f}" for layer, share in sorted(value.items()))
    if key == "threshold":
        return value if isinstance(value, str) else f"{value:g}"
    if isinstance(value, float):
        return f"{value:.3f}" if key in ("full_ms", "early_ms") else f"{value:.2f}"
    return str(value)


MARKDOWN_HEADERS = {
    "dtype": "dtype",
    "batch_size": "batch",
    "policy": "policy",
    "threshold": "threshold",
    "accuracy": "accuracy %",
    "agreement": "agreement with full %",
    "mean_exit_layer": "mean exit layer",
    "layer_speedup": "layer-count speed-up",
    "wall_speedup": "wall-clock speed-up",
    "fraction_of_ideal": "fraction of ideal",
    "full_ms": "full ms/ex",
    "early_ms": "early-exit ms/ex",
}


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The sweep rows as a Markdown table."""
    keys = list(MARKDOWN_HEADERS)
    lines = [
        "| " + " | ".join(MARKDOWN_HEADERS[k] for k in keys) + " |",
        "|" + "---|" * len(keys),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(k, row.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def format_layer_scores(scores: dict[int, float], num_layers: int) -> str:
    """The per-exit accuracy (layer-score curve) as a one-row Markdown table."""
    layers = sorted(scores)
    head = "| exit layer | " + " | ".join(str(layer) for layer in layers) + " |"
    sep = "|---|" + "---|" * len(layers)
    acc = "| accuracy % | " + " | ".join(f"{scores[layer]:.2f}" for layer in layers) + " |"
    return f"{head}\n{sep}\n{acc}\n(layer {num_layers} is the final exit)"


def write_table(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write the rows as TSV, or CSV when ``path`` ends in ``.csv``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    delimiter = "," if path.suffix.lower() == ".csv" else "\t"
    with open_atomic(path, "w", newline="") as f:  # whole or not at all
        writer = csv.writer(f, delimiter=delimiter, lineterminator="\n")
        writer.writerow(COLUMNS)
        for row in rows:
            values = []
            for key in COLUMNS:
                value = row.get(key)
                if key in ("threshold", "exit_share") or value is None:
                    values.append("" if value is None else _fmt(key, value))
                elif isinstance(value, float):
                    values.append(f"{value:.6g}")
                else:
                    values.append(str(value))
            writer.writerow(values)


SWEEP_COLUMNS = (
    "policy",
    "threshold",
    "batch_size",
    "accuracy",
    "mean_exit_layer",
    "layer_speedup",
)
WALL_COLUMNS = ("wall_speedup", "wallclock_speedup")


def read_sweep(path: Path) -> list[dict[str, Any]]:
    """Rows of an early-exit sweep table (TSV, or CSV when the name ends in .csv)."""
    delimiter = "," if path.suffix.lower() == ".csv" else "\t"
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        columns = reader.fieldnames or []
        missing = [c for c in SWEEP_COLUMNS if c not in columns]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; it has {columns}")
        wall = next((c for c in WALL_COLUMNS if c in columns), None)
        rows = []
        for raw in reader:
            rows.append(
                {
                    "dtype": raw.get("dtype") or "fp32",
                    "policy": raw["policy"],
                    "threshold": raw["threshold"],
                    "batch_size": int(float(raw["batch_size"])),
                    "accuracy": float(raw["accuracy"]),
                    "mean_exit_layer": float(raw["mean_exit_layer"]),
                    "layer_speedup": float(raw["layer_speedup"]),
                    "agreement": float(raw["agreement"]) if raw.get("agreement") else math.nan,
                    "wall_speedup": float(raw[wall]) if wall and raw[wall] else math.nan,
                }
            )
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows
