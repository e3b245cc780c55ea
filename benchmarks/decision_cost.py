"""What one early-exit decision costs per exit, by kind, at batch 1 and 32: the loops' own
call (``portable.decide.Decision.decide`` on the exit's logits taken to the host, from a torch
tensor as the torch batch-1 path hands them), K = 2 classes, random logits, five exits per row,
the state made per row. CPU time (``time.process_time``), the best of ``--repeats``::

    OMP_NUM_THREADS=1 python -m benchmarks.decision_cost --repeats 5
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from acl_fairseq.early_exit.policies import parse_policy
from acl_fairseq.runtime.rows import host_decider

SPECS = [
    "entropy:0.3",
    "maxprob:0.9",
    "patience:2",
    "per_exit_entropy:1=0.3,2=0.2,3=0.1,4=0.1,5=0.1",
    "learned:0.9;bias=-2.5;maxprob=3.1;margin=1.2;entropy=-0.4;agree=0.8;run=0.3;exit=0.05",
]
EXITS = 5


def per_exit(spec: str, batch: int, rows: int, repeats: int) -> float:
    """Microseconds of CPU per decision at ``batch`` rows, the best of ``repeats``."""
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, 2, generator=gen) * 3 for _ in range(EXITS)]
    decider = host_decider(parse_policy(spec))
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(rows):
            state = decider.init_state(batch)
            for x in logits:
                leave, state = decider.decide(x.detach().float().cpu().numpy(), state)
                bool(leave.any())
        best = min(best, (time.process_time() - start) / (rows * EXITS))
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, default=4000, help="rows (batches) per repeat at batch 1")
    args = p.parse_args(argv)
    print("| kind | batch 1, us per exit | batch 32, us per exit |\n|---|---|---|")
    for spec in SPECS:
        one = per_exit(spec, 1, args.rows, args.repeats)
        many = per_exit(spec, 32, args.rows // 4, args.repeats)
        print(f"| {spec.split(':')[0]} | {one:.1f} | {many:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
