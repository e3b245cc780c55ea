"""What the early-exit loop costs, at batch 1 and at batch B (part 3 of ``inference_speed.py``
measures the same on its model).

* Full-depth overhead: the time of ``early_exit`` over the plain full-depth forward when no row
  leaves, for ``entropy:0`` (a policy that can never exit: the loop runs the plain forward) and
  ``entropy:1e-30`` (evaluated at every exit, but no row leaves: the loop's own cost, exit
  heads and policy included). Goal: at most 3% more than the plain forward.
* Fraction of the layer-count ideal at the thresholds of part 2 (goals: >= 0.95 at batch B,
  >= 0.9 at batch 1).

Medians over ``rounds`` interleaved rounds (``acl_fairseq.inference.measure.sweep``).

Run on its own, it prints one table for batch 1 and batch B, short (~20 tokens) and long
(128 tokens) inputs: the plain forward's time, the ``entropy:1e-30`` overhead and, at entropy
thresholds giving mean exit layers of about 2, 3 and 4 (random MiniLM-L6-sized weights with
staggered exit heads, as ``inference_speed.py`` part 2), the layer-count and wall-clock
speed-ups and their ratio::

    OMP_NUM_THREADS=1 python -m benchmarks.early_exit_overhead --threads 1 [--pooling mean]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.early_exit.policies import EntropyPolicy
from acl_fairseq.early_exit.thresholds import collect_exits
from acl_fairseq.inference.measure import Batch, sweep
from acl_fairseq.models.heads import DEFAULT_HEAD as HEAD
from benchmarks.common import (
    GOAL_FRACTION,
    GOAL_FRACTION_BATCHED,
    GOAL_OVERHEAD,
    build_fairseq_model,
    build_hf_model,
    entropy_for_mean_exit,
    machine_description,
    random_bert_batch,
    single_rows,
    stagger_exit_heads,
)

NOBODY_LEAVES = 1e-30


# ----------------------------------------------------------------------------- standalone


def _config_batches(
    vocab: list[str], to_fs: torch.Tensor, pad: int, size: int, length: int, rows: int
) -> list[Batch]:
    """Random BERT batches: one of ``size`` rows, or ``rows`` single rows when ``size == 1``.

    ``length`` at most 32 gives rows of ``length - 8 .. length + 8`` tokens (padded in a batch,
    unpadded alone); longer inputs are all ``length`` tokens.
    """
    short = length <= 32
    longest = length + 8 if short else length
    count = rows if size == 1 else size
    ids, _ = random_bert_batch(
        vocab, count, longest, seed=10 + length, min_length=length - 8 if short else None
    )
    tokens = to_fs[ids]
    target = torch.zeros(count, dtype=torch.long)
    if size == 1:
        return single_rows([(tokens, target)], pad, count)
    return [(tokens, target)]


def overhead_table(
    model: Any,
    vocab: list[str],
    to_fs: torch.Tensor,
    sizes: Sequence[int],
    lengths: Sequence[int],
    rounds: int,
    single: int,
) -> list[str]:
    """Markdown lines: per batch size and input length, the plain forward, the overhead of
    ``entropy:1e-30`` and the speed-ups at three thresholds (medians of interleaved rounds)."""
    lines = [
        "| batch | tokens | plain forward ms/batch | policy | mean exit layer | "
        "layer-count speed-up | wall-clock speed-up | overhead / fraction of ideal | goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    pad = model.encoder.sentence_encoder.padding_idx
    for size in sizes:
        for length in lengths:
            batches = _config_batches(vocab, to_fs, pad, size, length, single)
            logits, _ = collect_exits(model, batches, HEAD)
            targets = (2.0, 3.0, 4.0)
            thresholds = [entropy_for_mean_exit(logits, t) for t in targets]
            grid = [NOBODY_LEAVES, *dict.fromkeys(thresholds)]
            with torch.inference_mode():
                rows = sweep(model, batches, [EntropyPolicy(t) for t in grid], HEAD, rounds, size)
            tokens = sum(int(t.ne(pad).sum()) for t, _ in batches)
            mean_tokens = tokens / sum(int(t.size(0)) for t, _ in batches)
            plain = f"{rows[0]['full_ms'] * size:.2f}"
            for row in rows[1:]:
                if row["threshold"] == NOBODY_LEAVES:
                    overhead = 1.0 / row["wall_speedup"] - 1.0
                    name, value = "entropy:1e-30 (nobody leaves)", f"{100 * overhead:+.1f}%"
                    ok = overhead <= GOAL_OVERHEAD
                    goal = f"<= {100 * GOAL_OVERHEAD:.0f}%"
                else:
                    goal_fraction = GOAL_FRACTION.get(size, GOAL_FRACTION_BATCHED)
                    name = f"entropy:{row['threshold']:.4g}"
                    value = f"{100 * row['fraction_of_ideal']:.0f}% of ideal"
                    ok = row["fraction_of_ideal"] >= goal_fraction
                    goal = f">= {100 * goal_fraction:.0f}%"
                lines.append(
                    f"| {size} | {mean_tokens:.0f} | {plain} | {name} | "
                    f"{row['mean_exit_layer']:.2f} | {row['layer_speedup']:.2f} | "
                    f"{row['wall_speedup']:.3f} | {value} | {goal}: {'met' if ok else 'NOT met'} |"
                )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--batch", type=int, default=32, help="the batched size (besides 1; 1: batch 1 alone)"
    )
    p.add_argument("--lengths", default="20,128", help="input lengths in tokens")
    p.add_argument("--pooling", choices=("first", "mean"), default="first")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (median)")
    p.add_argument("--single-rows", type=int, default=8, help="examples at batch 1")
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: unchanged)")
    args = p.parse_args(argv)
    import logging

    logging.getLogger("fairseq").setLevel(logging.WARNING)
    logging.getLogger("convert_hf_bert").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_model, vocab, special = build_hf_model(None, args.classes)
    with tempfile.TemporaryDirectory() as tmp:
        model, _, bert_to_fairseq = build_fairseq_model(
            hf_model, vocab, special, Path(tmp), args.classes
        )
    del hf_model
    for head in model.classification_heads.values():
        head.pooling = args.pooling
    model.exit_pooling = args.pooling
    to_fs = torch.tensor(bert_to_fairseq)
    calibration, _ = random_bert_batch(vocab, 32, 64, seed=3, min_length=8)
    stagger_exit_heads(model, to_fs[calibration])
    print(f"# early-exit loop cost\n\n{machine_description(torch.device('cpu'))}\n")
    print(
        f"random MiniLM-L6-sized weights, {args.pooling} pooling, staggered exit heads; "
        f"median of {args.rounds} interleaved rounds; batch 1: {args.single_rows} examples\n"
    )
    lengths = [int(v) for v in args.lengths.split(",")]
    sizes = [1] if args.batch == 1 else [1, args.batch]  # --batch 1: batch 1 alone
    table = overhead_table(model, vocab, to_fs, sizes, lengths, args.rounds, args.single_rows)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
