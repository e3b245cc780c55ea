"""Does a lower training precision keep the accuracy? Two ``acl-fairseq-compare`` folders of
the same comparison (same data, methods and seeds), one per precision, side by side.

For every method and seed: the test accuracy of each precision (every exit of a multi-exit
run), the share of test examples whose prediction is the same, the exact McNemar test of the
examples one gets right and the other wrong (pooled over seeds, per method and exit), and the
mean |angle difference| between the two runs' ACL-Grad angles on the same updates (same seed,
so the same batches). A Markdown table to stdout.

Usage (the demo's protocol; docs/results.md, "bf16 mixed precision")::

    python -m benchmarks.precision_accuracy RESULTS_FP32 RESULTS_BF16 --names fp32,bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from acl_fairseq.acl_grad import read_angle_log
from acl_fairseq.experiment.paired_tests import mcnemar
from acl_fairseq.experiment.predictions import PREDICTIONS_FILE, read_predictions
from acl_fairseq.experiment.results import load_results


def runs_by_name(out: Path) -> dict[str, dict]:
    return {Path(r["dir"]).name: r for r in load_results(out)}


def angle_difference(dir_a: Path, dir_b: Path) -> tuple[float, float, int] | None:
    """Mean and largest |angle_a - angle_b| (degrees) over the updates both logged."""
    a = {r.update: r.angle for r in read_angle_log(dir_a / "angles.tsv")}
    b = {r.update: r.angle for r in read_angle_log(dir_b / "angles.tsv")}
    common = sorted(set(a) & set(b))
    if not common:
        return None
    diffs = [abs(a[u] - b[u]) for u in common]
    return statistics.fmean(diffs), max(diffs), len(common)


def compare(out_a: Path, out_b: Path, names: tuple[str, str]) -> str:
    runs_a, runs_b = runs_by_name(out_a), runs_by_name(out_b)
    shared = sorted(set(runs_a) & set(runs_b))
    if not shared:
        raise SystemExit(f"no run of {out_a} is also in {out_b}")
    lines = [
        f"| run | exit | {names[0]} | {names[1]} | same prediction "
        "| angle diff mean / max (updates) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    pooled: dict[tuple[str, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for name in shared:
        ra, rb = runs_a[name], runs_b[name]
        da, db = Path(ra["dir"]), Path(rb["dir"])
        pa = read_predictions(da / PREDICTIONS_FILE)["test"]
        pb = read_predictions(db / PREDICTIONS_FILE)["test"]
        angles = angle_difference(da, db)
        angle = "-" if angles is None else f"{angles[0]:.2f}° / {angles[1]:.2f}° ({angles[2]})"
        for layer in sorted(pa.exits):
            same = sum(x == y for x, y in zip(pa.exits[layer], pb.exits[layer]))
            share = 100.0 * same / len(pa.labels)
            lines.append(
                f"| {name} | {layer} | {pa.accuracy(layer):.2f} | {pb.accuracy(layer):.2f} | "
                f"{share:.1f}% | {angle if layer == max(pa.exits) else ''} |"
            )
            ours, theirs = pooled[(ra["method"], layer)]
            ours.append(pb.correct(layer))
            theirs.append(pa.correct(layer))
    lines += ["", f"Pooled over seeds, {names[1]} against {names[0]} (exact McNemar):", ""]
    lines += [f"| method | exit | seeds | mean difference | {names[1]} only right | "
              f"{names[0]} only right | p |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (method, layer), (ours, theirs) in sorted(pooled.items()):
        test = mcnemar(ours, theirs)
        diff = 100.0 * (sum(map(sum, ours)) - sum(map(sum, theirs))) / sum(map(len, ours))
        lines.append(
            f"| {method} | {layer} | {len(ours)} | {diff:+.2f} | {test.ours_only} | "
            f"{test.theirs_only} | {test.p_value:.3g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("first", type=Path, help="acl-fairseq-compare --out folder (e.g. fp32)")
    p.add_argument("second", type=Path, help="the same comparison in another precision")
    p.add_argument("--names", default="fp32,bf16", help="names of the two folders' precisions")
    args = p.parse_args(argv)
    names = tuple(args.names.split(","))
    if len(names) != 2:
        p.error("--names: two comma-separated names")
    print(compare(args.first, args.second, names))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
