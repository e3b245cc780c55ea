"""What every plot of ``acl-fairseq-plots`` shares: matplotlib without a display, the method
colours, the runs of a results folder, and the PNG written with the CSV of its numbers."""

from __future__ import annotations

import csv
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's logging set-up is verbose
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from acl_fairseq.atomic_write import open_atomic, write_with  # noqa: E402

COLORS = {
    "ce": "tab:gray",
    "ce_scl": "tab:orange",
    "acl": "tab:blue",
    "multi_exit_joint": "tab:orange",
    "acl_cl": "tab:blue",
}


class Skipped(Exception):
    """A plot whose inputs are missing."""


def write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with open_atomic(path, "w", newline="") as f:  # whole or not at all
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        for row in rows:
            writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])


def save_plot(
    fig, out_dir: Path, name: str, header: Sequence[str], rows: Sequence[Sequence[Any]]
) -> list[Path]:
    """Writes ``name``.png and the numbers behind it as ``name``.csv; returns both paths."""
    fig.tight_layout()
    png = out_dir / f"{name}.png"
    write_with(png, lambda tmp: fig.savefig(tmp, dpi=150, format="png"))
    plt.close(fig)
    write_csv(out_dir / f"{name}.csv", header, rows)
    return [png, out_dir / f"{name}.csv"]


def main_runs(results_dir: Path, method: str) -> list[Path]:
    """``runs/<method>-seed<k>`` folders (not the lambda sweep), by seed."""
    pattern = re.compile(rf"{re.escape(method)}-seed(\d+)")
    found = []
    for d in (results_dir / "runs").glob(f"{method}-seed*"):
        m = pattern.fullmatch(d.name)
        if m and d.is_dir():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]
