"""Tables and figures of the converged study (``acl-fairseq-study``) for docs/study/.

Reads every finished run under ``WORK/runs`` and writes to ``--out`` (default docs/study):

  runs.csv        one row per run: study, phase, method, variant, seed, hyper-parameters,
                  updates trained and of the best checkpoint, dev and test accuracy (per exit)
  summary.csv     study,method,variant,n_train,seeds,updates_per_stage,split,metric,mean,std
                  (the main comparison per method; the grids as variants with one seed)
  paired.csv      per study and method: test accuracy minus CE's (ACL-CL minus joint CE per
                  exit), per seed, mean, std and a paired t-test over seeds
  angles.csv      the CE/contrastive gradient angle over training by thirds (early, middle,
                  late): mean, share above 60/75/90 degrees, updates ACL-Grad dropped
  agreement.csv   per exact ACL-Grad run that logged them, the cheap scopes (head, top:K)
                  against the exact decision at 60/75/90 degrees: decisions that agree,
                  Pearson r of the angles (what --acl-grad-scope would have decided)
  figures/        dev_curves, lambda, fewshot (PNG + CSV)
  runs/           each run's small files (test.json, run.json, command.txt, train.log,
                  angles.tsv), with the work folder written as <work> and the checkout the
                  run was trained from (or this one) as <repo>

Usage::

    acl-fairseq-study report --work-dir study_work --out docs/study
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import shutil
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from acl_fairseq.acl_grad import AngleRecord, read_angle_log, scope_agreement
from acl_fairseq.compare_results import METRIC_RE
from acl_fairseq.data.splits import count_examples
from acl_fairseq.fairseq_log import log_records as train_log_records
from acl_fairseq.paths import SOURCE_ROOT as REPO  # the checkout (editable install)
from acl_fairseq.recipe import flag_value as flag

SUMMARY_COLUMNS = [
    "study", "method", "variant", "n_train", "seeds", "updates_per_stage", "split", "metric",
    "mean", "std",
]  # fmt: skip
STUDY_OF = {"movie": "full", "pair": "pair", "fewshot": "fewshot"}
SMALL_FILES = ("test.json", "run.json", "command.txt", "train.log", "test.log", "angles.tsv")


def variant_of(method: str, command: Sequence[str]) -> str:
    """The hyper-parameters that tell runs of one method apart."""
    parts = [f"lr={float(flag(command, '--lr') or 0):g}"]
    if method in ("ce_scl", "acl", "acl_cl"):
        parts.append(f"lambda={flag(command, '--contrastive-lambda')}")
        parts.append(f"tau={flag(command, '--temperature')}")
    if method == "acl_cl":
        parts.append("teacher=" + ("frozen" if flag(command, "--frozen-teacher") else "live"))
        parts.append(f"weighting={flag(command, '--cross-layer-weighting') or 'exit'}")
        parts.append(f"lambda_cl={flag(command, '--cross-layer-lambda')}")
    return " ".join(parts)


def collect(work: Path) -> list[dict[str, Any]]:
    """One record per finished run, every folder that holds it (links included)."""
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
        last = (train or inner or [{}])[-1]
        updates = int(float(last.get("train_num_updates", last.get("num_updates", 0))))
        data = Path(command[1])
        record = {
            "study": STUDY_OF[task],
            "phase": "/".join(rel.parts[1:]) or "main",
            "folder": str(rel),
            "run": run_dir.name,
            "linked": run_dir.is_symlink(),
            "method": result["method"],
            "seed": result["seed"],
            "variant": variant_of(result["method"], command),
            "n_train": count_examples(data) if data.exists() else "",
            "updates": updates,
            "best_update": int(result["dev"].get("num_updates", 0)),
            "stage1": result.get("stage1"),
            "dev_accuracy": result["dev"]["accuracy"],
            "angles": run_dir / "angles.tsv",
            "run_dir": run_dir,
            "run_repo": checkout_of(command),
        }
        for key, value in result["test"].items():
            if METRIC_RE.match(key):
                record[f"test_{key}"] = value
        records.append(record)
    return records


def checkout_of(command: Sequence[str]) -> str | None:
    """The checkout a run was trained from (the study's worktree), from its fairseq-train
    path ``CHECKOUT/.venv/bin/fairseq-train``; None for another layout."""
    path = Path(command[0]) if command else None
    if path is None or path.parent.name != "bin" or path.parent.parent.name != ".venv":
        return None
    return str(path.parents[2])


def by_name(records: list[dict], folder: str) -> dict[str, dict]:
    return {r["run"]: r for r in records if r["folder"] == folder}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else math.nan


def updates_per_stage(record: dict, runs: dict[str, dict]) -> str:
    if record["stage1"] and record["stage1"] in runs:
        return f"{runs[record['stage1']]['updates']}+{record['updates']}"
    return str(record["updates"])


def summary_rows(records: list[dict]) -> list[list[Any]]:
    """The main comparisons (every seed of a method in one folder) and the single-seed grids."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:  # a few-shot size's seeds are in one folder each: fewshot/kK/sS
        if r["linked"] and r["phase"] != "main":
            continue  # a stage-1 run restored by a variant: reported in its own folder
        folder = r["folder"].rsplit("/", 1)[0] if r["study"] == "fewshot" else r["folder"]
        groups[(r["study"], folder, r["method"], r["variant"])].append(r)
    rows = []
    for (study, folder, method, variant), group in sorted(groups.items()):
        phase = group[0]["phase"]
        label = variant if phase == "main" else f"{phase}: {variant}"
        if study == "fewshot":
            label = f"k={folder.split('/')[1][1:]} per class; {variant}"
        stages = sorted({updates_per_stage(r, by_name(records, r["folder"])) for r in group})
        metrics = sorted({k for r in group for k in r if k.startswith("test_")})
        for split, keys in (("dev", ["dev_accuracy"]), ("test", metrics)):
            for key in keys:
                values = [r[key] for r in group if key in r]
                if not values:
                    continue
                mean, std = mean_std(values)
                metric = "accuracy" if key == "dev_accuracy" else key[len("test_") :]
                rows.append([
                    study, method, label, group[0]["n_train"], len(values), ";".join(stages),
                    split, metric, round(mean, 3), "" if math.isnan(std) else round(std, 3),
                ])  # fmt: skip
    return rows


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


def paired_rows(records: list[dict]) -> list[list[Any]]:
    """Test accuracy minus the baseline's, paired by seed (and by few-shot draw)."""
    from scipy import stats

    comparisons = []
    for study, folder in (("full", "movie/main"), ("pair", "pair/main")):
        runs = [r for r in records if r["folder"] == folder]
        per = defaultdict(dict)
        for r in runs:
            for key in (k for k in r if k.startswith("test_accuracy")):
                per[(r["method"], key)][r["seed"]] = r[key]
        # each method against CE; ACL against CE+SCL; both multi-exit final exits against CE
        pairs = [(m, "ce") for m in ("ce_scl", "acl", "multi_exit_joint", "acl_cl")]
        for method, base in [*pairs, ("acl", "ce_scl")]:
            ours, theirs = per[(method, "test_accuracy")], per[(base, "test_accuracy")]
            comparisons.append((study, method, base, "accuracy", ours, theirs))
        for key in sorted(k for m, k in per if m == "acl_cl"):
            ours, joint = per[("acl_cl", key)], per[("multi_exit_joint", key)]
            comparisons.append((study, "acl_cl", "multi_exit_joint", key[5:], ours, joint))
    groups = fewshot_groups(records)
    for k in sorted({k for k, _ in groups}):
        for method, base in (("ce_scl", "ce"), ("acl", "ce"), ("acl", "ce_scl")):
            ours, theirs = groups.get((k, method), {}), groups.get((k, base), {})
            comparisons.append((f"fewshot k{k}", method, base, "accuracy", ours, theirs))
    rows = []
    for study, method, base, metric, ours, theirs in comparisons:
        diffs = paired_differences(ours, theirs)
        if not diffs:
            continue
        mean, std = mean_std(diffs)
        p = math.nan  # undefined for one seed, or when every seed differs by the same amount
        if len(diffs) > 1 and std > 0:  # the paired t-test: a one-sample test of the differences
            p = stats.ttest_1samp(diffs, 0.0).pvalue
        rows.append([
            study, method, base, metric, len(diffs), " ".join(f"{d:+.2f}" for d in diffs),
            round(mean, 3), "" if math.isnan(std) else round(std, 3),
            "" if math.isnan(p) else round(float(p), 4),
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


def write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


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
                    text = text.replace(repo, "<repo>")
                (dest / name).write_text(text, encoding="utf-8")


def figures(records: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    # dev curves of the seed-1 runs of the main comparisons
    tasks = [t for t in ("movie", "pair") if any(r["folder"] == f"{t}/main" for r in records)]
    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
        rows = []
        for ax, task in zip(axes[0], tasks):
            for r in by_name(records, f"{task}/main").values():
                if r["seed"] != 1:
                    continue
                curve = [
                    (int(float(v["valid_num_updates"])), float(v["valid_accuracy"]))
                    for v in train_log_records(r["run_dir"] / "train.log", "valid")
                ]
                rows += [[task, r["method"], u, a] for u, a in curve]
                ax.plot(*zip(*curve), marker=".", label=r["method"])
            ax.set(title=f"{task}: dev accuracy during training (seed 1)", xlabel="update",
                   ylabel="dev accuracy (%)")  # fmt: skip
            ax.legend()
        fig.tight_layout()
        fig.savefig(fig_dir / "dev_curves.png", dpi=110)
        plt.close(fig)
        write_csv(fig_dir / "dev_curves.csv", ["task", "method", "update", "dev_accuracy"], rows)
    fewshot_figure(records, fig_dir, plt)


def fewshot_figure(records: list[dict], fig_dir: Path, plt: Any) -> None:
    """Test accuracy per training size (left) and each method's difference to CE, paired by
    draw (right): the paired view shows what the spread between draws hides."""
    groups = fewshot_groups(records)
    if not groups:
        return
    sizes = sorted({k for k, _ in groups})
    fig, (curve, paired) = plt.subplots(1, 2, figsize=(11, 4))
    rows = []
    # a small horizontal offset per method keeps the error bars apart on the log axis
    for method, shift in (("ce", 0.94), ("ce_scl", 1.0), ("acl", 1.06)):
        points, diffs = [], []
        for k in sizes:
            seeds = groups.get((k, method))
            if not seeds:
                continue
            mean, std = mean_std(list(seeds.values()))
            points.append((k * shift, mean, 0.0 if math.isnan(std) else std))
            rows.append([k, method, len(seeds), mean, std])
            to_ce = paired_differences(seeds, groups.get((k, "ce"), {}))
            if method != "ce" and to_ce:
                d_mean, d_std = mean_std(to_ce)
                diffs.append((k * shift, d_mean, 0.0 if math.isnan(d_std) else d_std))
        if points:
            curve.errorbar(*zip(*points), marker="o", capsize=3, label=method)
        if diffs:
            paired.errorbar(*zip(*diffs), marker="o", capsize=3, label=f"{method} − ce",
                            color=f"C{('ce', 'ce_scl', 'acl').index(method)}")  # fmt: skip
    paired.axhline(0.0, color="grey", linewidth=0.8)
    curve.set(ylabel="test accuracy (%)", title="few-shot learning curve (mean ± std over draws)")
    paired.set(ylabel="test accuracy − CE's (points)",
               title="difference to CE, paired by draw (mean ± std)")  # fmt: skip
    for ax in (curve, paired):
        ax.set(xscale="log", xlabel="training sentences per class")
        ax.set_xticks(sizes, [str(k) for k in sizes])
        ax.minorticks_off()
        ax.legend()
    fig.tight_layout()
    fig.savefig(fig_dir / "fewshot.png", dpi=110)
    plt.close(fig)
    write_csv(fig_dir / "fewshot.csv", ["per_class", "method", "n", "mean", "std"], rows)


def grid_and_exit_figures(records: list[dict], work: Path, out: Path) -> None:
    """Dev and test accuracy over the lambda/tau grid; the early-exit curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir = out / "figures"
    grid = [r for r in records if r["phase"].startswith("grid/")]
    if grid:
        tasks = sorted({r["folder"].split("/")[0] for r in grid})
        fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
        rows = []
        for ax, task in zip(axes[0], tasks):
            for method, color in (("ce_scl", "tab:orange"), ("acl", "tab:blue")):
                points = sorted(
                    (r["phase"].split("-lam")[1], r["dev_accuracy"], r["test_accuracy"])
                    for r in grid
                    if r["folder"].startswith(f"{task}/") and r["method"] == method
                )
                rows += [[task, method, *p] for p in points]
                if points:
                    labels, dev, test = zip(*points)
                    ax.plot(labels, dev, "o--", color=color, label=f"{method} dev")
                    ax.plot(labels, test, "s-", color=color, label=f"{method} test")
            ax.set(title=f"{task}: λ / τ grid (seed 1)", xlabel="λ-tau", ylabel="accuracy (%)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(fig_dir / "lambda.png", dpi=110)
        plt.close(fig)
        write_csv(fig_dir / "lambda.csv", ["task", "method", "lambda_tau", "dev", "test"], rows)
    tables = sorted((work / "runs").glob("*/earlyexit/*.tsv"))
    if tables:
        from acl_fairseq.early_exit.table import read_sweep

        fig, ax = plt.subplots(figsize=(6, 4))
        for table in tables:
            dest = out / "earlyexit" / table.parent.parent.name / table.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(table, dest)
            rows = read_sweep(table)
            # the policy's curve (and the full depth); the oracles are single reference points
            points = sorted(
                (float(r["layer_speedup"]), float(r["accuracy"]))
                for r in rows
                if not r["policy"].startswith("oracle")
            )
            label = f"{table.parent.parent.name} {table.stem}"
            (line,) = ax.plot(*zip(*points), marker="o", label=label)
            for r in rows:
                if r["policy"] == "oracle-final":  # the last exit's answer, at the first exit
                    speedup, accuracy = float(r["layer_speedup"]), float(r["accuracy"])
                    ax.plot(speedup, accuracy, marker="*", ms=12, color=line.get_color())
                    ax.annotate("oracle", (speedup, accuracy), fontsize=8)
        ax.set(xlabel="speed-up in layers run (ideal)", ylabel="test accuracy (%)",
               title="entropy early exit of the converged multi-exit models")  # fmt: skip
        ax.legend()
        fig.tight_layout()
        fig.savefig(fig_dir / "early_exit.png", dpi=110)
        plt.close(fig)


def markdown(out: Path) -> str:
    """docs/study/README.md: the CSVs as tables."""
    lines = ["# Converged study: generated tables", "",
             "Written by `acl-fairseq-study report` from the runs; see docs/results.md for the "
             "protocol and the verdicts.", ""]  # fmt: skip
    for name, title in (
        ("summary.csv", "Every comparison (mean, sample std over seeds)"),
        ("paired.csv", "Paired differences on test (per seed, and a paired t-test)"),
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="acl-fairseq-study report",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--work-dir", type=Path, default=REPO / "study_work")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "study")
    args = p.parse_args(argv)
    # importing fairseq sets the root logger to DEBUG; matplotlib would then log every font lookup
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    work = args.work_dir.resolve()
    records = collect(work)
    if not records:
        raise SystemExit(f"no finished run under {work / 'runs'}")
    out = args.out
    columns = ["study", "phase", "run", "method", "variant", "seed", "n_train", "updates",
               "best_update", "dev_accuracy"]  # fmt: skip
    metrics = sorted({k for r in records for k in r if k.startswith("test_")})
    write_csv(out / "runs.csv", columns + metrics,
              [[r.get(c, "") for c in columns + metrics] for r in records])  # fmt: skip
    write_csv(out / "summary.csv", SUMMARY_COLUMNS, summary_rows(records))
    write_csv(out / "paired.csv", ["study", "method", "baseline", "metric", "seeds",
              "per_seed_difference", "mean_difference", "std", "paired_t_p"],
              paired_rows(records))  # fmt: skip
    write_csv(out / "angles.csv", ["study", "folder", "run", "method", "variant", "part",
              "updates", "mean_angle", "pct_over_60", "pct_over_75", "pct_over_90",
              "dropped"], angle_rows(records))  # fmt: skip
    write_csv(out / "agreement.csv", ["study", "folder", "run", "method", "variant", "scope",
              "threshold", "updates", "mean_exact_angle", "mean_scope_angle", "pearson_r",
              "exact_drops", "scope_drops", "pct_agree"], agreement_rows(records))  # fmt: skip
    if (work / "runs").exists():
        for choices in sorted((work / "runs").glob("*/choices.json")):
            dest = out / "choices" / f"{choices.parent.name}.json"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(choices, dest)
    copy_small_files(records, work, out)
    figures(records, out)
    grid_and_exit_figures(records, work, out)
    (out / "README.md").write_text(markdown(out), encoding="utf-8")
    print(f"{len(records)} runs -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
