"""Exit policies chosen on dev, reported on test: one threshold vs one per exit vs the oracle.

From one pass over every exit on the dev split (``--dev``, default ``valid``) and one on the
test split (``--test``), for each accuracy-drop target (``--drops``, points below the full
model *on dev*), each policy family is calibrated on dev and then run, unchanged, on test:

* ``entropy`` / ``maxprob``: today's single threshold at every exit, the best on dev (every
  distinct cut tried: ``early_exit.calibrate.best_single_threshold``);
* ``patience``: PABEE's patience, the fastest on dev within the target;
* ``per-exit entropy`` / ``per-exit maxprob``: one threshold per exit
  (``early_exit.calibrate.calibrate_per_exit``); ``+ patience P``: with PABEE's patience beside
  the thresholds ("patience or confidence");
* ``..., agreement``: the same searches constrained by the share of dev rows whose prediction
  changes from the full model's (at most the target, in percent) instead of the dev accuracy;
* ``risk-controlled``: the most aggressive single entropy threshold of a fixed grid whose
  disagreement with the full model is certified at most the target with probability
  ``1 - --delta`` (``early_exit.risk_control``; Learn-then-Test's fixed-sequence testing with
  exact binomial tails, as CALM does for consistency); ``risk-controlled per-exit``: per-exit
  thresholds calibrated on one half of dev at growing targets, certified on the other half;
* ``learned`` / ``learned, agreement``: the learned decision (``early_exit.learned``: a
  logistic model on each exit's confidence and agreement with the previous exits), fitted on
  dev by cross-fitting, its threshold calibrated on the out-of-fold scores; ``risk-controlled
  learned``: fitted on one half of dev, certified on the other;
* ``oracle-final``: the earliest exit that agrees with the final exit (computed on each split:
  a bound, not a policy).

Columns: accuracy and mean exit layer on dev and test, the test accuracy minus the full model's
test accuracy, and the layer-count speed-up on test (``L / mean exit layer``). With
``--head-cost C`` (an exit head's time in layers, e.g. 0.1 at batch 1) the per-exit search also
drops exits that do not pay for their head, and ``cost`` adds C per head evaluated.

    python -m benchmarks.exit_policies_on_dev CKPT DATA --drops 0.5,1 [--dtype bf16]
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.data.splits import load_batches
from acl_fairseq.early_exit.calibrate import (
    best_patience,
    best_single_threshold,
    calibrate,
    calibrate_per_exit,
    evaluate,
)
from acl_fairseq.early_exit.policies import ExitPolicy
from acl_fairseq.early_exit.risk_control import (
    risk_controlled_learned,
    risk_controlled_per_exit,
    risk_controlled_single,
)
from acl_fairseq.early_exit.thresholds import TargetError, collect_exits, oracle_exits
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD as HEAD
from acl_fairseq.runtime.precision import PRECISIONS
from benchmarks.common import checkpoint_parser


def policies_on_dev(
    dev: Any, dev_targets, drop: float, head_cost: float, patiences: Sequence[int], delta: float
) -> list[tuple[str, ExitPolicy | None]]:
    """``[(family, policy chosen on dev or None when unreachable)]`` for one target."""

    def single(kind: str, constraint: str = "accuracy") -> ExitPolicy:
        return best_single_threshold(dev, dev_targets, drop, kind, head_cost, constraint).policy

    def per_exit(kind: str, patience: int | None, constraint: str = "accuracy"):
        try:
            return calibrate_per_exit(
                dev, dev_targets, drop, kind, patience, head_cost, constraint=constraint
            ).policy
        except TargetError:  # patience alone loses more than the drop
            return None

    chosen = [
        ("entropy", single("entropy")),
        ("maxprob", single("maxprob")),
        ("patience", best_patience(dev, dev_targets, drop, head_cost).policy),
        (
            "patience, agreement",
            best_patience(dev, dev_targets, drop, head_cost, "agreement").policy,
        ),
        ("per-exit entropy", per_exit("entropy", None)),
        ("per-exit maxprob", per_exit("maxprob", None)),
    ]
    chosen += [(f"per-exit entropy + patience {p}", per_exit("entropy", p)) for p in patiences]
    chosen += [(f"per-exit entropy + patience {p}, agreement", per_exit("entropy", p, "agreement"))
               for p in patiences]  # fmt: skip
    chosen += [
        ("entropy, agreement", single("entropy", "agreement")),
        ("per-exit entropy, agreement", per_exit("entropy", None, "agreement")),
        ("per-exit maxprob, agreement", per_exit("maxprob", None, "agreement")),
    ]
    chosen += [
        ("learned", calibrate("learned", dev, dev_targets, drop, "accuracy", head_cost).policy),
        (
            "learned, agreement",
            calibrate("learned", dev, dev_targets, drop, "agreement", head_cost).policy,
        ),
    ]
    risk = risk_controlled_single(dev, drop / 100.0, delta, "entropy")
    chosen.append((f"risk-controlled entropy (delta {delta:g})", risk.policy))
    halves = risk_controlled_per_exit(
        dev, drop / 100.0, delta, drops=tuple(0.5 * i for i in range(11))
    )
    chosen.append(
        (f"risk-controlled per-exit entropy (delta {delta:g}, dev halves)", halves.policy)
    )
    learned = risk_controlled_learned(dev, drop / 100.0, delta)
    chosen.append((f"risk-controlled learned (delta {delta:g}, dev halves)", learned.policy))
    return chosen


def _cells(values: Sequence[Any]) -> str:
    return "| " + " | ".join(str(v) for v in values) + " |"


def table(
    dev, dev_targets, test, test_targets, drops: Sequence[float], head_cost: float,
    patiences: Sequence[int], delta: float,
) -> list[str]:  # fmt: skip
    """Markdown lines of the table."""
    num_layers = test[-1][0]
    full_dev = 100.0 * float(dev[-1][1].argmax(-1).eq(dev_targets).double().mean())
    full_test = 100.0 * float(test[-1][1].argmax(-1).eq(test_targets).double().mean())
    lines = [
        _cells(
            [
                "target drop (dev)",
                "policy (chosen on dev)",
                "dev accuracy",
                "dev mean exit layer",
                "test accuracy",
                "test drop",
                "test mean exit layer",
                "test layer speed-up",
                "test cost",
            ]
        ),  # fmt: skip
        "|---|---|---|---|---|---|---|---|---|",
        _cells(
            [
                "-",
                "full depth",
                f"{full_dev:.2f}",
                f"{num_layers:.2f}",
                f"{full_test:.2f}",
                "+0.00",
                f"{num_layers:.2f}",
                "1.00",
                f"{num_layers:.2f}",
            ]
        ),  # fmt: skip
    ]
    dev_layers, dev_preds = oracle_exits(dev)
    test_layers, test_preds = oracle_exits(test)
    dev_layer, test_layer = float(dev_layers.double().mean()), float(test_layers.double().mean())
    lines.append(
        _cells(
            [
                "-",
                "oracle-final (on each split: a bound)",
                f"{100.0 * float(dev_preds.eq(dev_targets).double().mean()):.2f}",
                f"{dev_layer:.2f}",
                f"{100.0 * float(test_preds.eq(test_targets).double().mean()):.2f}",
                "+0.00",
                f"{test_layer:.2f}",
                f"{num_layers / test_layer:.2f}",
                "-",
            ]
        )  # fmt: skip
    )
    for drop in drops:
        for family, policy in policies_on_dev(dev, dev_targets, drop, head_cost, patiences, delta):
            if policy is None:
                lines.append(_cells([f"{drop:g}", f"{family}: not reachable on dev"] + [""] * 7))
                continue
            on_dev = evaluate(dev, dev_targets, policy, head_cost)
            on_test = evaluate(test, test_targets, policy, head_cost)
            lines.append(
                _cells(
                    [
                        f"{drop:g}",
                        f"{family}: `{policy.spec}`",
                        f"{on_dev.accuracy:.2f}",
                        f"{on_dev.mean_exit_layer:.2f}",
                        f"{on_test.accuracy:.2f}",
                        f"{on_test.accuracy - full_test:+.2f}",
                        f"{on_test.mean_exit_layer:.2f}",
                        f"{on_test.layer_speedup:.2f}",
                        f"{on_test.cost:.2f}",
                    ]
                )  # fmt: skip
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = checkpoint_parser(__doc__, "split the policies are chosen on", "split they are reported on")
    p.add_argument("--drops", default="0.5,1", help="accuracy-drop targets in points, on dev")
    p.add_argument("--dtype", choices=PRECISIONS, default="fp32", help="inference precision")
    p.add_argument("--head-cost", type=float, default=0.0, help="an exit head's cost in layers")
    p.add_argument("--patience", default="1,2", help="patience values beside per-exit entropy")
    p.add_argument("--delta", type=float, default=0.1, help="risk control: 1 - confidence")
    p.add_argument("--max-examples", type=int, help="cap each split")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    args = p.parse_args(argv)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_for_inference(
        args.checkpoint, args.data, "cpu", multi_exit=True, dtype=args.dtype
    )
    model, task = loaded.model, loaded.task
    splits = {}
    for split in (args.dev, args.test):
        batches = load_batches(task, split, args.batch_size, args.max_examples)
        splits[split] = collect_exits(model, batches, HEAD)
    drops = [float(v) for v in args.drops.split(",") if v.strip()]
    patiences = [int(v) for v in args.patience.split(",") if v.strip()]
    dev, dev_t = splits[args.dev]
    test, test_t = splits[args.test]
    print(
        f"# exit policies chosen on {args.dev} ({dev_t.numel()} examples), reported on "
        f"{args.test} ({test_t.numel()}); {args.checkpoint}; --dtype {args.dtype}; "
        f"exits at {', '.join(str(layer) for layer, _ in test)}; head cost {args.head_cost:g} "
        "layers\n"
    )
    for line in table(dev, dev_t, test, test_t, drops, args.head_cost, patiences, args.delta):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
