"""What the exits cost at batch 1 when nobody leaves, and what makes them cheaper.

A multi-exit model at batch 1 on a short sentence pays, per shallow exit, its head: the final
layer norm of the first position (``first`` pooling) or a masked mean (``mean``), the C x C
``dense`` + activation, the K x C ``out_proj``, and the policy's host decision (one
``tolist`` and a float64 softmax in Python). A 20-token layer of MiniLM-L6 is ~2 ms; the head's
arithmetic is ~0.15 MFLOP, so its cost is reading the 384 x 384 float32 ``dense`` weights
(590 KB) back from memory after the layer's 7 MB pushed them out of the cache, plus fixed
Python overhead. The cheaper variants measured here, each against the plain full-depth
forward at the same encoder precision (all rows stay, so the overhead is the exits' alone):

* ``all exits``: every shallow exit evaluated (``entropy:1e-30``: nobody leaves);
* ``bf16 heads`` / ``int8 heads``: only the shallow heads' ``dense`` in low precision
  (``inference_precision.prepare_exit_heads``; the encoder and the final head unchanged);
* ``exits 2,4`` / ``exit 3``: a ``PerExitPolicy`` that evaluates only some exits (the
  policy-level skip list that ``exit_calibration`` writes when an exit does not pay for its
  head; ``per_exit_policy.only_policy_exits``);
* the same at ``--dtypes bf16,int8`` encoders (``prepare_for_inference``: heads go with it).

It also prints the measured head cost in layers (``(all exits - plain) / exits / (plain /
layers)``): the ``head_cost`` to give ``exit_calibration.calibrate_per_exit``.

Random MiniLM-L6-sized weights (``inference_speed.build_fairseq_model``) or ``--checkpoint
CKPT --data DATA`` (test sentences). Interleaved rounds, medians; timings only mean something
on an idle machine::

    OMP_NUM_THREADS=1 python benchmarks/exit_cost_batch1.py --threads 1 --rounds 9
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.exit_policies import EntropyPolicy
from acl_fairseq.inference_precision import prepare_exit_heads, prepare_for_inference
from acl_fairseq.per_exit_policy import PerExitPolicy, only_policy_exits

HEAD = "sentence_classification_head"
NOBODY = 1e-30  # an entropy threshold no row passes: every exit evaluated, nobody leaves


def random_model(pooling: str) -> tuple[Any, list[torch.Tensor]]:
    """A MiniLM-L6-sized multi-exit model (random weights) and 20-token sentences."""
    import inference_speed as bench  # the sibling script

    hf_args = argparse.Namespace(hf_dir=None, classes=2)
    hf_model, vocab, special = bench.build_hf_model(hf_args)
    with tempfile.TemporaryDirectory() as tmp:
        model, _, bert_to_fairseq = bench.build_fairseq_model(
            hf_model, vocab, special, Path(tmp), 2
        )
    for head in model.classification_heads.values():
        head.pooling = pooling
    model.exit_pooling = pooling
    ids, _ = bench.random_bert_batch(vocab, 64, 28, seed=5, min_length=12)
    pad = model.encoder.sentence_encoder.padding_idx
    tokens = torch.tensor(bert_to_fairseq)[ids]
    return model.eval(), [row[row.ne(pad)].unsqueeze(0) for row in tokens]


def checkpoint_model(checkpoint: str, data: str, split: str) -> tuple[Any, list[torch.Tensor]]:
    from acl_fairseq.cli.sweep import load_batches, load_checkpoint

    model, task = load_checkpoint(checkpoint, data, "cpu")
    pad = task.source_dictionary.pad()
    rows = []
    for tokens, _ in load_batches(task, split, 64, 64):
        rows += [row[row.ne(pad)].unsqueeze(0) for row in tokens]
    return model, rows


def variants(model: Any, dtype: str) -> dict[str, tuple[Any, Any]]:
    """``{name: (model, policy or None for the plain forward)}`` at encoder ``dtype``."""
    base = prepare_for_inference(copy.deepcopy(model), dtype)
    shallow = base.shallow_exit_layers
    out: dict[str, tuple[Any, Any]] = {"plain": (base, None), "all exits": (base, NOBODY)}
    if dtype == "fp32":
        for low in ("bf16", "int8"):
            cheap = prepare_exit_heads(copy.deepcopy(model), low, HEAD)
            out[f"all exits, {low} heads"] = (cheap, NOBODY)
    half = tuple(layer for layer in shallow if layer % 2 == 0)
    if half and half != shallow:
        out[f"exits {','.join(map(str, half))}"] = (
            base,
            PerExitPolicy("entropy", half, (NOBODY,) * len(half)),
        )
    middle = shallow[len(shallow) // 2 : len(shallow) // 2 + 1]
    if middle:
        out[f"exit {middle[0]}"] = (base, PerExitPolicy("entropy", middle, (NOBODY,)))
    return out


def job(model: Any, policy: Any, rows: Sequence[torch.Tensor]):
    if policy is None:
        return lambda: [model(r, classification_head_name=HEAD) for r in rows]
    if isinstance(policy, PerExitPolicy):

        def run() -> None:
            with only_policy_exits(model, policy):
                for r in rows:
                    model.early_exit(r, policy)

        return run
    entropy = EntropyPolicy(policy)
    return lambda: [model.early_exit(r, entropy) for r in rows]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", help="a trained multi-exit checkpoint (default: random)")
    p.add_argument("--data", help="its data folder")
    p.add_argument("--split", default="test")
    p.add_argument("--pooling", choices=("first", "mean"), default="first", help="random model")
    p.add_argument("--dtypes", default="fp32,bf16,int8", help="encoder precisions")
    p.add_argument("--rows", type=int, default=24, help="sentences per round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    args = p.parse_args(argv)
    import inference_speed as bench

    logging.getLogger("fairseq").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.checkpoint:
        model, rows = checkpoint_model(args.checkpoint, args.data, args.split)
    else:
        model, rows = random_model(args.pooling)
    rows = rows[: args.rows]
    tokens = sum(int(r.numel()) for r in rows) / len(rows)
    print(f"# exit cost at batch 1\n\n{bench.machine_description(torch.device('cpu'))}\n")
    print(
        f"{len(rows)} sentences of {tokens:.0f} tokens on average, one at a time; "
        f"{model.num_layers} layers, exits at {model.shallow_exit_layers}; median of "
        f"{args.rounds} interleaved rounds\n"
    )
    print("| encoder | variant | ms / sentence | over plain | head cost (layers) |")
    print("|---|---|---|---|---|")
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        cases = variants(model, dtype)
        jobs = {name: job(m, policy, rows) for name, (m, policy) in cases.items()}
        with torch.inference_mode():
            times = bench.interleaved_times(jobs, args.rounds, torch.device("cpu"))
        plain = statistics.median(times["plain"])
        layer = plain / model.num_layers
        for name, seconds in times.items():
            t = statistics.median(seconds)
            ratio = statistics.median(s / q for s, q in zip(seconds, times["plain"]))
            evaluated = {
                "plain": 0,
                **{n: len(model.shallow_exit_layers) for n in cases if n.startswith("all")},
            }.get(name)
            if evaluated is None:
                evaluated = len(getattr(cases[name][1], "layers", ()))
            head = (t - plain) / evaluated / layer if evaluated else 0.0
            print(
                f"| {dtype} | {name} | {1000 * t / len(rows):.2f} | {100 * (ratio - 1):+.1f}% | "
                f"{head:.3f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
