"""Does a learned exit decision separate better on the exits' hidden features than on their
logits? One run on a multi-exit checkpoint, accuracy and layers only (no timing).

At each shallow exit a logistic model (``learned.fit_logistic``, one per exit) predicts whether
the exit's answer equals the final exit's, from

* ``logits``: the six features of the ``learned`` policy (``learned.split_features``: top
  probability, margin, entropy, agreement with the previous exit, the run of agreeing exits,
  the exit's position);
* ``hidden``: those and the exit's C hidden features (the input of its head's ``out_proj``).

Each is fitted either on ``--train`` (a split the model was trained on) or on ``--dev`` by
cross-fitting (``learned_calibration.fold_ids``: out-of-fold scores for the threshold, the model
fitted on all of dev for test). A row leaves at the first exit whose score reaches one
threshold, the cheapest on dev that changes at most D percent of the final exit's predictions
there (``learned_calibration.best_threshold``, exact); the table gives what it does on
``--test``: accuracy against full depth, the share of changed predictions and the layer-count
speed-up, beside ``oracle-final`` (the earliest exit that agrees with the final one)::

    python -m benchmarks.exit_decision_features CKPT DATA --drops 0.5,1,2 --l2 0.01,0.1
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.data.splits import load_batches
from acl_fairseq.early_exit.learned import fit_logistic, split_features
from acl_fairseq.early_exit.learned_calibration import best_threshold, exit_costs, fold_ids
from acl_fairseq.early_exit.thresholds import oracle_exits
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD

KINDS = ("logits", "hidden")


class Pass(NamedTuple):
    """Every exit on a split: layers (E + 1), logits and hidden features per exit, labels."""

    layers: list[int]
    logits: list[Tensor]  # N x K each, the final exit last
    hidden: list[Tensor]  # N x C each
    targets: Tensor  # N


def exit_pass(model: torch.nn.Module, batches: Sequence[tuple[Tensor, Tensor]]) -> Pass:
    """One ``exit_outputs`` pass over ``batches`` (``data.splits.load_batches``)."""
    outs: list[list] = []
    targets = []
    with torch.inference_mode():
        for tokens, target in batches:
            outputs = model.exit_outputs(tokens, classification_head_name=DEFAULT_HEAD)
            outs.append([(o.layer, o.logits.float(), o.features.float()) for o in outputs])
            targets.append(target)
    layers = [layer for layer, _, _ in outs[0]]
    logits = [torch.cat([b[i][1] for b in outs]) for i in range(len(layers))]
    hidden = [torch.cat([b[i][2] for b in outs]) for i in range(len(layers))]
    return Pass(layers, logits, hidden, torch.cat(targets))


def features(p: Pass, kind: str) -> list[Tensor]:
    """Per shallow exit, N x F features of ``kind`` (``KINDS``)."""
    own = split_features(p.logits[:-1])  # N x E x 6
    if kind == "logits":
        return [own[:, e] for e in range(own.size(1))]
    return [torch.cat([p.hidden[e], own[:, e]], dim=1) for e in range(own.size(1))]


def agreement(p: Pass) -> list[Tensor]:
    """Per shallow exit, N bools: its answer equals the final exit's."""
    final = p.logits[-1].argmax(dim=-1)
    return [x.argmax(dim=-1).eq(final) for x in p.logits[:-1]]


def _score(fit: tuple[Tensor, float], x: Tensor) -> Tensor:
    weights, bias = fit
    return x.double() @ weights + bias


def fitted_scores(train: Pass, others: Sequence[Pass], kind: str, l2: float) -> list[Tensor]:
    """N x E logits of a model per exit fitted on ``train``, on each of ``others``."""
    xs, ys = features(train, kind), agreement(train)
    fits = [fit_logistic(x, y, l2) for x, y in zip(xs, ys)]
    return [torch.stack([_score(f, x) for f, x in zip(fits, features(o, kind))], 1) for o in others]


def cross_fitted(dev: Pass, test: Pass, kind: str, l2: float, folds: int = 5) -> list[Tensor]:
    """Out-of-fold N x E logits on ``dev`` and those of the model fitted on all of dev on
    ``test``."""
    xs, ys = features(dev, kind), agreement(dev)
    fold_of = fold_ids(len(dev.targets), folds)
    out = torch.empty(len(dev.targets), len(xs), dtype=torch.float64)
    for k in range(folds):
        held = fold_of.eq(k)
        for e, (x, y) in enumerate(zip(xs, ys)):
            out[held, e] = _score(fit_logistic(x[~held], y[~held], l2), x[held])
    return [out, fitted_scores(dev, [test], kind, l2)[0]]


def leave(p: Pass, scores: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Exit layer and prediction of every row: the first exit whose score is ``>= threshold``."""
    n, scores = len(p.targets), scores.float()  # as best_threshold compares them
    layer = torch.full((n,), p.layers[-1])
    pred = p.logits[-1].argmax(dim=-1).clone()
    left = torch.zeros(n, dtype=torch.bool)
    for e in range(scores.size(1)):
        go = ~left & scores[:, e].ge(threshold)
        layer[go], pred[go] = p.layers[e], p.logits[e].argmax(dim=-1)[go]
        left |= go
    return layer, pred


def choose(dev: Pass, scores: Tensor, drop: float) -> float:
    """The cheapest threshold on ``scores`` that changes at most ``drop`` percent of the final
    exit's predictions on ``dev``."""
    final = dev.logits[-1].argmax(dim=-1)
    changed = torch.stack([x.argmax(dim=-1).ne(final) for x in dev.logits], 1).numpy()
    budget = drop * len(dev.targets) / 100.0
    cut = best_threshold(scores.float().numpy(), exit_costs(dev.layers, 0.0), changed, budget)
    return cut.high


def report(test: Pass, scores: Tensor, threshold: float) -> dict[str, float]:
    """Accuracy (and its change from full depth), changed predictions and layer speed-up."""
    layer, pred = leave(test, scores, threshold)
    final = test.logits[-1].argmax(dim=-1)
    full = 100.0 * float(final.eq(test.targets).double().mean())
    accuracy = 100.0 * float(pred.eq(test.targets).double().mean())
    return {
        "accuracy": accuracy,
        "drop": accuracy - full,
        "changed": 100.0 * float(pred.ne(final).double().mean()),
        "speedup": test.layers[-1] / float(layer.double().mean()),
    }


def oracle_speedup(p: Pass) -> float:
    """Layer-count speed-up of leaving at the earliest exit that agrees with the final one."""
    layers, _ = oracle_exits(list(zip(p.layers, p.logits)), None)
    return p.layers[-1] / float(layers.double().mean())


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("checkpoint")
    parser.add_argument("data")
    parser.add_argument("--train", default="train", help="split to fit on (the model saw it)")
    parser.add_argument("--dev", default="valid", help="split to choose the threshold on")
    parser.add_argument("--test", default="test", help="split to report on")
    parser.add_argument("--drops", type=_floats, default=[0.5, 1.0, 2.0], help="targets D, %%")
    parser.add_argument("--l2", type=_floats, default=[0.01, 0.1], help="L2 penalties")
    parser.add_argument("--max-examples", type=int, help="first N examples of each split")
    args = parser.parse_args(argv)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    loaded = load_for_inference(args.checkpoint, args.data, "cpu", multi_exit=True)
    model, task = loaded.model, loaded.task
    passes = {
        name: exit_pass(model, load_batches(task, split, 64, args.max_examples))
        for name, split in (("train", args.train), ("dev", args.dev), ("test", args.test))
    }
    dev, test = passes["dev"], passes["test"]
    print(
        f"# learned exit decision on logits or hidden features: fitted on {args.train} or "
        f"cross-fitted on {args.dev}, threshold chosen on {args.dev}, reported on "
        f"{args.test} ({len(test.targets)} rows); oracle-final {oracle_speedup(test):.2f}x\n"
    )
    print("| features | fitted on | L2 | D (on dev) | test accuracy | change | changed % | "
          "layer speed-up |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for kind in KINDS:
        for fit_on in (args.train, f"{args.dev}, cross-fitted"):
            for l2 in args.l2:
                if fit_on == args.train:
                    on_dev, on_test = fitted_scores(passes["train"], [dev, test], kind, l2)
                else:
                    on_dev, on_test = cross_fitted(dev, test, kind, l2)
                for drop in args.drops:
                    r = report(test, on_test, choose(dev, on_dev, drop))
                    print(
                        f"| {kind} | {fit_on} | {l2:g} | {drop:g} | {r['accuracy']:.2f} | "
                        f"{r['drop']:+.2f} | {r['changed']:.2f} | {r['speedup']:.2f}x |"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
