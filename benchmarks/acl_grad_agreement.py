"""How often the cheap ACL-Grad scopes agree with the exact decision.

The exact decision (``--acl-grad-scope all``) measures the angle between the CE and the
contrastive gradients of every trainable parameter; ``head`` measures it on the
classification heads' parameters only (almost free), ``top:K`` on the heads plus the top K
encoder layers. With the exact scope, ``--acl-grad-log`` writes the exact and the heads-only
angle of every update, and ``--acl-grad-log-top-k`` the top-K angles of the same update, so
one training run gives every scope's decision on the same gradients.

This script trains ``ce_scl`` and ``acl`` with ``acl-fairseq-compare`` (``--acl-grad-threshold
180``: every term is kept, so the run is plain CE + term and the angles can be thresholded at
any value afterwards; resumable, see acl-fairseq-compare), then prints, per method, scope and
threshold, the fraction of updates on which the scope's decision agrees with the exact one,
how many each would drop, and the Pearson correlation of the two angles::

    python -m benchmarks.acl_grad_agreement demo_work/data/rt-1600-600-2000-bin \\
        --restore-file demo_work/minilm-fairseq/model.pt \\
        --arch-args-file demo_work/minilm-fairseq/fairseq_args.txt --out AGREEMENT --top-k 1,2,3

``--logs-only`` skips training and analyses the ``angles.tsv`` files already in ``--out``.
"""

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from acl_fairseq.acl_grad import read_angle_log, scope_agreement

THRESHOLDS = (60.0, 75.0, 90.0)


def table_rows(name: str, records: list) -> list[str]:
    """Markdown table rows: one per scope and threshold."""
    return [
        f"| {name} | {a.scope} | {a.updates} | {a.mean_exact:.1f} | {a.mean_scope:.1f} | "
        f"{a.pearson_r:.2f} | {a.threshold:.0f}° | {a.exact_drops} | {a.scope_drops} | "
        f"{100.0 * a.agree:.1f}% |"
        for a in scope_agreement(records, THRESHOLDS)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("data", nargs="?", help="binarized data directory (as for acl-fairseq-compare)")
    p.add_argument("--out", default="AGREEMENT", help="results folder (default: AGREEMENT)")
    p.add_argument("--seeds", default="1", help="comma list (default: 1)")
    p.add_argument("--logs-only", action="store_true", help="analyse the existing logs only")
    p.add_argument(
        "--top-k",
        default="1,2,3",
        help="comma list of K for the top:K scopes logged beside the exact angle (default: "
        "1,2,3; each K at most the model's layer count)",
    )
    p.add_argument("--extra", default="", help="passed on to acl-fairseq-compare's --extra")
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
            "--extra",
            shlex.join([*shlex.split(a.extra), "--acl-grad-log-top-k", a.top_k]),
            *compare_args,
        ]
        subprocess.run(cmd, check=True)
    print("\nexact = angle on every trainable parameter; head = on the classification heads only")
    print("(--acl-grad-scope head); top:K = on the heads and the top K encoder layers; a")
    print("decision drops the term when the angle exceeds the threshold\n")
    print(
        "| run | scope | updates | mean exact angle | mean scope angle | Pearson r | threshold | "
        "exact drops | scope drops | decisions agree |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    logs = sorted((out / "runs").glob("*/angles.tsv"))
    if not logs:
        raise SystemExit(f"no runs/*/angles.tsv under {out}")
    skipped = []
    for log in logs:
        rows = table_rows(log.parent.name, read_angle_log(log))
        if not rows:
            skipped.append(log.parent.name)
        for row in rows:
            print(row)
    if skipped:
        print(f"\nskipped (no heads-only angle column; re-run with --force): {', '.join(skipped)}")
    if len(skipped) == len(logs):
        raise SystemExit("no log with both angles")


if __name__ == "__main__":
    main()
