"""The trade-off in one picture: test accuracy against measured time per sentence (log scale)
of every row of ``benchmarks/inference_anchors.py``, one panel per batch size and thread count.

Each backend x precision (``system``) has a colour, each policy kind a marker; the anchors a
user would pick, ``transformers`` fp32 and ONNX Runtime int8 at full depth, are drawn in black
and named; the oracle rows (the earliest exit that agrees with the final exit, at the
layer-count ideal of the system's full-depth time) are hollow: a bound, not a measurement.

    python -m benchmarks.anchors_plot anchors-1.csv anchors-2.md --out trade-off.png

Reads the benchmark's tables, CSV or Markdown (several: e.g. one per thread count). The
benchmark writes the same figure with ``--plot FILE.png``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = ("batch", "threads", "system", "policy", "accuracy", "agreement", "mean_exit_layer",
           "ms", "speedup")  # fmt: skip
ORACLE = "oracle-final"
FULL = "full depth"
REFERENCES = ("HF fp32", "ORT int8")  # the anchors: transformers fp32, ONNX Runtime int8
MARKERS = {FULL: "o", "entropy": "^", "maxprob": "v", "per_exit_entropy": "s",
           "per_exit_maxprob": "D", "patience": "P", "learned": "*", ORACLE: "o"}  # fmt: skip


ORACLE_POLICY = f"{ORACLE} (a bound: full depth's time x its mean exit layer / L, not timed)"


def with_oracle_rows(
    rows: Sequence[dict[str, Any]], layers: dict[str, float], depth: int
) -> list[dict[str, Any]]:
    """``rows`` with an oracle row after each full-depth row of a system in ``layers``: the
    full-depth row's predictions (accuracy, agreement), ``layers[system]`` as its mean exit
    layer, its time and speed-up scaled by that layer / ``depth`` (the layer-count ideal)."""
    out: list[dict[str, Any]] = []
    for r in rows:
        out.append(r)
        if r["policy"] != "full depth" or r["system"] not in layers:
            continue
        scale = layers[r["system"]] / depth
        out.append(
            {
                **r,
                "policy": ORACLE_POLICY,
                "mean_exit_layer": layers[r["system"]],
                "ms": None if r["ms"] is None else r["ms"] * scale,
                "speedup": None if r["speedup"] is None else r["speedup"] / scale,
            }
        )
    return out


def _number(text: str) -> float | None:
    text = text.strip()
    return None if text in ("", "-") else float(text)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a table the benchmark wrote: CSV (``*.csv``) or its Markdown."""
    if path.suffix.lower() == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            raw = list(csv.DictReader(f))
    else:
        raw = []
        lines = [line for line in path.read_text(encoding="utf-8").splitlines()]
        header = next((i for i, line in enumerate(lines) if line.startswith("| batch |")), None)
        if header is None:
            raise ValueError(f"{path}: no table of benchmarks.inference_anchors (| batch | ...)")
        for line in lines[header + 2 :]:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(cells) != len(COLUMNS):
                raise ValueError(f"{path}: a row with {len(cells)} cells: {line[:80]}")
            raw.append(dict(zip(COLUMNS, cells)))
    rows = []
    for r in raw:
        rows.append(
            {
                "batch": int(r["batch"]),
                "threads": int(r["threads"]),
                "system": r["system"],
                "policy": r["policy"],
                **{k: _number(r[k]) for k in COLUMNS[4:]},
            }
        )
    return rows


def policy_kind(policy: str) -> str:
    """``full depth``, ``oracle-final``, or the kind of a policy row (``entropy chosen on
    valid: `entropy:0.3``` and ``entropy:0.3`` both give ``entropy``)."""
    text = policy.strip().strip("`")
    if text.startswith(FULL):
        return FULL
    if text.startswith(ORACLE):
        return ORACLE
    head = text.split(" chosen on ")[0] if " chosen on " in text else text
    return head.split(":")[0].strip("` ")


def is_reference(system: str) -> bool:
    """transformers fp32 or ONNX Runtime int8 (with its default fusions) at full depth."""
    return any(system.startswith(r) for r in REFERENCES) and "without" not in system


def points(rows: Sequence[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """``{(threads, batch): [row with a time and its kind]}``: what each panel shows."""
    panels: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r["ms"] is None or r["accuracy"] is None:
            continue
        panels.setdefault((r["threads"], r["batch"]), []).append(
            {**r, "kind": policy_kind(r["policy"])}
        )
    return dict(sorted(panels.items()))


def _some_minor(value: float, _position: Any = None) -> str:
    """A minor tick's label on a log axis spanning decades: 2, 3 and 5 of each decade."""
    if value <= 0:
        return ""
    lead = round(value / 10 ** math.floor(math.log10(value)))
    return f"{value:g}" if lead in (2, 3, 5) else ""


def plot(rows: Sequence[dict[str, Any]], out: Path, title: str = "") -> dict[tuple[int, int], list]:
    """Writes the figure to ``out`` (PNG); returns what each panel shows (``points``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    panels = points(rows)
    if not panels:
        raise ValueError("no timed row to plot (--rounds 0?)")
    threads = sorted({t for t, _ in panels})
    batches = sorted({b for _, b in panels})
    fig, axes = plt.subplots(
        len(threads), len(batches), figsize=(6.2 * len(batches), 4.6 * len(threads)),
        squeeze=False,
    )  # fmt: skip
    systems = sorted(
        {p["system"] for ps in panels.values() for p in ps if not is_reference(p["system"])}
    )
    cmap = plt.get_cmap("tab10")
    colours = {s: cmap(i % 10) for i, s in enumerate(systems)}
    for i, t in enumerate(threads):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            for p in panels.get((t, b), []):
                ref = is_reference(p["system"])
                colour = "black" if ref else colours[p["system"]]
                hollow = p["kind"] == ORACLE
                ax.scatter(
                    p["ms"], p["accuracy"], marker=MARKERS.get(p["kind"], "X"),
                    s=90 if ref else 55, zorder=3,
                    facecolors="none" if hollow else colour, edgecolors=colour,
                    linewidths=1.4,
                )  # fmt: skip
                if ref:
                    ax.annotate(
                        p["system"], (p["ms"], p["accuracy"]), textcoords="offset points",
                        xytext=(6, 6), fontsize=8,
                    )  # fmt: skip
            ax.set_xscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax.xaxis.set_major_formatter(plain)
            low, high = ax.get_xlim()
            if high / low < 8:  # within a decade: label the minor ticks too
                ax.xaxis.set_minor_formatter(plain)
                ax.tick_params(axis="x", which="minor", labelsize=7)
            else:  # 2, 3 and 5 of each decade
                ax.xaxis.set_minor_formatter(FuncFormatter(_some_minor))
                ax.tick_params(axis="x", which="minor", labelsize=7)
            ax.set_title(f"batch {b}, {t} thread{'s' if t > 1 else ''}")
            ax.set_xlabel("ms per sentence (log scale)")
            ax.set_ylabel("test accuracy %")
            ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=colours[s], marker="o", linestyle="", label=s) for s in systems]
    handles += [Line2D([], [], color="black", marker="o", linestyle="", label="anchors (named)")]
    kinds = sorted({p["kind"] for ps in panels.values() for p in ps})
    for kind in kinds:
        label = "oracle-final: a bound (layer-count ideal)" if kind == ORACLE else kind
        handles.append(
            Line2D([], [], color="grey", marker=MARKERS.get(kind, "X"), linestyle="",
                   markerfacecolor="none" if kind == ORACLE else "grey", label=label)
        )  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(handles) // 4), 1, 0.96 if title else 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return panels


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("tables", nargs="+", type=Path, help="tables of benchmarks.inference_anchors")
    p.add_argument("--out", type=Path, required=True, help="the figure (PNG)")
    p.add_argument("--title", default="", help="a line above the panels")
    p.add_argument(
        "--oracle",
        default="",
        help="SYSTEM=LAYER,...: oracle rows for tables written before the benchmark wrote them\n"
        "(the oracle's mean exit layer of each system on the same sentences)",
    )
    p.add_argument("--depth", type=int, default=6, help="the model's layers (with --oracle)")
    args = p.parse_args(argv)
    rows = []
    try:
        oracle = {
            k.strip(): float(v)
            for k, _, v in (i.rpartition("=") for i in args.oracle.split(",") if i)
        }
        for table in args.tables:
            if not table.exists():
                raise ValueError(f"{table}: no such file")
            rows += read_rows(table)
    except ValueError as e:
        p.error(str(e))
    if oracle:
        if any(r["policy"].startswith(ORACLE) for r in rows):
            p.error("--oracle: the tables have oracle rows already")
        rows = with_oracle_rows(rows, oracle, args.depth)
    panels = plot(rows, args.out, args.title)
    print(
        f"wrote {args.out}: {sum(len(v) for v in panels.values())} points in {len(panels)} panels"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
