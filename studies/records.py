"""The study's finished runs as records (one per run folder, links included), the shared
reading of every table and figure of ``python -m studies report``."""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from acl_fairseq.acl_grad import read_angle_log
from acl_fairseq.data.splits import count_examples
from acl_fairseq.experiment.fairseq_log import log_records
from acl_fairseq.experiment.predictions import PREDICTIONS_FILE, SplitPredictions, read_predictions
from acl_fairseq.experiment.recipe import flag_value
from acl_fairseq.experiment.results import METRIC_RE

# study name of each task folder under WORK/runs (the others are named by their folder:
# pair-converged, lambda, fewshot-dev, acl-cl-same-start)
STUDY_OF = {"movie": "full", "pair": "pair", "fewshot": "fewshot"}
# methods with a contrastive term (their variant names lambda and tau)
CONTRASTIVE = ("ce_scl", "ce_scl_grad", "acl", "acl_embed", "acl_cl")


def flag(command: Sequence[str], name: str) -> str | None:
    return flag_value(command, name)


def train_log_records(path: Path, kind: str) -> list[dict]:
    return log_records(path, kind)


def variant_of(method: str, command: Sequence[str]) -> str:
    """The hyper-parameters that tell runs of one method apart."""
    parts = [f"lr={float(flag(command, '--lr') or 0):g}"]
    if method in CONTRASTIVE:
        parts.append(f"lambda={flag(command, '--contrastive-lambda')}")
        parts.append(f"tau={flag(command, '--temperature')}")
    if method == "acl_cl":
        parts.append("teacher=" + ("frozen" if flag(command, "--frozen-teacher") else "live"))
        parts.append(f"weighting={flag(command, '--cross-layer-weighting') or 'exit'}")
        parts.append(f"lambda_cl={flag(command, '--cross-layer-lambda')}")
    autocast = flag(command, "--autocast")
    if autocast not in (None, "none"):
        parts.append(f"autocast={autocast}")
    return " ".join(parts)


def run_seconds(seconds: float | None, train: list[dict], inner: list[dict]) -> float | None:
    """A run's wall clock, training and evaluation. ``seconds`` is what compare recorded: the
    time of the invocation that evaluated the run, which is the evaluation alone when an
    earlier invocation trained it (interrupted before the test, or stopped between phases);
    then the training's own clock (fairseq's last ``wall`` in train.log) is added."""
    if seconds is None:
        return None
    last = train[-1].get("train_wall") if train else inner[-1].get("wall") if inner else None
    trained = float(last) if last is not None else 0.0
    return seconds + trained if trained > seconds else seconds


def collect(work: Path, known_n_train: dict[tuple[str, str], str] | None = None) -> list[dict]:
    """One record per finished run, every folder that holds it (links included).

    ``known_n_train``: training-set sizes by ``(folder, run)`` for runs whose data folder is
    not on this machine (restored from docs/study: the committed ``runs.csv``).
    """
    records = []
    for test_json in sorted((work / "runs").glob("**/runs/*/test.json")):
        run_dir = test_json.parent
        out = run_dir.parent.parent
        rel = out.relative_to(work / "runs")
        task = rel.parts[0]
        result = json.loads(test_json.read_text(encoding="utf-8"))
        meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
        command = meta["train_command"]
        train = train_log_records(run_dir / "train.log", "train")
        inner = train_log_records(run_dir / "train.log", "train_inner")
        valid = train_log_records(run_dir / "train.log", "valid")
        last = (train or inner or [{}])[-1]
        updates = int(float(last.get("train_num_updates", last.get("num_updates", 0))))
        data = Path(command[1])
        angles = read_angle_log(run_dir / "angles.tsv")
        record = {
            "study": STUDY_OF.get(task, task),
            "phase": "/".join(rel.parts[1:]) or "main",
            "folder": str(rel),
            "run": run_dir.name,
            "linked": run_dir.is_symlink(),
            # a linked run: the folder it lives in (relative to WORK/runs)
            "link_target": str(run_dir.resolve().parent.parent.relative_to(work.resolve() / "runs"))
            if run_dir.is_symlink()
            else None,
            "lambda": result.get("lambda"),
            "method": result["method"],
            "seed": result["seed"],
            "variant": variant_of(result["method"], command),
            "n_train": count_examples(data)
            if data.exists()
            else (known_n_train or {}).get((str(rel), run_dir.name), ""),
            "updates": updates,
            "best_update": int(result["dev"].get("num_updates", 0)),
            # updates whose contrastive term ACL-Grad dropped ("" for a run without angles)
            "updates_dropped": sum(not a.kept for a in angles) if angles else "",
            "stage1": result.get("stage1"),
            "dev_accuracy": result["dev"]["accuracy"],
            # dev accuracy at every validation of the run's training, in order
            "valid_curve": [float(v["valid_accuracy"]) for v in valid if "valid_accuracy" in v],
            "angles": run_dir / "angles.tsv",
            "run_dir": run_dir,
            "run_repo": checkout_of(command),
            "seconds": run_seconds(result.get("seconds"), train, inner),
            "predictions": run_dir / PREDICTIONS_FILE,
        }
        for key, value in result["test"].items():
            if METRIC_RE.match(key):
                record[f"test_{key}"] = value
        records.append(record)
    return records


def checkout_of(command: Sequence[str]) -> str | None:
    """The checkout a run was trained from (the study's worktree): the folder that holds its
    ``--user-dir CHECKOUT/acl_fairseq``, else its fairseq-train path's
    ``CHECKOUT/.venv/bin/fairseq-train``; None for another layout."""
    args = list(command)
    if "--user-dir" in args[:-1]:
        plugin = Path(args[args.index("--user-dir") + 1])
        if plugin.name == "acl_fairseq":
            return str(plugin.parent)
    path = Path(command[0]) if command else None
    if path is None or path.parent.name != "bin" or path.parent.parent.name != ".venv":
        return None
    return str(path.parents[2])


def by_name(records: list[dict], folder: str) -> dict[str, dict]:
    return {r["run"]: r for r in records if r["folder"] == folder}


def csv_number(value: float) -> Any:
    """A mean or std for a CSV cell: rounded to 3 decimals, empty where it is nan."""
    return "" if math.isnan(value) else round(value, 3)


def updates_per_stage(record: dict, runs: dict[str, dict]) -> str:
    if record["stage1"] and record["stage1"] in runs:
        return f"{runs[record['stage1']]['updates']}+{record['updates']}"
    return str(record["updates"])


def fewshot_groups(records: list[dict]) -> dict[tuple[int, str], dict[int, float]]:
    """(sentences per class, method) -> {seed: test accuracy}; folders are fewshot/kK/sS."""
    out: dict[tuple[int, str], dict[int, float]] = defaultdict(dict)
    for r in records:
        if r["study"] == "fewshot":
            k = int(r["folder"].split("/")[1][1:])
            out[(k, r["method"])][r["seed"]] = r["test_accuracy"]
    return out


def paired_differences(ours: dict[int, float], theirs: dict[int, float]) -> list[float]:
    """ours - theirs for every seed both have, in seed order."""
    return [ours[s] - theirs[s] for s in sorted(set(ours) & set(theirs))]


def write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def predictions_of(record: dict, split: str = "test") -> SplitPredictions | None:
    """The run's per-example predictions on ``split`` (None for a run without them: the runs
    before predictions were kept)."""
    path = record["predictions"]
    if not path.exists():
        return None
    return read_predictions(path).get(split)
