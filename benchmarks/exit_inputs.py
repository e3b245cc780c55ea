"""What should a shallow exit read? Linear exits refitted on a frozen multi-exit model, each on
different inputs, then the exit policies chosen on dev and reported on test (no timing).

The backbone and the final exit stay as they are (as with ``--freeze-backbone --exit-head
linear``); each shallow exit ``i`` is a new linear head fitted on ``--train`` with cross-entropy
(AdamW, linear decay, batch 32; ``--distill W`` adds W times the KL divergence to the final
exit's answer at temperature 2), on one of these inputs (``INPUTS``):

* ``mean``: the mean of layer i's hidden states over the real tokens (what a linear exit with
  ``--exit-pooling mean`` reads);
* ``mean+max``, ``mean+first``, ``mean+max+first``: beside it, their max over the real tokens
  and the first position's;
* ``means-so-far-concat`` / ``means-so-far-avg``: the means of layers 1..i, concatenated or
  averaged (an exit that sees more than its own layer; at batch 1 the earlier means are already
  computed).

For each input, over ``--seeds``: the test accuracy of every exit, ``oracle-final`` (the earliest
exit that agrees with the final one), and every policy family of
``benchmarks.exit_policies_on_dev`` chosen on dev for each ``--drops`` target, reported on test:
the fixed recipe (per-exit entropy under the agreement constraint at each D) and the fastest
within 0.5 and within 1 point of full depth on test (the best of about twenty dev-chosen
policies read on test: an optimistic reading)::

    python -m benchmarks.exit_inputs CKPT DATA --seeds 1,2,3
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.data.splits import load_batches
from acl_fairseq.early_exit.calibrate import evaluate
from acl_fairseq.early_exit.thresholds import collect_exits, exit_accuracies, oracle_exits
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD
from benchmarks.common import checkpoint_parser
from benchmarks.exit_policies_on_dev import policies_on_dev

ExitLogits = list[tuple[int, Tensor]]


class Split(NamedTuple):
    """One split's pooled hidden states, every exit's logits (the final exit last), labels."""

    pooled: Tensor  # N x L x 3C: per layer, [mean | max | first] over the real tokens
    exits: ExitLogits
    targets: Tensor  # N


def pool_layers(states: Sequence[Tensor], padding: Tensor) -> Tensor:
    """Per layer T x B x C hidden states and B x T pads (True) -> B x L x 3C, each layer's
    ``[mean | max | first]`` over the real tokens."""
    keep = (~padding).transpose(0, 1).unsqueeze(-1)  # T x B x 1
    count = keep.sum(0).clamp(min=1).to(states[0].dtype)
    pooled = []
    for x in states:
        mean = (x * keep).sum(0) / count
        top = x.masked_fill(~keep, float("-inf")).max(0).values
        pooled.append(torch.cat([mean, top, x[0]], dim=-1))
    return torch.stack(pooled, dim=1)


def read_split(model: torch.nn.Module, batches: Sequence[tuple[Tensor, Tensor]], pad: int) -> Split:
    """One pass of the frozen ``model`` over ``batches`` (``data.splits.load_batches``)."""
    exits, targets = collect_exits(model, batches, DEFAULT_HEAD)
    encoder = model.encoder.sentence_encoder
    chunks = []
    with torch.inference_mode():
        for tokens, _ in batches:
            states = encoder(tokens, return_all_hiddens=True)["encoder_states"][1:]
            hidden = [model.exit_hidden(x).float() for x in states]
            chunks.append(pool_layers(hidden, tokens.eq(pad)))
    return Split(torch.cat(chunks), exits, targets)


def _slot(pooled: Tensor, layer: int, slots: Sequence[int]) -> Tensor:
    width = pooled.size(-1) // 3
    return torch.cat([pooled[:, layer - 1, s * width : (s + 1) * width] for s in slots], dim=-1)


def _so_far(pooled: Tensor, layer: int) -> Tensor:
    return torch.stack([_slot(pooled, j, [0]) for j in range(1, layer + 1)], dim=1)


INPUTS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "mean": lambda p, i: _slot(p, i, [0]),
    "mean+max": lambda p, i: _slot(p, i, [0, 1]),
    "mean+first": lambda p, i: _slot(p, i, [0, 2]),
    "mean+max+first": lambda p, i: _slot(p, i, [0, 1, 2]),
    "means-so-far-concat": lambda p, i: _so_far(p, i).flatten(1),
    "means-so-far-avg": lambda p, i: _so_far(p, i).mean(dim=1),
}
"""Name -> (N x L x 3C pooled, exit layer i) -> N x F inputs of exit i's linear head."""


def fit_exit(
    x: Tensor, y: Tensor, final: Tensor, seed: int, epochs: int, lr: float, distill: float
) -> torch.nn.Linear:
    """A linear head N x F -> K fitted on labels ``y`` (and, with ``distill`` > 0, the final
    exit's N x K logits ``final`` at temperature 2)."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(x.size(1), final.size(1))
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * math.ceil(len(x) / 32)
    decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    for _ in range(epochs):
        for rows in torch.randperm(len(x)).split(32):
            logits = head(x[rows])
            loss = F.cross_entropy(logits, y[rows])
            if distill > 0:
                teacher = F.softmax(final[rows] / 2.0, dim=-1)
                kl = F.kl_div(F.log_softmax(logits / 2.0, dim=-1), teacher, reduction="batchmean")
                loss = loss + distill * 4.0 * kl
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            decay.step()
    return head.eval()


def refit(
    train: Split, others: Sequence[Split], inputs: str, seed: int, epochs: int, lr: float,
    distill: float,
) -> list[ExitLogits]:  # fmt: skip
    """Every split of ``others`` with its shallow exits replaced by linear heads on ``inputs``
    fitted on ``train``; the final exit's logits kept."""
    select = INPUTS[inputs]
    out: list[ExitLogits] = [[] for _ in others]
    for layer, _ in train.exits[:-1]:
        x = select(train.pooled, layer)
        head = fit_exit(
            x, train.targets, train.exits[-1][1], seed * 100 + layer, epochs, lr, distill
        )
        with torch.no_grad():
            for exits, split in zip(out, others):
                exits.append((layer, head(select(split.pooled, layer))))
    for exits, split in zip(out, others):
        exits.append(split.exits[-1])
    return out


def summary(
    dev: ExitLogits, dev_targets: Tensor, test: ExitLogits, test_targets: Tensor,
    drops: Sequence[float],
) -> dict[str, float]:  # fmt: skip
    """Layer speed-ups on test: ``oracle``, ``fixed D`` (per-exit entropy, agreement, chosen on
    dev at each D; absent where dev cannot reach D) and ``best 0.5`` / ``best 1`` (the fastest
    dev-chosen policy within that many points of full depth on test; 1.0 when none is)."""
    num_layers = test[-1][0]
    full = 100.0 * float(test[-1][1].argmax(-1).eq(test_targets).double().mean())
    layers, _ = oracle_exits(test)
    out = {"oracle": num_layers / float(layers.double().mean()), "best 0.5": 1.0, "best 1": 1.0}
    for drop in drops:
        for family, policy in policies_on_dev(dev, dev_targets, drop, 0.0, [1, 2], 0.1):
            if policy is None:
                continue
            result = evaluate(test, test_targets, policy, 0.0)
            loss = full - result.accuracy
            if family == "per-exit entropy, agreement":
                out[f"fixed {drop:g}"] = result.layer_speedup
            for bound in (0.5, 1):
                if loss <= bound + 1e-9:
                    key = f"best {bound:g}"
                    out[key] = max(out[key], result.layer_speedup)
    return out


def accuracies(exits: ExitLogits, targets: Tensor) -> list[float]:
    """Test accuracy (%) of every exit, by layer."""
    return list(exit_accuracies(exits, targets).values())


def _spread(values: Sequence[float]) -> str:
    """``2.61x`` or, over several seeds, ``2.61x (2.55-2.66)``: mean (min-max); ``-`` for
    none (the fixed recipe not reachable on dev)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.mean(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    p = checkpoint_parser(__doc__, "split the policies are chosen on", "split they are reported on")
    p.add_argument("--train", default="train", help="split the heads are fitted on")
    p.add_argument("--inputs", default=",".join(INPUTS), help="comma list of INPUTS names")
    p.add_argument("--seeds", default="1", help="comma list: one refit per seed")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--distill", type=float, default=0.0, help="weight of the KL to the final exit")
    p.add_argument("--drops", default="0.5,1,2", help="accuracy-drop targets in points, on dev")
    p.add_argument("--max-examples", type=int, help="cap each split")
    args = p.parse_args(argv)
    names = [v.strip() for v in args.inputs.split(",") if v.strip()]
    unknown = [v for v in names if v not in INPUTS]
    if unknown:
        p.error(f"--inputs: unknown {unknown}; choose from {list(INPUTS)}")
    seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
    drops = [float(v) for v in args.drops.split(",") if v.strip()]
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    loaded = load_for_inference(args.checkpoint, args.data, "cpu", multi_exit=True)
    pad = loaded.task.source_dictionary.pad()
    train, dev, test = (
        read_split(loaded.model, load_batches(loaded.task, split, 64, args.max_examples), pad)
        for split in (args.train, args.dev, args.test)
    )
    print(
        f"# linear exits refitted on {args.train} ({len(train.targets)} rows) of a frozen model, "
        f"policies chosen on {args.dev} ({len(dev.targets)}), reported on {args.test} "
        f"({len(test.targets)}); seeds {args.seeds}, {args.epochs} epochs, lr {args.lr:g}, "
        f"distill {args.distill:g}; mean (min-max) over seeds\n"
    )
    keys = ["oracle", *[f"fixed {d:g}" for d in drops], "best 0.5", "best 1"]
    print("| exits read | test accuracy per exit | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    rows = [("the model's own", [(dev.exits, test.exits)])]
    for name in names:
        fits = [
            refit(train, [dev, test], name, s, args.epochs, args.lr, args.distill) for s in seeds
        ]
        rows.append((name, fits))
    for name, runs in rows:
        accs = [accuracies(t, test.targets) for _, t in runs]
        sums = [summary(d, dev.targets, t, test.targets, drops) for d, t in runs]
        per_exit = " / ".join(
            f"{statistics.mean(a[e] for a in accs):.1f}" for e in range(len(accs[0]))
        )
        cells = [_spread([s[k] for s in sums if k in s]) for k in keys]
        print(f"| {name} | {per_exit} | " + " | ".join(cells) + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
