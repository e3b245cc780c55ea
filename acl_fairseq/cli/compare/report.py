"""The report of a results folder: ``results.md``, ``results.csv`` and ``summary.csv``
rebuilt from every ``runs/*/test.json``."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from acl_fairseq.acl_grad import AngleRecord
from acl_fairseq.atomic_write import open_atomic, write_text
from acl_fairseq.cli.compare.plan import format_lambda
from acl_fairseq.experiment.mean_std import fmt, fmt_mean_std, summarize
from acl_fairseq.experiment.recipe import METHODS, MULTI_EXIT_METHODS
from acl_fairseq.experiment.results import (
    METRIC_RE,
    SWEEP_METHODS,
    chosen_on_dev,
    exit_layers_of,
    lambda_groups,
    load_results,
    main_results,
)


def angle_summary(rows: Sequence[AngleRecord]) -> dict[str, float] | None:
    """Mean angle, % of updates above 90 degrees and % dropped of an angle log."""
    if not rows:
        return None
    angles = [r.angle for r in rows]
    return {
        "updates": len(rows),
        "mean_angle": statistics.fmean(angles),
        "pct_over_90": 100.0 * sum(a > 90.0 for a in angles) / len(angles),
        "pct_dropped": 100.0 * sum(not r.kept for r in rows) / len(rows),
    }


@dataclass
class Row:
    label: str  # first column(s), already formatted
    values: dict[int, float]  # seed -> value


def markdown_table(first_columns: Sequence[str], rows: Sequence[Row]) -> list[str]:
    """Mean, sample std, n and the per-seed values of each row."""
    seeds = sorted({s for row in rows for s in row.values})
    head = [*first_columns, "mean", "std", "n", *(f"seed {s}" for s in seeds)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        mean, std, n = summarize([row.values[s] for s in sorted(row.values)])
        cells = [
            row.label,
            fmt(mean),
            fmt(std),
            str(n),
            *(fmt(row.values.get(s)) for s in seeds),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _method_label(r: dict) -> str:
    lam = r.get("lambda")
    return r["method"] if lam is None else f"{r['method']} (λ {format_lambda(lam)})"


def _rows(results: Sequence[dict], split: str, metric: str, label=_method_label) -> list[Row]:
    rows: dict[str, Row] = {}
    for r in results:
        if metric in r[split]:
            row = rows.setdefault(label(r), Row(label(r), {}))
            row.values[r["seed"]] = r[split][metric]
    return list(rows.values())


def report(out: Path) -> tuple[str, list[list[Any]], list[list[Any]]]:
    """``(results.md text, results.csv rows, summary.csv rows)`` from the runs in ``out``."""
    results = load_results(out)
    main = main_results(results)
    md = [f"# Results ({out.name})", ""]
    if not results:
        md.append("No finished run yet.")
    dev_subset = results[0].get("dev_subset", "valid") if results else "valid"
    test_subset = results[0].get("test_subset", "test") if results else "test"
    summary: list[list[Any]] = [["method", "lambda", "split", "metric", "n", "mean", "std"]]

    def add_summary(method, lam, split, metric, values):
        mean, std, n = summarize(values)
        summary.append([method, format_lambda(lam), split, metric, n, mean, std])

    if main:
        md += [
            f"Checkpoints chosen on dev (`{dev_subset}`, best accuracy), reported on the "
            f"held-out `{test_subset}` split. Accuracy in %; std is the sample standard "
            "deviation over seeds (n - 1).",
            "",
        ]
        for title, split in (("Dev accuracy", "dev"), ("Test accuracy", "test")):
            md += [f"## {title}", "", *markdown_table(["method"], _rows(main, split, "accuracy"))]
            md.append("")
        multi = [r for r in main if r["method"] in MULTI_EXIT_METHODS]
        layers = exit_layers_of(multi)
        if multi and layers:
            rows = []
            for method in MULTI_EXIT_METHODS:
                runs = [r for r in multi if r["method"] == method]
                for layer in layers:
                    final = " (final)" if layer == layers[-1] else ""
                    for row in _rows(runs, "test", f"accuracy_exit{layer}"):
                        rows.append(Row(f"{row.label} | {layer}{final}", row.values))
            md += [
                "## Test accuracy per exit (multi-exit methods)",
                "",
                *markdown_table(["method", "exit layer"], rows),
                "",
                "Layer-score curve (test accuracy, mean ± std):",
                "",
                "| method | " + " | ".join(f"exit {layer}" for layer in layers) + " |",
                "|---|" + "---|" * len(layers),
            ]
            for method in MULTI_EXIT_METHODS:
                runs = [r for r in multi if r["method"] == method]
                if runs:
                    cells = []
                    for layer in layers:
                        key = f"accuracy_exit{layer}"
                        cells.append(
                            fmt_mean_std([r["test"][key] for r in runs if key in r["test"]])
                        )
                    md.append(f"| {method} | " + " | ".join(cells) + " |")
            md.append("")
        with_angles = [r for r in main if r.get("angles")]
        if with_angles:
            md += [
                "## ACL-Grad angles during training",
                "",
                "Per run: mean angle between the CE and the contrastive gradient over the "
                "updates, % of updates above 90°, % of updates whose contrastive term was "
                "dropped (ce_scl: threshold 180°, nothing dropped). Mean ± std over seeds.",
                "",
                "| method | threshold | n | mean angle (°) | > 90° (%) | dropped (%) |",
                "|---|---|---|---|---|---|",
            ]
            by_method: dict[str, list[dict]] = {}
            for r in with_angles:
                by_method.setdefault(_method_label(r), []).append(r)
            for label, runs in by_method.items():
                cells = [
                    fmt_mean_std([r["angles"][k] for r in runs], 1)
                    for k in ("mean_angle", "pct_over_90", "pct_dropped")
                ]
                thr = runs[0].get("acl_grad_threshold")
                thr_text = "-" if thr is None else f"{thr:g}°"
                md.append(f"| {label} | {thr_text} | {len(runs)} | " + " | ".join(cells) + " |")
            md.append("")
        for r_method in METHODS:
            runs = [r for r in main if r["method"] == r_method]
            if not runs:
                continue
            lam = runs[0].get("lambda")
            for split in ("dev", "test"):
                for metric in sorted({k for r in runs for k in r[split] if METRIC_RE.match(k)}):
                    values = [r[split][metric] for r in runs if metric in r[split]]
                    add_summary(r_method, lam, split, metric, values)
            if any(r.get("angles") for r in runs):
                for key in ("mean_angle", "pct_over_90", "pct_dropped"):
                    values = [r["angles"][key] for r in runs if r.get("angles")]
                    add_summary(r_method, lam, "train", f"acl_grad_{key}", values)

    sweep_methods = [m for m in SWEEP_METHODS if len(lambda_groups(results, m)) > 1]
    if sweep_methods:
        md += [
            "## Sensitivity to lambda (--contrastive-lambda)",
            "",
            "The lambda equal to the main runs' is the main run itself.",
            "",
        ]
        for title, split in (("Dev accuracy", "dev"), ("Test accuracy", "test")):
            rows = []
            for method in sweep_methods:
                for lam, runs in lambda_groups(results, method).items():
                    values = {r["seed"]: r[split]["accuracy"] for r in runs}
                    rows.append(Row(f"{method} | {format_lambda(lam)}", values))
            md += [f"### {title}", "", *markdown_table(["method", "λ"], rows), ""]
        md += [
            "### Lambda chosen on dev (highest mean dev accuracy), reported on test",
            "",
            "| method | λ | dev accuracy | test accuracy |",
            "|---|---|---|---|",
        ]
        for method in sweep_methods:
            groups = lambda_groups(results, method)
            lam = chosen_on_dev(groups)
            runs = groups[lam]
            md.append(
                f"| {method} | {format_lambda(lam)} | "
                f"{fmt_mean_std([r['dev']['accuracy'] for r in runs])} | "
                f"{fmt_mean_std([r['test']['accuracy'] for r in runs])} |"
            )
            for lam_value, group in groups.items():
                if any(r.get("sweep") for r in group):  # the main lambda is summarised above
                    for split in ("dev", "test"):
                        values = [r[split]["accuracy"] for r in group]
                        add_summary(method, lam_value, split, "accuracy", values)
        md.append("")

    per_run: list[list[Any]] = [["run", "method", "lambda", "seed", "split", "metric", "value"]]
    for r in results:
        base = [r["run"], r["method"], format_lambda(r.get("lambda")), r["seed"]]
        for split in ("dev", "test"):
            for metric in sorted(k for k in r[split] if METRIC_RE.match(k)):
                per_run.append([*base, split, metric, r[split][metric]])
        if r.get("angles"):
            for key in ("mean_angle", "pct_over_90", "pct_dropped"):
                per_run.append([*base, "train", f"acl_grad_{key}", r["angles"][key]])
    return "\n".join(md) + "\n", per_run, summary


def write_report(out: Path) -> Path:
    text, per_run, summary = report(out)
    write_text(out / "results.md", text)
    for name, rows in (("results.csv", per_run), ("summary.csv", summary)):
        with open_atomic(out / name, "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            for row in rows:
                writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])
    return out / "results.md"
