"""The figures of ``python -m studies report`` (PNG, each with its CSV): dev curves, the
few-shot curve, the lambda grid, the lambda study over seeds, the early-exit curves."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from acl_fairseq.experiment.mean_std import error_bar, summarize
from studies.paired import lambdas, runs_by_seed
from studies.records import (
    by_name,
    fewshot_groups,
    paired_differences,
    train_log_records,
    write_csv,
)
from studies.sensitivity import LAMBDA_FOLDER


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
    lambda_seeds_figure(records, fig_dir, plt)


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
            mean, std, _ = summarize(list(seeds.values()))
            points.append((k * shift, mean, error_bar(std)))
            rows.append([k, method, len(seeds), mean, std])
            to_ce = paired_differences(seeds, groups.get((k, "ce"), {}))
            if method != "ce" and to_ce:
                d_mean, d_std, _ = summarize(to_ce)
                diffs.append((k * shift, d_mean, error_bar(d_std)))
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


def lambda_seeds_figure(records: list[dict], fig_dir: Path, plt: Any) -> None:
    """The lambda study: test accuracy over λ per contrastive method (mean and sample std over
    seeds), CE's mean and std as a band (``lambda_seeds.png`` / ``.csv``)."""
    per = runs_by_seed(records, LAMBDA_FOLDER)
    suffixes = lambdas(per)
    if not suffixes:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = []
    for method, color in (("ce_scl", "tab:orange"), ("acl", "tab:blue")):
        points = []
        for suffix in suffixes:
            values = [float(r["test_accuracy"]) for r in per.get(method + suffix, {}).values()]
            if values:
                mean, std, _ = summarize(values)
                std = error_bar(std)
                points.append((float(suffix[len("-lam") :]), mean, std, len(values)))
        rows += [[method, *p] for p in points]
        if points:
            lam, mean, std, _ = zip(*points)
            ax.errorbar(lam, mean, yerr=std, marker="o", capsize=3, color=color, label=method)
    ce = [float(r["test_accuracy"]) for r in per.get("ce", {}).values()]
    if ce:
        mean, std, _ = summarize(ce)
        std = error_bar(std)
        ax.axhspan(mean - std, mean + std, color="gray", alpha=0.25, label="ce (mean ± std)")
        rows.append(["ce", "", mean, std, len(ce)])
    ax.set(xscale="log", xlabel="λ", ylabel="test accuracy (%)",
           title="movie: test accuracy over λ (mean ± std over seeds)")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(fig_dir / "lambda_seeds.png", dpi=110)
    plt.close(fig)
    write_csv(fig_dir / "lambda_seeds.csv", ["method", "lambda", "test_mean", "test_std", "seeds"],
              [[m, lam, round(a, 3), round(b, 3), n] for m, lam, a, b, n in rows])  # fmt: skip


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
