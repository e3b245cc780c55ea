"""Pictures of a ``acl-fairseq-compare`` results folder (a PNG and the CSV behind each).

  (a) angles.png       histogram of the per-update ACL-Grad angle (CE gradient vs contrastive
                       gradient) over training, ce_scl (threshold 180: measured, never dropped)
                       vs acl (its real threshold), all seeds pooled; the legend gives the
                       fraction of updates above 90 degrees. From runs/<method>-seed*/angles.tsv.
  (b) layer_scores.png test accuracy of every exit, multi_exit_joint vs acl_cl, mean +- std over
                       seeds (ce / acl final-exit accuracy as reference points when present).
  (c) early_exit.png   speed/accuracy of early exit: accuracy vs layer-count speed-up (ideal)
                       and vs measured wall-clock speed-up per batch size, from the tables of
                       acl-fairseq-sweep (--sweep-tsv [LABEL=]FILE, repeatable; also
                       every RESULTS/early_exit/*.tsv|csv). Columns read: policy, threshold,
                       batch_size, accuracy, mean_exit_layer, layer_speedup and wall_speedup
                       (or wallclock_speedup); TSV, or CSV when the name ends in .csv.
  (d) tsne.png         t-SNE of the pooled features (the input of the classification head's
                       out_proj) of the test split with the label embeddings (out_proj rows),
                       both L2-normalised and embedded together, CE vs ACL (runs ce-seed<k>
                       and acl-seed<k>; needs --data and their checkpoint_best.pt).
  (e) lambda.png       test accuracy vs --contrastive-lambda for ce_scl and acl, mean +- std
                       over seeds, the lambda chosen on dev circled, CE as a reference band.

Usage::

    acl-fairseq-plots RESULTS --data DATA [--sweep-tsv joint=sweep_joint.tsv
        --sweep-tsv acl_cl=sweep_acl_cl.tsv] [--out RESULTS/plots] [--only a,b,d]

Every plot is drawn when its inputs exist and skipped (with the reason) otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from acl_fairseq.acl_grad import read_angle_log
from acl_fairseq.cli import HelpFormatter
from acl_fairseq.cli.plots.figures import COLORS, Skipped, main_runs, plt, save_plot, write_csv
from acl_fairseq.cli.plots.tsne import plot_tsne
from acl_fairseq.early_exit.table import read_sweep
from acl_fairseq.errors import AclFairseqError, AclFileNotFoundError, AclValueError, run_tool
from acl_fairseq.experiment.mean_std import error_bar, summarize
from acl_fairseq.experiment.recipe import MULTI_EXIT_METHODS
from acl_fairseq.experiment.results import (
    SWEEP_METHODS,
    chosen_on_dev,
    exit_layers_of,
    lambda_groups,
    load_results,
    main_results,
)

EARLY_EXIT_CSV = (  # the CSV behind early_exit.png
    "label",
    "batch_size",
    "policy",
    "threshold",
    "accuracy",
    "mean_exit_layer",
    "layer_speedup",
    "wall_speedup",
)
ANGLE_METHODS = ("ce_scl", "acl")
PROG = "acl-fairseq-plots"


def _threshold(run_dir: Path) -> float | None:
    import json

    for name in ("test.json", "run.json"):
        path = run_dir / name
        if path.exists():
            return json.loads(path.read_text(encoding="utf-8")).get("acl_grad_threshold")
    return None


# ----------------------------------------------------------------------------- (a)


def plot_angles(results_dir: Path, out_dir: Path, methods: Sequence[str] = ANGLE_METHODS):
    """(a) Histogram of the per-update gradient angles of ``methods``, all seeds pooled."""
    series = {}
    for method in methods:
        rows, threshold, runs = [], None, []
        for run_dir in main_runs(results_dir, method):
            angles = read_angle_log(run_dir / "angles.tsv")
            if angles:
                rows += angles
                runs.append(run_dir.name)
                threshold = _threshold(run_dir)
        if rows:
            series[method] = (np.array([r.angle for r in rows]), rows, threshold, runs)
    if not series:
        raise Skipped(
            f"no angles.tsv in runs/{{{','.join(methods)}}}-seed* (ce_scl needs "
            "acl-fairseq-compare without --ce-scl-plain)"
        )
    bins = np.linspace(0.0, 180.0, 37)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    table_rows = [[lo, hi] for lo, hi in zip(bins[:-1], bins[1:])]
    header = ["bin_start_deg", "bin_end_deg"]
    summary = []
    for method, (angles, rows, threshold, runs) in series.items():
        over = float(np.mean(angles > 90.0))
        dropped = float(np.mean([not r.kept for r in rows]))
        thr = "?" if threshold is None else f"{threshold:g}°"
        note = (
            "nothing dropped"
            if threshold is not None and threshold >= 180
            else (f"{dropped:.0%} dropped")
        )
        label = f"{method} (threshold {thr}, {note}): {over:.0%} of {len(angles)} updates > 90°"
        weights = np.full(len(angles), 1.0 / len(angles))
        counts, _ = np.histogram(angles, bins=bins)
        ax.hist(
            angles,
            bins=bins,
            weights=weights,
            alpha=0.45,
            color=COLORS.get(method),
            edgecolor=COLORS.get(method),
            label=label,
        )
        header += [f"{method}_count", f"{method}_fraction"]
        for row, c in zip(table_rows, counts):
            row += [int(c), float(c) / len(angles)]
        summary.append(
            [method, threshold, len(runs), len(angles), float(angles.mean()), over, dropped]
        )
    ax.axvline(90.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlim(0, 180)
    ax.set_xticks(range(0, 181, 30))
    ax.set_xlabel("angle between CE and contrastive gradient (degrees)")
    ax.set_ylabel("fraction of updates")
    ax.set_title("ACL-Grad angle per update during training (all seeds)")
    ax.legend(fontsize=8, loc="upper left")
    written = save_plot(fig, out_dir, "angles", header, table_rows)
    write_csv(
        out_dir / "angles_summary.csv",
        ["method", "threshold", "runs", "updates", "mean_angle", "frac_over_90", "frac_dropped"],
        summary,
    )
    return [*written, out_dir / "angles_summary.csv"]


# ----------------------------------------------------------------------------- (b)


def plot_layer_scores(results_dir: Path, out_dir: Path):
    """(b) Test accuracy per exit, multi_exit_joint vs acl_cl, mean +- std over seeds."""
    results = main_results(load_results(results_dir))
    multi = [r for r in results if r["method"] in MULTI_EXIT_METHODS]
    layers = exit_layers_of(multi)
    if not layers:
        raise Skipped("no finished multi_exit_joint / acl_cl run (test.json with accuracy_exit*)")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    rows = []
    for method in MULTI_EXIT_METHODS:
        runs = [r for r in multi if r["method"] == method]
        if not runs:
            continue
        xs, means, stds = [], [], []
        for layer in layers:
            key = f"accuracy_exit{layer}"
            values = [r["test"][key] for r in runs if key in r["test"]]
            if not values:
                continue
            mean, std, n = summarize(values)
            xs.append(layer)
            means.append(mean)
            stds.append(error_bar(std))
            rows.append([method, layer, n, mean, std])
        means_a, stds_a = np.array(means), np.array(stds)
        color = COLORS.get(method)
        ax.plot(xs, means_a, marker="o", color=color, label=f"{method} (n={len(runs)} seeds)")
        ax.fill_between(xs, means_a - stds_a, means_a + stds_a, color=color, alpha=0.2)
    for offset, method in ((-0.08, "ce"), (0.08, "acl")):
        runs = [r for r in results if r["method"] == method]
        if runs:
            mean, std, n = summarize([r["test"]["accuracy"] for r in runs])
            ax.errorbar(
                [layers[-1] + offset],
                [mean],
                yerr=[error_bar(std)],
                fmt="s",
                color=COLORS.get(method) if method == "ce" else "tab:cyan",
                capsize=3,
                label=f"{method}, single exit (stage 1)",
            )
            rows.append([f"{method} (single exit)", layers[-1], n, mean, std])
    ax.set_xticks(layers)
    ax.set_xlabel("exit layer")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Layer-score curve (test, mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_plot(fig, out_dir, "layer_scores", ["method", "layer", "n", "mean", "std"], rows)


def sweep_files(results_dir: Path, specs: Sequence[str] | None) -> list[tuple[str, Path]]:
    """``(label, path)`` of ``--sweep-tsv [LABEL=]FILE`` and of RESULTS/early_exit/*."""
    files = []
    for spec in specs or ():
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = Path(spec).stem, spec
        files.append((label, Path(path)))
    auto = results_dir / "early_exit"
    if auto.is_dir():
        for path in sorted(auto.iterdir()):
            if path.suffix.lower() in (".tsv", ".csv") and path not in [p for _, p in files]:
                files.append((path.stem, path))
    return files


def plot_early_exit(results_dir: Path, out_dir: Path, specs: Sequence[str] | None = None):
    """(c) Accuracy vs ideal and measured speed-up of early exit."""
    files = sweep_files(results_dir, specs)
    if not files:
        raise Skipped(
            "no early-exit table: pass --sweep-tsv [LABEL=]FILE (acl-fairseq-sweep "
            f"--out FILE) or put them in {results_dir / 'early_exit'}/"
        )
    missing = [str(p) for _, p in files if not p.exists()]
    if missing:
        raise Skipped(f"not found: {', '.join(missing)}")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    csv_rows = []
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "os^Dv<>p"
    series = []  # (label, rows): one per table and precision (acl-fairseq-sweep --dtypes)
    for label, path in files:
        rows = read_sweep(path)
        dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
        for dtype in dtypes:
            name = label if len(dtypes) == 1 else f"{label} {dtype}"
            series.append((name, [r for r in rows if r["dtype"] == dtype]))
    for i, (label, rows) in enumerate(series):
        oracles = [r for r in rows if r["policy"].startswith("oracle")]
        rows = [r for r in rows if r not in oracles]
        color = cycle[i % len(cycle)]
        sizes = sorted({r["batch_size"] for r in rows})
        # points in the table's order: the full model, then the thresholds as swept. Accuracy
        # and exit layers do not depend on the batch size: one ideal curve per table.
        first = [r for r in rows if r["batch_size"] == sizes[0]]
        left.plot(
            [r["layer_speedup"] for r in first],
            [r["accuracy"] for r in first],
            marker="o",
            color=color,
            label=label,
        )
        for j, size in enumerate(sizes):
            part = [
                r for r in rows if r["batch_size"] == size and not math.isnan(r["wall_speedup"])
            ]
            if part:
                right.plot(
                    [r["wall_speedup"] for r in part],
                    [r["accuracy"] for r in part],
                    marker=markers[j % len(markers)],
                    color=color,
                    linestyle="-" if j == 0 else "--",
                    label=f"{label}, batch {size}",
                )
        for r, marker in zip(oracles, "*P"):  # best any policy could do (layer count only)
            left.plot(r["layer_speedup"], r["accuracy"], marker=marker, markersize=11,
                      color=color, linestyle="none", label=f"{label}, {r['policy']}")  # fmt: skip
        for r in rows + oracles:
            csv_rows.append([label, *(r[k] for k in EARLY_EXIT_CSV[1:])])
    for ax, title in (
        (left, "layer-count speed-up (ideal: layers / mean exit layer)"),
        (right, "measured wall-clock speed-up"),
    ):
        ax.set_xlabel(title)
        ax.set_ylabel("accuracy (%)")
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Early exit: speed vs accuracy over the policy threshold")
    return save_plot(fig, out_dir, "early_exit", EARLY_EXIT_CSV, csv_rows)


# ----------------------------------------------------------------------------- (d)


# ----------------------------------------------------------------------------- (e)


def plot_lambda(results_dir: Path, out_dir: Path):
    """(e) Test accuracy vs lambda for ce_scl and acl (mean +- std over seeds)."""
    results = load_results(results_dir)
    groups = {m: lambda_groups(results, m) for m in SWEEP_METHODS}
    groups = {m: g for m, g in groups.items() if len(g) > 1}
    if not groups:
        raise Skipped("no lambda sweep (acl-fairseq-compare --lambdas ...) with two or more values")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    rows = []
    all_lams = sorted({lam for g in groups.values() for lam in g})
    for method, by_lambda in groups.items():
        chosen = chosen_on_dev(by_lambda)
        xs, means, stds = [], [], []
        for lam, runs in by_lambda.items():
            dev = summarize([r["dev"]["accuracy"] for r in runs])
            test = summarize([r["test"]["accuracy"] for r in runs])
            xs.append(lam)
            means.append(test[0])
            stds.append(error_bar(test[1]))
            rows.append(
                [method, lam, test[2], dev[0], dev[1], test[0], test[1], int(lam == chosen)]
            )
        color = COLORS.get(method)
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, color=color, label=method)
        i = xs.index(chosen)
        ax.scatter([xs[i]], [means[i]], s=220, facecolors="none", edgecolors=color, linewidths=1.5)
    ce = [r for r in main_results(results) if r["method"] == "ce"]
    if ce:
        mean, std, n = summarize([r["test"]["accuracy"] for r in ce])
        ax.axhline(mean, color=COLORS["ce"], linestyle="--", label=f"ce (n={n})")
        if not math.isnan(std):
            ax.axhspan(mean - std, mean + std, color=COLORS["ce"], alpha=0.15)
        rows.append(["ce", "", n, math.nan, math.nan, mean, std, 0])
    if all_lams[0] > 0 and all_lams[-1] / all_lams[0] >= 10:
        ax.set_xscale("log")
    ax.set_xticks(all_lams)
    ax.set_xticklabels([f"{lam:g}" for lam in all_lams])
    ax.set_xlabel("λ (--contrastive-lambda)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Sensitivity to λ (mean ± std over seeds; ○ = chosen on dev)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    header = ["method", "lambda", "n", "dev_mean", "dev_std", "test_mean", "test_std"]
    return save_plot(fig, out_dir, "lambda", [*header, "chosen_on_dev"], rows)


# ----------------------------------------------------------------------------- command line

PLOTS = ("a", "b", "c", "d", "e")
NAMES = {
    "a": "(a) ACL-Grad angle histogram",
    "b": "(b) layer-score curves",
    "c": "(c) early-exit speed/accuracy",
    "d": "(d) t-SNE of pooled features",
    "e": "(e) sensitivity to lambda",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("results", type=Path, help="the --out folder of acl-fairseq-compare")
    p.add_argument("--data", type=Path, help="binarized data of the runs (for the t-SNE)")
    p.add_argument(
        "--sweep-tsv",
        action="append",
        metavar="[LABEL=]FILE",
        help="acl-fairseq-sweep table (repeatable)",
    )
    p.add_argument("--out", type=Path, help="output folder (default: RESULTS/plots)")
    p.add_argument("--only", default=",".join(PLOTS), help="comma list of a,b,c,d,e")
    p.add_argument("--tsne-seed", type=int, help="seed k of ce-seed<k> / acl-seed<k>")
    p.add_argument("--tsne-split", default="test", help="split whose examples are embedded")
    p.add_argument("--tsne-max-examples", type=int, default=2000, help="random subset of the split")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``acl-fairseq-plots`` command; returns the exit status."""
    return run_tool(PROG, draw, build_parser().parse_args(argv))


def draw(args: argparse.Namespace) -> int:
    """Draws the plots of ``--only``; 1 when one of them failed."""
    if not (args.results / "runs").is_dir():
        raise AclFileNotFoundError(
            f"{args.results}/runs not found: is it an acl-fairseq-compare results folder?"
        )
    out = args.out or args.results / "plots"
    out.mkdir(parents=True, exist_ok=True)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in only if x not in PLOTS]
    if unknown:
        raise AclValueError(f"--only: unknown plot(s) {unknown}; expected some of {PLOTS}")
    jobs: dict[str, Callable[[], list[Path]]] = {
        "a": lambda: plot_angles(args.results, out),
        "b": lambda: plot_layer_scores(args.results, out),
        "c": lambda: plot_early_exit(args.results, out, args.sweep_tsv),
        "d": lambda: plot_tsne(
            args.results, out, args.data, args.tsne_seed, args.tsne_split, args.tsne_max_examples
        ),
        "e": lambda: plot_lambda(args.results, out),
    }
    failed = 0
    for key in only:
        try:
            paths = jobs[key]()
        except Skipped as e:
            print(f"skipped {NAMES[key]}: {e}", flush=True)
            continue
        except Exception as e:  # one broken input should not stop the other plots
            failed += 1
            why = e if isinstance(e, AclFairseqError) else f"{type(e).__name__}: {e}"
            print(f"FAILED {NAMES[key]}: {why}", flush=True)
            continue
        print(f"drew {NAMES[key]}: {', '.join(str(p) for p in paths)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
