"""The runs of ``acl-fairseq-fewshot`` kept under ``docs/study/fewshot-tool/NAME/`` as rows of
``summary.csv`` and ``paired.csv``: each folder's ``fewshot.json`` is the command's own result,
its table one Holm family (``fewshot-tool/NAME``), as the command corrected it."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from acl_fairseq.experiment.mean_std import summarize
from studies.records import csv_number

FOLDER = "fewshot-tool"


def tool_results(out: Path) -> list[tuple[str, dict]]:
    """``(study, fewshot.json)`` of every folder under ``out/fewshot-tool``, by name."""
    return [
        (f"{FOLDER}/{path.parent.name}", json.loads(path.read_text(encoding="utf-8")))
        for path in sorted((out / FOLDER).glob("*/fewshot.json"))
    ]


def _command_flag(folder: Path, flag: str) -> str:
    """``flag``'s value in the first run's ``command.txt`` under ``folder`` ("" without one)."""
    command = min(folder.glob("runs/*/*/runs/*/command.txt"), default=None)
    text = command.read_text(encoding="utf-8") if command else ""
    found = re.search(rf"{re.escape(flag)} (\S+)", text)
    return found.group(1) if found else ""


def tool_summary_rows(out: Path) -> list[list[Any]]:
    """Per folder, size and method: dev and test accuracy at the learning rate chosen on dev,
    mean and sample std over draws (``summary.csv``'s columns)."""
    rows = []
    for study, result in tool_results(out):
        folder = out / study
        classes = _command_flag(folder, "--num-classes")
        updates = _command_flag(folder, "--max-update")
        groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
        for draw in result["draws"]:
            groups[(draw["per_class"], draw["method"])].append(draw)
        for (per_class, method), draws in sorted(groups.items()):
            n_train = per_class * int(classes) if classes else ""
            label = f"k={per_class} per class; lr chosen on a dev of {n_train or per_class}"
            for split in ("dev", "test"):
                mean, std, _ = summarize([d[split] for d in draws])
                rows.append([study, method, label, n_train, len(draws), updates, split,
                             "accuracy", round(mean, 3), csv_number(std)])  # fmt: skip
    return rows


def tool_paired_rows(out: Path) -> list[dict[str, Any]]:
    """The command's comparisons as ``paired.csv`` rows (a dict per row; its p-values, Holm
    values and verdicts as the command computed them)."""
    rows = []
    for study, result in tool_results(out):
        for c in result["comparisons"]:
            rows.append({
                **c, "family": study, "study": f"{study} k{c['per_class']}", "metric": "accuracy",
                "seeds": len(c["draws"]), "example_seeds": c["example_draws"],
                "per_seed_difference": " ".join(f"{d:+.2f}" for d in c["per_draw_difference"]),
                "mean_difference": round(c["mean_difference"], 3),
                "bootstrap_low": round(c["bootstrap_low"], 2),
                "bootstrap_high": round(c["bootstrap_high"], 2),
            })  # fmt: skip
    return rows
