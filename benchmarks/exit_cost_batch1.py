"""What the exits cost at batch 1 when nobody leaves, per encoder precision, and what makes
them cheaper: a ratio table.

A multi-exit model at batch 1 on a short sentence pays, per shallow exit, its head (the final
layer norm of the first position for pre-norm models, the C x C ``dense`` + activation, the
K x C ``out_proj``) and the policy's decision. The head's arithmetic is ~0.15 MFLOP; its cost
is reading the ``dense`` weights back after the layer pushed them out of the cache, and the
fixed cost of each tensor op run right after a layer (docs/results.md). Each
variant is timed against the plain full-depth forward *at the same encoder precision*, with
every row staying to the last layer, so the ratio is the exits' cost (with the batch-1 loop's
own, which one row gives apart):

* ``all exits``: every shallow exit evaluated (``entropy:1e-30``: nobody leaves), on the
  batch-1 path (``runtime.torch_row``);
* ``all exits, general loop``: the same through the general batched loop
  (``run_early_exit(..., single_row=False)``): what batch 1 cost before the batch-1 path;
* ``batch-1 loop, last exit only``: the batch-1 path with no shallow exit, so that ``all
  exits`` minus this row is the exits' own cost and this row is the loop's against the plain
  forward;
* ``floor: one value to the host per exit``: that loop with, at each shallow exit, the least an
  exit can do in eager torch (one indexing op and one host sync, no head): minus the row
  above, the part of the exits' cost no head or decision code can remove;
* ``exits 2,4`` / ``exit 3``: a per-exit policy that evaluates only some exits (the skip list
  the sweep's calibration writes when an exit does not pay for its head, ``--head-cost``);
* ``all exits, bf16 heads`` / ``int8 heads`` (fp32 encoder only): only the shallow heads'
  ``dense`` in low precision (``benchmarks.exit_heads``).

``--dtypes ...,ort`` adds the ONNX Runtime backend's int8 segments (``runtime.onnx_runtime``;
plain: its one full-depth session; an exit: the end of a segment and its head in the graph,
then the decision).

The precisions are ``--dtypes`` (``prepare_for_inference``: the heads go with the encoder).
The last row is the measured head cost in layers, ``(all exits - plain) / exits / (plain /
layers)``: the ``--head-cost`` to give ``acl-fairseq-sweep``. The goal: at most 3% with
nobody leaving, at batch 1 on 20-token inputs.

Random MiniLM-L6-sized weights, or ``--checkpoint CKPT --data DATA`` (its ``--split``
sentences). Interleaved rounds after a warm-up, medians of the per-round ratios; timings only
mean something on an idle machine::

    OMP_NUM_THREADS=1 python -m benchmarks.exit_cost_batch1 --threads 1 --rounds 9
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.early_exit.per_exit import PerExitEntropyPolicy
from acl_fairseq.early_exit.policies import EntropyPolicy, ExitPolicy
from acl_fairseq.models.heads import DEFAULT_HEAD as HEAD
from acl_fairseq.runtime.precision import (
    check_precision,
    prepare_for_inference,
)
from acl_fairseq.runtime.torch_loop import run_early_exit
from acl_fairseq.runtime.torch_row import run_single_row
from benchmarks.common import (
    GOAL_OVERHEAD,
    build_fairseq_model,
    build_hf_model,
    machine_description,
    random_bert_batch,
)
from benchmarks.exit_heads import prepare_exit_heads

ORT = "ort"  # the ONNX Runtime backend's int8 segments, beside the torch precisions
NOBODY = 1e-30  # an entropy threshold no row passes: every exit evaluated, nobody leaves
PLAIN = "plain forward"
GENERAL = "all exits, general loop (no batch-1 path: before)"
LAST_ONLY = "batch-1 loop, last exit only"
FLOOR = "floor: one value to the host per exit, no head"


def random_model(pooling: str, length: int) -> tuple[Any, list[Tensor]]:
    """A MiniLM-L6-sized multi-exit model (random weights) and sentences of about ``length``
    tokens (one row each, no padding)."""
    hf_model, vocab, special = build_hf_model(None, 2)
    with tempfile.TemporaryDirectory() as tmp:
        model, _, bert_to_fairseq = build_fairseq_model(hf_model, vocab, special, Path(tmp), 2)
    for head in model.classification_heads.values():
        head.pooling = pooling
    ids, _ = random_bert_batch(vocab, 64, length + 4, seed=5, min_length=max(3, length - 4))
    pad = model.encoder.sentence_encoder.padding_idx
    tokens = torch.tensor(bert_to_fairseq)[ids]
    return model.eval(), [row[row.ne(pad)].unsqueeze(0) for row in tokens]


def checkpoint_model(checkpoint: str, data: str, split: str) -> tuple[Any, list[Tensor]]:
    """The checkpoint's model and its ``split`` sentences, one row each."""
    from acl_fairseq.data.splits import load_batches
    from acl_fairseq.inference.loader import load_for_inference

    loaded = load_for_inference(checkpoint, data, "cpu", multi_exit=True)
    model, task = loaded.model, loaded.task
    pad = task.source_dictionary.pad()
    rows = []
    for tokens, _ in load_batches(task, split, 64, 256):
        rows += [row[row.ne(pad)].unsqueeze(0) for row in tokens]
    return model, rows


def variants(model: Any, dtype: str, onnx_folder: Path) -> dict[str, tuple[Any, ExitPolicy | None]]:
    """``{name: (model, policy or None for the plain forward)}`` at encoder ``dtype``; ``ort``:
    the ONNX Runtime backend's int8 segments (plain: one full-depth session)."""
    if dtype == ORT:
        from acl_fairseq.runtime.onnx_runtime import OrtEarlyExit

        base = OrtEarlyExit(model, HEAD, onnx_folder, "int8", shared_pool=True)
    else:
        base = prepare_for_inference(copy.deepcopy(model), dtype)
    shallow = base.shallow_exit_layers
    out: dict[str, tuple[Any, ExitPolicy | None]] = {
        PLAIN: (base, None),
        f"all {len(shallow)} exits": (base, EntropyPolicy(NOBODY)),
    }
    if dtype != ORT:
        out[GENERAL] = (base, EntropyPolicy(NOBODY))
        out[LAST_ONLY] = (base, EntropyPolicy(NOBODY))
        out[FLOOR] = (base, EntropyPolicy(NOBODY))
    half = tuple(layer for layer in shallow if layer % 2 == 0)
    if half and half != shallow:
        policy = PerExitEntropyPolicy(half, (NOBODY,) * len(half))
        out[f"exits {','.join(map(str, half))} only (skip list)"] = (base, policy)
    middle = shallow[len(shallow) // 2 : len(shallow) // 2 + 1]
    if middle and middle != shallow:
        out[f"exit {middle[0]} only (skip list)"] = (base, PerExitEntropyPolicy(middle, (NOBODY,)))
    if dtype == "fp32":
        for low in ("bf16", "int8"):
            cheap = prepare_exit_heads(copy.deepcopy(model), low)
            out[f"all exits, {low} shallow heads"] = (cheap, EntropyPolicy(NOBODY))
    return out


def job(
    model: Any, policy: ExitPolicy | None, rows: Sequence[Tensor], name: str = ""
) -> Callable[[], Any]:
    if policy is None:
        return lambda: [model(r, classification_head_name=HEAD) for r in rows]
    if name == GENERAL:  # the general batched loop, without the batch-1 path
        return lambda: [run_early_exit(model, r, policy, HEAD, single_row=False) for r in rows]
    if name == LAST_ONLY:
        last = {model.num_layers: dict(model.exit_heads(HEAD))[model.num_layers]}
        return lambda: [run_single_row(model, r, policy, last) for r in rows]
    if name == FLOOR:
        return lambda: [floor_row(model, r) for r in rows]
    return lambda: [model.early_exit(r, policy, classification_head_name=HEAD) for r in rows]


def floor_row(model: Any, tokens: Tensor) -> Tensor:
    """The batch-1 loop with the final exit only and, after each shallow exit's layer, one
    value of the hidden states read to the host: the least an exit can cost in eager torch."""
    encoder = model.encoder.sentence_encoder
    shallow = set(model.shallow_exit_layers)
    x, _ = encoder.forward_embedding(tokens)
    x = x.transpose(0, 1)  # T x 1 x C
    for layer_idx, layer in enumerate(encoder.layers, start=1):
        out = layer(x, encoder_padding_mask=None)
        x = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        if layer_idx in shallow:
            x[0, 0, 0].item()
    return model.classification_heads[HEAD](x.transpose(0, 1))


def interleaved(jobs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of every job: one untimed call each, then ``rounds`` rounds in
    alternating order."""
    names = list(jobs)
    for name in names:
        jobs[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            jobs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", help="a trained multi-exit checkpoint (default: random)")
    p.add_argument("--data", help="its data folder")
    p.add_argument("--split", default="test")
    p.add_argument("--pooling", choices=("first", "mean"), default="first", help="random model")
    p.add_argument("--length", type=int, default=20, help="random model: tokens per sentence")
    p.add_argument(
        "--dtypes",
        default="fp32,bf16,int8",
        help="encoder precisions; ort: the ONNX Runtime backend's int8 segments",
    )
    p.add_argument("--rows", type=int, default=24, help="sentences per round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    args = p.parse_args(argv)
    try:
        dtypes = [
            d.strip() if d.strip() == ORT else check_precision(d)
            for d in args.dtypes.split(",")
            if d.strip()
        ]
    except ValueError as e:
        p.error(str(e))
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.checkpoint:
        model, rows = checkpoint_model(args.checkpoint, args.data, args.split)
    else:
        model, rows = random_model(args.pooling, args.length)
    rows = rows[: args.rows]
    tokens = sum(int(r.numel()) for r in rows) / len(rows)
    print(f"# exit cost at batch 1, nobody leaving\n\n{machine_description(torch.device('cpu'))}\n")
    print(
        f"{len(rows)} sentences of {tokens:.0f} tokens on average, one at a time; "
        f"{model.num_layers} layers, exits at {model.shallow_exit_layers}; each cell: time over "
        f"the plain forward at the same precision - 1 (median of {args.rounds} interleaved "
        "rounds' ratios, after a warm-up)\n"
    )
    cells: dict[str, dict[str, str]] = {}
    summary: dict[str, dict[str, str]] = {}  # printed after the variants
    with tempfile.TemporaryDirectory() as onnx_folder:  # ort: the exported segments
        for dtype in dtypes:
            cases = variants(model, dtype, Path(onnx_folder))
            jobs = {name: job(m, p, rows, name) for name, (m, p) in cases.items()}
            with torch.inference_mode():
                times = interleaved(jobs, args.rounds)
            plain = times[PLAIN]
            cells.setdefault(f"{PLAIN}, ms / sentence", {})[dtype] = (
                f"{1000 * statistics.median(plain) / len(rows):.2f}"
            )
            for name in cases:
                if name == PLAIN:
                    continue
                ratio = statistics.median(s / q for s, q in zip(times[name], plain))
                cells.setdefault(name, {})[dtype] = f"{100 * (ratio - 1):+.1f}%"
                if name.startswith("all") and "heads" not in name and name != GENERAL:
                    evaluated = len(model.shallow_exit_layers)
                    head = (ratio - 1) * model.num_layers / evaluated
                    summary.setdefault("head cost, layers (--head-cost)", {})[dtype] = f"{head:.3f}"
                    verdict = "met" if ratio - 1 <= GOAL_OVERHEAD else "NOT met"
                    goal = f"goal: all exits <= {100 * GOAL_OVERHEAD:.0f}%"
                    summary.setdefault(goal, {})[dtype] = verdict
    print("| variant | " + " | ".join(dtypes) + " |")
    print("|---|" + "---|" * len(dtypes))
    for name, by_dtype in {**cells, **summary}.items():
        print(f"| {name} | " + " | ".join(by_dtype.get(d, "-") for d in dtypes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
