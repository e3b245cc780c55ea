"""The results folder of ``acl-fairseq-compare``: one ``runs/RUN/test.json`` per run (its
method, seed, lambda, dev and test metrics, angle summary), its writer and its reader, and the
summaries that the compare report and ``acl-fairseq-plots`` both make of them."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic_write import write_json
from .mean_std import summarize
from .recipe import METHODS

__all__ = [
    "METRIC_RE",
    "RESULT_FILE",
    "SWEEP_METHODS",
    "chosen_on_dev",
    "exit_layers_of",
    "lambda_groups",
    "load_results",
    "main_results",
    "write_result",
]

RESULT_FILE = "test.json"
SWEEP_METHODS = ("ce_scl", "acl")
"""The methods of the lambda sweep (``--lambdas``)."""
# metrics of test.json's "dev" / "test" that go into results.csv (losses are left out)
METRIC_RE = re.compile(r"^accuracy(_exit\d+)?$|^(f1|mcc|acc_and_f1)$")


def write_result(run_dir: Path, result: dict[str, Any]) -> Path:
    """Writes ``run_dir/test.json``; returns its path."""
    return write_json(run_dir / RESULT_FILE, result)


def load_results(out: Path) -> list[dict]:
    """Every ``runs/*/test.json`` under ``out``, sorted by method, lambda, seed."""
    results = []
    for path in sorted((out / "runs").glob(f"*/{RESULT_FILE}")):
        result = json.loads(path.read_text(encoding="utf-8"))
        result["dir"] = str(path.parent)
        results.append(result)
    order = {m: i for i, m in enumerate(METHODS)}
    results.sort(
        key=lambda r: (order.get(r["method"], 99), r.get("lambda") or 0.0, r["seed"], r["run"])
    )
    return results


def main_results(results: Sequence[dict]) -> list[dict]:
    return [r for r in results if not r.get("sweep")]


def exit_layers_of(results: Sequence[dict], split: str = "test") -> list[int]:
    layers = set()
    for r in results:
        layers |= {
            int(k[len("accuracy_exit") :]) for k in r[split] if k.startswith("accuracy_exit")
        }
    return sorted(layers)


def lambda_groups(results: Sequence[dict], method: str) -> dict[float, list[dict]]:
    """Runs of ``method`` (main and sweep) by their contrastive lambda."""
    groups: dict[float, list[dict]] = {}
    for r in results:
        if r["method"] == method and r.get("lambda") is not None:
            groups.setdefault(float(r["lambda"]), []).append(r)
    return dict(sorted(groups.items()))


def chosen_on_dev(groups: dict[float, list[dict]]) -> float | None:
    """The lambda with the highest mean dev accuracy (the smallest among ties)."""
    best = None
    for lam, runs in groups.items():
        mean = summarize([r["dev"]["accuracy"] for r in runs])[0]
        if best is None or mean > best[1]:
            best = (lam, mean)
    return None if best is None else best[0]
