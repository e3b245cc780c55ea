"""How often ``--acl-grad-scope head`` agrees with the exact ACL-Grad decision.

The exact decision (``--acl-grad-scope all``) measures the angle between the CE and the
contrastive gradients of every trainable parameter; ``head`` measures it on the
classification heads' parameters only, which is almost free. With the exact scope,
``--acl-grad-log`` writes both angles of every update (columns 2 and 4), so one training run
gives both decisions on the same gradients.

This script trains ``ce_scl`` and ``acl`` with ``acl-fairseq-compare`` (``--acl-grad-threshold
180``: every term is kept, so the run is plain CE + term and the angles can be thresholded at
any value afterwards; resumable, see acl-fairseq-compare), then prints, per method and
threshold, the fraction of updates on which the two decisions agree, how many each would drop,
and the correlation of the two angles::

    python benchmarks/acl_grad_agreement.py demo_work/data/rt-1600-600-2000-bin \\
        --restore-file demo_work/minilm-fairseq/model.pt \\
        --arch-args-file demo_work/minilm-fairseq/fairseq_args.txt --out AGREEMENT

``--logs-only`` skips training and analyses the ``angles.tsv`` files already in ``--out``.
"""

import argparse
import math
import statistics
import subprocess
import sys
from pathlib import Path

from acl_fairseq.acl_grad import read_angle_log

THRESHOLDS = (60.0, 75.0, 90.0)


def read_both_angles(path: Path) -> list[tuple[float, float]] | None:
    """(exact angle, heads-only angle) per update of an exact-scope ``--acl-grad-log``;
    None when the log has no heads-only angle (written by an older version)."""
    records = read_angle_log(path)
    if any(math.isnan(r.head_angle) for r in records):
        return None
    return [(r.angle, r.head_angle) for r in records]


def agreement_rows(name: str, pairs: list[tuple[float, float]]) -> list[str]:
    """Markdown table rows: one per threshold."""
    exact = [e for e, _ in pairs]
    head = [h for _, h in pairs]
    r = statistics.correlation(exact, head) if len(pairs) > 2 else float("nan")
    out = []
    for t in THRESHOLDS:
        drop_exact = sum(e > t for e in exact)
        drop_head = sum(h > t for h in head)
        agree = sum((e > t) == (h > t) for e, h in pairs)
        out.append(
            f"| {name} | {len(pairs)} | {statistics.fmean(exact):.1f} | "
            f"{statistics.fmean(head):.1f} | {r:.2f} | {t:.0f}° | {drop_exact} | {drop_head} | "
            f"{100.0 * agree / len(pairs):.1f}% |"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("data", nargs="?", help="binarized data directory (as for acl-fairseq-compare)")
    p.add_argument("--out", default="AGREEMENT", help="results folder (default: AGREEMENT)")
    p.add_argument("--seeds", default="1", help="comma list (default: 1)")
    p.add_argument("--logs-only", action="store_true", help="analyse the existing logs only")
    a, compare_args = p.parse_known_args()
    out = Path(a.out)
    if not a.logs_only:
        if not a.data:
            p.error("give the data directory (or --logs-only)")
        cmd = [
            sys.executable,
            "-m",
            "acl_fairseq.cli.compare",
            a.data,
            "--methods",
            "ce_scl,acl",
            "--acl-grad-threshold",
            "180",
            "--seeds",
            a.seeds,
            "--out",
            str(out),
            *compare_args,
        ]
        subprocess.run(cmd, check=True)
    print("\nexact = angle on every trainable parameter; head = on the classification heads only")
    print("(--acl-grad-scope head); a decision drops the term when the angle exceeds the")
    print("threshold\n")
    print(
        "| run | updates | mean exact angle | mean head angle | Pearson r | threshold | "
        "exact drops | head drops | decisions agree |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    logs = sorted((out / "runs").glob("*/angles.tsv"))
    if not logs:
        raise SystemExit(f"no runs/*/angles.tsv under {out}")
    skipped = []
    for log in logs:
        pairs = read_both_angles(log)
        if not pairs:
            skipped.append(log.parent.name)
            continue
        for row in agreement_rows(log.parent.name, pairs):
            print(row)
    if skipped:
        print(f"\nskipped (no heads-only angle column; re-run with --force): {', '.join(skipped)}")
    if len(skipped) == len(logs):
        raise SystemExit("no log with both angles")


if __name__ == "__main__":
    main()
