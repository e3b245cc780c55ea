"""Tables and figures of the converged study (``python -m studies``) for docs/study/.

Reads every finished run under ``WORK/runs`` and writes to ``--out`` (default docs/study):

  runs.csv        one row per run: study, phase, method, variant, seed, hyper-parameters,
                  updates trained and of the best checkpoint, updates ACL-Grad dropped, dev
                  and test accuracy (per exit)
  summary.csv     study,method,variant,n_train,seeds,updates_per_stage,split,metric,mean,std
                  (the main comparison per method; the grids as variants with one seed;
                  the runs of acl-fairseq-fewshot kept in OUT/fewshot-tool/, per draw)
  paired.csv      per study and method: test accuracy minus CE's (ACL-CL minus joint CE per
                  exit), per seed, mean, std and a paired t-test over seeds (and the
                  comparisons of each OUT/fewshot-tool/NAME/fewshot.json)
  angles.csv      the CE/contrastive gradient angle over training by thirds (early, middle,
                  late): mean, share above 60/75/90 degrees, updates ACL-Grad dropped
  lambda_sensitivity.csv
                  the lambda study: per contrastive method, test accuracy per λ, its range
                  over λ (of the means and per seed), the λ picked on dev; ACL's per-seed
                  range against CE+SCL's (paired t-test)
  dev_test_gap.csv
                  the lambda study: dev minus test accuracy per configuration and seed, the
                  dev inflation of choosing the checkpoint on dev, the gap against CE's
  agreement.csv   per exact ACL-Grad run that logged them, the cheap scopes (head, top:K)
                  against the exact decision at 60/75/90 degrees: decisions that agree,
                  Pearson r of the angles (what --acl-grad-scope would have decided)
  figures/        dev_curves, lambda, lambda_seeds, fewshot (PNG + CSV)
  runs/           each run's small files (test.json, run.json, command.txt, train.log,
                  angles.tsv), with the work folder written as <work> and the checkout the
                  run was trained from (or this one) as <repo>

Usage::

    python -m studies report --work-dir study_work --out docs/study
"""

from __future__ import annotations

import argparse
import csv
import logging
import shutil
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from acl_fairseq.acl_grad import AngleRecord, read_angle_log, scope_agreement
from acl_fairseq.experiment.mean_std import summarize
from acl_fairseq.experiment.predictions import PREDICTIONS_FILE
from studies.data import REPO
from studies.fewshot_tool import tool_paired_rows, tool_summary_rows
from studies.figures import figures, grid_and_exit_figures
from studies.paired import PAIRED_COLUMNS, fewshot_draws, paired_rows
from studies.records import (
    STUDY_OF,
    by_name,
    collect,
    csv_number,
    updates_per_stage,
    write_csv,
)
from studies.runs import LINKS_FILE, write_links
from studies.sensitivity import (
    GAP_COLUMNS,
    SENSITIVITY_COLUMNS,
    dev_test_gap_rows,
    lambda_sensitivity_rows,
)

SUMMARY_COLUMNS = [
    "study", "method", "variant", "n_train", "seeds", "updates_per_stage", "split", "metric",
    "mean", "std",
]  # fmt: skip
RUNS_COLUMNS = ["study", "folder", "phase", "run", "method", "variant", "seed", "n_train",
                "updates", "best_update", "updates_dropped", "dev_accuracy"]  # fmt: skip
SMALL_FILES = (
    "test.json", "run.json", "command.txt", "train.log", "test.log", "angles.tsv",
    PREDICTIONS_FILE,
)  # fmt: skip
TASK_OF = {study: task for task, study in STUDY_OF.items()}  # full -> movie


def summary_rows(records: list[dict]) -> list[list[Any]]:
    """The main comparisons (every seed of a method in one folder) and the single-seed grids."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    chosen = {id(r) for group in fewshot_draws(records, "fewshot-dev").values()
              for r in group.values()}  # fmt: skip
    for r in records:  # a few-shot size's seeds are in one folder each: fewshot/kK/sS
        task = r["folder"].split("/")[0]
        if r["linked"] and (r["phase"] != "main" or r["link_target"].split("/")[0] != task):
            continue  # a stage-1 run restored by a variant or a study: in its own folder
        variant = r["variant"]
        folder = r["folder"].rsplit("/", 1)[0] if r["study"] == "fewshot" else r["folder"]
        if r["study"] == "fewshot-dev":  # the learning rate chosen per draw on its small dev
            if id(r) not in chosen:
                continue
            folder = "/".join(r["folder"].split("/")[:2])
            variant = " ".join(p for p in variant.split() if not p.startswith("lr="))
            variant = f"lr chosen on a dev of {r['n_train']}; {variant}".rstrip("; ")
        groups[(r["study"], folder, r["method"], variant)].append(r)
    rows = []
    for (study, folder, method, variant), group in sorted(groups.items()):
        phase = group[0]["phase"]
        label = variant if phase == "main" else f"{phase}: {variant}"
        if study in ("fewshot", "fewshot-dev"):
            label = f"k={folder.split('/')[1][1:]} per class; {variant}"
        stages = sorted({updates_per_stage(r, by_name(records, r["folder"])) for r in group})
        metrics = sorted({k for r in group for k in r if k.startswith("test_")})
        for split, keys in (("dev", ["dev_accuracy"]), ("test", metrics)):
            for key in keys:
                values = [r[key] for r in group if key in r]
                if not values:
                    continue
                mean, std, _ = summarize(values)
                metric = "accuracy" if key == "dev_accuracy" else key[len("test_") :]
                rows.append([
                    study, method, label, group[0]["n_train"], len(values), ";".join(stages),
                    split, metric, round(mean, 3), csv_number(std),
                ])  # fmt: skip
    return rows


def angle_logs(records: list[dict]) -> Iterator[tuple[dict, list[AngleRecord]]]:
    """Each run with a non-empty angle log, once per log (a linked run shares its log)."""
    seen = set()
    for r in records:
        path = r["angles"]
        if not path.exists() or path.resolve() in seen:
            continue
        seen.add(path.resolve())
        angles = read_angle_log(path)
        if angles:
            yield r, angles


def angle_rows(records: list[dict]) -> list[list[Any]]:
    rows = []
    for r, angles in angle_logs(records):
        n = len(angles)
        thirds = {"early": angles[: n // 3], "middle": angles[n // 3 : 2 * n // 3]}
        thirds.update({"late": angles[2 * n // 3 :], "all": angles})
        for part, rows_ in thirds.items():
            values = [a.angle for a in rows_]
            if not values:
                continue
            share = {
                t: round(100.0 * sum(a > t for a in values) / len(values), 1) for t in (60, 75, 90)
            }
            rows.append([
                r["study"], r["folder"], r["run"], r["method"], r["variant"], part, len(values),
                round(statistics.fmean(values), 2), share[60], share[75], share[90],
                sum(not a.kept for a in rows_),
            ])  # fmt: skip
    return rows


def agreement_rows(records: list[dict]) -> list[list[Any]]:
    rows = []
    for r, angles in angle_logs(records):
        for a in scope_agreement(angles):
            rows.append([
                r["study"], r["folder"], r["run"], r["method"], r["variant"], a.scope,
                f"{a.threshold:g}", a.updates, round(a.mean_exact, 2), round(a.mean_scope, 2),
                round(a.pearson_r, 3), a.exact_drops, a.scope_drops, round(100.0 * a.agree, 1),
            ])  # fmt: skip
    return rows


def copy_small_files(records: list[dict], work: Path, out: Path) -> None:
    """Each run's small files (never checkpoints), machine paths written as <work>/<repo>."""
    for r in records:
        if r["linked"]:
            continue
        dest = out / "runs" / r["folder"] / r["run"]
        dest.mkdir(parents=True, exist_ok=True)
        for name in SMALL_FILES:
            src = r["run_dir"] / name
            if src.exists():
                text = src.read_text(encoding="utf-8", errors="replace")
                text = text.replace(str(work), "<work>")
                for repo in filter(None, (r["run_repo"], str(REPO))):
                    text = text.replace(f"{repo}/", "<repo>/")
                (dest / name).write_text(text, encoding="utf-8")


def markdown(out: Path) -> str:
    """docs/study/README.md: the CSVs as tables."""
    lines = ["# Converged study: generated tables", "",
             "Written by `python -m studies report` from the runs; see docs/results.md for the "
             "protocol and the verdicts.", ""]  # fmt: skip
    for name, title in (
        ("summary.csv", "Every comparison (mean, sample std over seeds)"),
        (
            "paired.csv",
            "Paired differences on test: over seeds (t-test) and examples (McNemar, "
            "bootstrap), Holm-corrected per family",
        ),  # fmt: skip
        ("lambda_sensitivity.csv", "Sensitivity to λ (lambda study, test accuracy)"),
        (
            "dev_test_gap.csv",
            "Dev minus test accuracy (lambda study): per seed, the dev inflation of choosing "
            "the checkpoint on dev (best dev record minus the mean of the last three), and "
            "against CE's gap (paired t-test)",
        ),
        ("times.csv", "Minutes per run (training and evaluation, one thread)"),
        ("angles.csv", "CE / contrastive gradient angles by thirds of training"),
        ("agreement.csv", "Cheap ACL-Grad scopes against the exact decision"),
    ):
        path = out / name
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as f:
            rows = list(csv.reader(f))
        if len(rows) < 2:
            continue
        lines += [f"## {title}", "", "| " + " | ".join(rows[0]) + " |"]
        lines.append("|" + "---|" * len(rows[0]))
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
        lines.append("")
    return "\n".join(lines)


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def committed_n_train(out: Path) -> dict[tuple[str, str], str]:
    """Training-set sizes of the committed ``runs.csv`` by ``(folder, run)``."""
    known = {}
    for row in read_csv(out / "runs.csv"):
        folder = row.get("folder") or f"{TASK_OF.get(row['study'], row['study'])}/{row['phase']}"
        known[(folder, row["run"])] = row["n_train"]
    return known


def fewer_seeds(old: list[dict[str, str]], new: list[list[Any]]) -> list[str]:
    """Rows of the committed ``summary.csv`` that ``new`` would replace by fewer seeds (or
    drop): what a study resumed without every run would quietly lose."""
    key = ("study", "method", "variant", "split", "metric")
    seeds = {tuple(str(v) for v in row[:3] + row[6:8]): int(row[4]) for row in new}
    lost = []
    for row in old:
        have = seeds.get(tuple(row[k] for k in key), 0)
        if have < int(row["seeds"]):
            lost.append(f"{' / '.join(row[k] for k in key)}: {row['seeds']} -> {have} seeds")
    return lost


def time_rows(records: list[dict]) -> list[list[Any]]:
    """Minutes per run (training and evaluation, wall clock) by study, folder and method."""
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in records:
        if not r["linked"] and r["seconds"] is not None:
            folder = r["folder"].rsplit("/", 1)[0] if r["folder"].count("/") > 1 else r["folder"]
            groups[(r["study"], folder, r["method"])].append(float(r["seconds"]) / 60.0)
    return [
        [study, folder, method, len(minutes), round(min(minutes), 1),
         round(statistics.median(minutes), 1), round(max(minutes), 1), round(sum(minutes), 1)]
        for (study, folder, method), minutes in sorted(groups.items())
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies report",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--work-dir", type=Path, default=REPO / "study_work")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "study")
    p.add_argument(
        "--allow-fewer",
        action="store_true",
        help="write even when a committed row would get fewer seeds or draws (or disappear)",
    )
    args = p.parse_args(argv)
    # importing fairseq sets the root logger to DEBUG; matplotlib would then log every font lookup
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    work = args.work_dir.resolve()
    out = args.out
    records = collect(work, committed_n_train(out))
    if not records:
        raise SystemExit(f"no finished run under {work / 'runs'}")
    summary = summary_rows(records) + tool_summary_rows(out)
    lost = fewer_seeds(read_csv(out / "summary.csv"), summary)
    if lost and not args.allow_fewer:
        raise SystemExit(
            f"{out / 'summary.csv'}: {len(lost)} committed row(s) would get fewer seeds:\n  "
            + "\n  ".join(lost)
            + "\nrestore the missing runs (python -m studies restore) or pass --allow-fewer"
        )
    metrics = sorted({k for r in records for k in r if k.startswith("test_")})
    columns = RUNS_COLUMNS + metrics
    write_csv(out / "runs.csv", columns, [[r.get(c, "") for c in columns] for r in records])
    write_csv(out / "summary.csv", SUMMARY_COLUMNS, summary)
    write_csv(out / "paired.csv", PAIRED_COLUMNS, paired_rows(records, tool_paired_rows(out)))
    sensitivity = lambda_sensitivity_rows(records)
    if sensitivity:
        write_csv(out / "lambda_sensitivity.csv", SENSITIVITY_COLUMNS, sensitivity)
        write_csv(out / "dev_test_gap.csv", GAP_COLUMNS, dev_test_gap_rows(records))
    write_csv(out / "angles.csv", ["study", "folder", "run", "method", "variant", "part",
              "updates", "mean_angle", "pct_over_60", "pct_over_75", "pct_over_90",
              "dropped"], angle_rows(records))  # fmt: skip
    write_csv(out / "agreement.csv", ["study", "folder", "run", "method", "variant", "scope",
              "threshold", "updates", "mean_exact_angle", "mean_scope_angle", "pearson_r",
              "exact_drops", "scope_drops", "pct_agree"], agreement_rows(records))  # fmt: skip
    write_csv(out / "times.csv", ["study", "folder", "method", "runs", "min_minutes",
              "median_minutes", "max_minutes", "total_minutes"], time_rows(records))  # fmt: skip
    write_links(work, out / LINKS_FILE)
    for choices in sorted((work / "runs").glob("*/choices.json")):
        dest = out / "choices" / f"{choices.parent.name}.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(choices, dest)
    copy_small_files(records, work, out)
    figures(records, out)
    grid_and_exit_figures(records, work, out)
    (out / "README.md").write_text(markdown(out), encoding="utf-8")
    links = sum(r["linked"] for r in records)
    print(f"{len(records) - links} trained runs and {links} links -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
