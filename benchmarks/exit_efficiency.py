"""Where the time of a batched early-exit policy goes, against its layer-count ideal.

The anchors table (``benchmarks/inference_anchors.py``) reads a policy's efficiency as its
*layer-count ideal*, full depth's time x mean exit layer / L, over its measured time. This
benchmark splits that ratio into factors, each a ratio of two numbers of one run, at batch
``--batch-size`` on the ``--test`` sentences, for ``--dtypes`` (fp32, int8, ``ort``: this
project's ONNX Runtime int8 segments):

* ``length``: the layer-count ideal over the *token* ideal (full depth's time x the share of
  token-layers the rows run: sum of length x exit layer over sum of length x L). Below 1 when
  the rows that leave early are the short ones: a sentence's cost is its tokens, not 1;
* ``padding``: the token ideal over the *padded* ideal (the share of padded positions x layers
  the loop runs: the running rows x their trimmed width at each layer, over the batch's rows x
  its width x L);
* ``shapes``: the padded ideal over the *replay* of the loop's own shapes, the layers alone
  (the rows each layer runs and their width, from the policy's exits; no head, no decision):
  what smaller matrices cost per row;
* ``heads``: that replay over the same replay with the policy's exit heads (torch) or the
  segments' sessions (ONNX Runtime: the heads are in the segments' graphs);
* ``decisions``: the replay with heads over the policy itself: the decisions, the host
  syncs, the row bookkeeping.

Their product is the efficiency. The policy is chosen on ``--dev`` per system as the anchors
choose it (``--kind``, ``--max-accuracy-drop``, agreement), or ``--policy`` as given.
Interleaved timed rounds after an untimed pass; medians; an idle machine::

    OMP_NUM_THREADS=1 python -m benchmarks.exit_efficiency CKPT DATA --max-examples 500 \\
        --rounds 5 --dtypes fp32,int8,ort --out efficiency.md
"""

from __future__ import annotations

import copy
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.early_exit.policies import ExitPolicy, parse_policy
from acl_fairseq.inference import deploy
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.pooling import MeanWeights
from acl_fairseq.runtime.onnx_runtime import OrtEarlyExit
from acl_fairseq.runtime.precision import prepare_for_inference
from acl_fairseq.runtime.torch_loop import _exit_logits, _run_layer
from benchmarks.common import checkpoint_parser
from benchmarks.inference_anchors import HEAD, batches_of, deployable, project_runner

ORT = "ort"
FACTORS = ("length", "padding", "shapes", "heads", "decisions")


class Shapes:
    """What the early-exit loop runs for one batch under a policy, from each row's exit layer
    (``exits`` B) and the padding mask (B x T): per layer, the indices of the rows kept from
    the previous layer's running rows (None: all of them) and the trimmed width."""

    def __init__(self, exits: Tensor, padding_mask: Tensor, num_layers: int) -> None:
        nonpad = ~padding_mask
        lengths = nonpad.sum(dim=1)
        positions = torch.arange(1, padding_mask.size(1) + 1)
        ends = (nonpad * positions).amax(dim=1)
        self.batch, self.width = padding_mask.size(0), padding_mask.size(1)
        self.lengths, self.exits, self.num_layers = lengths, exits, num_layers
        # per layer: (keep, width, rows, has_pads) of the rows it runs
        self.steps: list[tuple[Tensor | None, int, int, bool]] = []
        running = torch.arange(self.batch)
        width = self.width
        for layer in range(1, num_layers + 1):
            alive = running[exits[running] >= layer]
            keep = None
            if 0 < alive.numel() < running.numel():
                position = {int(r): i for i, r in enumerate(running.tolist())}
                keep = torch.tensor([position[int(r)] for r in alive.tolist()], dtype=torch.long)
                width = min(width, max(1, int(ends[alive].max())))
            running = alive
            pads = bool(alive.numel()) and int(lengths[alive].min()) < width
            self.steps.append((keep, width, int(alive.numel()), pads))

    def padded_work(self) -> tuple[int, int]:
        """(positions x layers the loop runs, the batch's rows x width x L)."""
        done = sum(rows * width for _, width, rows, _ in self.steps)
        return done, self.batch * self.width * self.num_layers

    def token_work(self) -> tuple[int, int]:
        """(sum of length x exit layer, sum of length x L)."""
        return int((self.lengths * self.exits).sum()), int(self.lengths.sum()) * self.num_layers


def replay_torch(model: Any, heads: dict[int, Any] | None) -> Callable[[Tensor, Shapes], Tensor]:
    """The loop's layers (and ``heads``' logits, when given) on the shapes of a batch, with no
    decision, no host sync and no bookkeeping; returns the hidden states (T' x B' x C) of the
    rows that run the last layer they reach."""
    encoder = model.encoder.sentence_encoder

    def run(tokens: Tensor, shapes: Shapes) -> Tensor:
        padding_mask = model.padding_mask(tokens)
        x, _ = encoder.forward_embedding(tokens)
        has_pads = shapes.steps[0][3]
        if bool(padding_mask.any()):  # as the loop: the first sync (it has the same one)
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        x = x.transpose(0, 1)
        mean = MeanWeights(padding_mask, has_pads) if heads else None
        for layer_idx, (layer, (keep, width, rows, has_pads)) in enumerate(
            zip(encoder.layers, shapes.steps), start=1
        ):
            if rows == 0:
                break
            if keep is not None:
                x = x.index_select(1, keep)[:width]
                padding_mask = padding_mask.index_select(0, keep)[:, :width]
                if mean is not None:
                    mean.select(keep, width)
            x = _run_layer(layer, x, padding_mask if has_pads else None)
            if heads and layer_idx in heads:
                _exit_logits(model, heads[layer_idx], x, mean)
        return x

    return run


def replay_ort(runner: OrtEarlyExit, exits: Sequence[int]) -> Callable[[Tensor, Shapes], None]:
    """The policy's segments (heads in their graphs) on the shapes of a batch, no decision:
    rows leave only at a segment's end, so a segment keeps the rows of its first layer."""
    segments = runner.segments(exits)

    def run(tokens: Tensor, shapes: Shapes) -> None:
        x, mask = tokens.numpy(), tokens.eq(runner.pad).numpy()
        first = 1
        for last, session in segments:
            keep, width, rows, _ = shapes.steps[first - 1]
            if rows == 0:
                break
            if keep is not None:
                x = np.take(x, keep.numpy(), axis=1)[:width]
                mask = np.ascontiguousarray(mask[keep.numpy()][:, :width])
            x = session.run(None, {"x": x, "padding_mask": mask})[0]
            first = last + 1

    return run


def over(
    run: Callable[..., Any],
    batches: Sequence[tuple[Tensor, Tensor]],
    shapes: Sequence[Shapes] | None = None,
) -> Callable[[], None]:
    """One pass of ``run`` over ``batches`` (with each batch's ``shapes``, for a replay)."""

    def go() -> None:
        with torch.inference_mode():
            for i, (tokens, _) in enumerate(batches):
                run(tokens, shapes[i]) if shapes is not None else run(tokens)

    return go


def time_rounds(runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds of each run over ``rounds`` interleaved rounds (order alternating)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def factors(times: dict[str, float], work: dict[str, tuple[int, int]], mean_layer: float,
            num_layers: int) -> dict[str, float]:  # fmt: skip
    """The ideals and the factors (module docstring) from the measured ``times`` (full,
    layers, heads, policy) and the counted ``work`` (token, padded: (done, full))."""
    full = times["full"]
    row_ideal = full * mean_layer / num_layers
    token_ideal = full * work["token"][0] / work["token"][1]
    padded_ideal = full * work["padded"][0] / work["padded"][1]
    out = {
        "row_ideal": row_ideal,
        "token_ideal": token_ideal,
        "padded_ideal": padded_ideal,
        "efficiency": row_ideal / times["policy"],
        "length": row_ideal / token_ideal,
        "padding": token_ideal / padded_ideal,
        "shapes": padded_ideal / times["layers"],
        "heads": times["layers"] / times["heads"],
        "decisions": times["heads"] / times["policy"],
    }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = checkpoint_parser(__doc__, "split the policy is chosen on", "split it is timed on")
    p.add_argument("--dtypes", default="fp32,int8,ort", help="fp32, bf16, int8, ort")
    p.add_argument("--kind", default="per_exit_entropy", help="policy kind chosen on --dev")
    p.add_argument("--max-accuracy-drop", type=float, default=1.0)
    p.add_argument("--head-cost", type=float, default=0.0, help="as the anchors' --head-cost")
    p.add_argument("--policy", help="this policy for every system instead of one chosen on dev")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-examples", type=int)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the table (Markdown)")
    args = p.parse_args(argv)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    loaded = load_for_inference(args.checkpoint, args.data, "cpu", multi_exit=True,
                                fingerprint=True)  # fmt: skip
    model, task = loaded.model, loaded.task
    pad = task.source_dictionary.pad()
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    systems: dict[str, Any] = {}
    tmp = tempfile.TemporaryDirectory()
    for name in names:
        if name == ORT:
            systems[name] = OrtEarlyExit(model, HEAD, Path(tmp.name), "int8", 1,
                                         loaded.fingerprint, shared_pool=True)  # fmt: skip
        else:
            systems[name] = prepare_for_inference(copy.deepcopy(model), name)
    if args.policy:
        policies = {name: parse_policy(args.policy) for name in systems}
    else:
        dev = batches_of(task, args.dev, 32, args.max_examples, pad)
        target = deploy.DeployTarget(
            max_accuracy_drop=args.max_accuracy_drop, constraint="agreement",
            head_cost=args.head_cost,
        )  # fmt: skip
        chosen, _ = deployable(systems, dev, [args.kind], target, args.dev)
        policies = {name: chosen[name][0][1] for name in systems}
    batches = batches_of(task, args.test, args.batch_size, args.max_examples, pad)
    n = sum(int(t.size(0)) for t, _ in batches)
    lines = [
        f"# where the time of early exit goes: {Path(args.checkpoint).name}, {args.test}, "
        f"batch {args.batch_size}, one thread, {args.rounds} rounds, {n} sentences",
        "",
        "| system | policy | mean exit layer | full ms | policy ms | layer-count ideal ms | "
        "efficiency | length | padding | shapes | heads | decisions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, system in systems.items():
        policy: ExitPolicy = policies[name]
        early = project_runner(system, policy)
        with torch.inference_mode():
            exits = [early(tokens)[1] for tokens, _ in batches]
        shapes = [Shapes(e, t.eq(pad), int(model.num_layers)) for e, (t, _) in zip(exits, batches)]
        used = tuple(policy.exits(model.shallow_exit_layers))
        if name == ORT:
            layers = heads = replay_ort(system, used)
        else:
            exit_heads = dict(system.exit_heads(HEAD))
            chosen_heads = {
                k: v for k, v in exit_heads.items() if k in used or k == model.num_layers
            }
            layers, heads = replay_torch(system, None), replay_torch(system, chosen_heads)
        full = project_runner(system, None)

        runs = {
            "full": over(full, batches),
            "policy": over(early, batches),
            "layers": over(layers, batches, shapes),
            "heads": over(heads, batches, shapes),
        }
        for run in runs.values():
            run()  # warm-up
        times = time_rounds(runs, args.rounds)
        work = {"token": tuple(map(sum, zip(*(s.token_work() for s in shapes)))),
                "padded": tuple(map(sum, zip(*(s.padded_work() for s in shapes))))}  # fmt: skip
        mean_layer = float(torch.cat(exits).double().mean())
        f = factors(times, work, mean_layer, int(model.num_layers))
        ms = {k: 1000.0 * v / n for k, v in times.items()}
        lines.append(
            f"| {name} | `{policy.spec}` | {mean_layer:.2f} | {ms['full']:.3f} | "
            f"{ms['policy']:.3f} | {1000.0 * f['row_ideal'] / n:.3f} | {f['efficiency']:.0%} | "
            + " | ".join(f"{f[k]:.2f}" for k in FACTORS)
            + " |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    lines += [
        "",
        "efficiency = length x padding x shapes x heads x decisions (each a ratio of this run's "
        "numbers; benchmarks/exit_efficiency.py). For ort the segments carry their heads, so "
        "`heads` is 1 and `shapes` includes them.",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
