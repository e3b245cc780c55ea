"""Early-exit sweep: accuracy and speed of a multi-exit checkpoint over exit thresholds.

For one policy kind (``entropy``, ``maxprob`` or ``patience``) and every batch size and
threshold, the table gives the accuracy, the mean exit layer, the layer-count speed-up
``num_layers / mean exit layer`` (the ideal), the measured wall-clock speed-up (time of the
full-depth forward / time of ``early_exit`` over the same batches, in the same process) and the
fraction of the ideal that the measurement achieves. A first row per batch size is the full
model (no early exit); the accuracy of every exit (one ``exit_outputs`` pass, the layer-score
curve) is printed once.

Timing: one untimed warm-up pass per configuration, then ``--repeats`` interleaved rounds,
medians (``acl_fairseq.early_exit.measure``). ``torch.set_num_threads`` is left as it is.

Usage::

    acl-fairseq-sweep CHECKPOINT DATA --policy entropy --out sweep.tsv
    acl-fairseq-sweep --checkpoint CHECKPOINT --data DATA --split test
    acl-fairseq-sweep CHECKPOINT DATA --policy patience --thresholds 0,1,2,3 \\
        --batch-sizes 1,8,32 --max-examples 500 --cpu

``DATA`` is the binarized ``sentence_prediction`` directory (``DATA/{input0,input1,label}``).

The whole curve: ``--thresholds quantiles[:N]`` (N = 10 by default) takes N thresholds from the
exits' confidences on the split (one ``exit_outputs`` pass), spaced so that their mean exit
layers are evenly spread from full depth to the first exit
(``acl_fairseq.early_exit.thresholds.quantile_thresholds``); without ``--thresholds`` the
policy's default grid is swept. Two rows bound any policy, from the same pass and with
no timing: ``oracle-final`` (every sentence leaves at the earliest exit that agrees with the
final exit: the full model's accuracy at the smallest mean exit layer) and ``oracle-gold`` (the
earliest exit that is right: an upper bound on the accuracy).

Deploying: ``--max-accuracy-drop D`` (the fastest threshold at most D points below the full
model on the split) or ``--target-speedup S`` (the most accurate threshold with a layer-count
speed-up of at least S) writes the chosen policy to ``early_exit_policy.json`` next to the
checkpoint (``acl_fairseq.early_exit.saved_policy``), which ``acl-fairseq-predict`` and the hub's
``predict_early_exit`` use when no policy is given::

    acl-fairseq-sweep CKPT DATA --thresholds quantiles:20 --max-accuracy-drop 1

``--out`` gets a TSV (or a CSV if the name ends in ``.csv``); Markdown goes to stdout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from acl_fairseq.checkpoint.inference import CheckpointError, load_for_inference
from acl_fairseq.cli.sweep.checks import check_thresholds, int_list, threshold_spec
from acl_fairseq.data.splits import check_split, load_batches
from acl_fairseq.early_exit.measure import sweep
from acl_fairseq.early_exit.policies import POLICIES
from acl_fairseq.early_exit.table import format_layer_scores, format_markdown, write_table
from acl_fairseq.early_exit.thresholds import (
    Quantiles,
    TargetError,
    choose_and_save,
    collect_exits,
    exit_accuracies,
    oracle_rows,
    sweep_thresholds,
)
from acl_fairseq.models.heads import DEFAULT_HEAD


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="acl-fairseq-sweep",
        description="Accuracy and speed of early exit over a threshold grid.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "checkpoint", nargs="?", help="multi-exit fairseq checkpoint (or --checkpoint)"
    )
    parser.add_argument("data", nargs="?", help="binarized sentence_prediction dir (or --data)")
    parser.add_argument(
        "--checkpoint", dest="checkpoint_opt", metavar="CHECKPOINT", help="same as CHECKPOINT"
    )
    parser.add_argument("--data", dest="data_opt", metavar="DATA", help="same as DATA")
    parser.add_argument("--split", default="valid", help="data split to evaluate")
    parser.add_argument("--policy", choices=list(POLICIES), default="entropy", help="policy kind")
    parser.add_argument(
        "--thresholds",
        type=threshold_spec,
        help="comma-separated thresholds ('inf' is accepted), or quantiles[:N]: N thresholds "
        "from the exits' confidences on the split, evenly spread over the mean exit layer "
        "(default: a fixed grid per policy)",
    )
    target = parser.add_argument_group("choose a threshold to deploy (written next to CHECKPOINT)")
    target.add_argument(
        "--max-accuracy-drop",
        type=float,
        metavar="D",
        help="the fastest threshold at most D accuracy points below the full model on --split",
    )
    target.add_argument(
        "--target-speedup",
        type=float,
        metavar="S",
        help="the most accurate threshold with a layer-count speed-up of at least S",
    )
    parser.add_argument(
        "--batch-sizes", type=int_list, default=[1, 32], help="comma-separated batch sizes"
    )
    parser.add_argument("--max-examples", type=int, help="use only the first N examples")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--head", help="classification head (default: the task's)")
    parser.add_argument("--out", type=Path, help="write the table here (TSV; CSV if *.csv)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if CUDA is available")
    return parser


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    return f"CPU, {torch.get_num_threads()} threads"


def _progress(message: str) -> None:
    print(f"[acl-fairseq-sweep] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("checkpoint", "data"):
        positional, option = getattr(args, name), getattr(args, f"{name}_opt")
        if positional and option and positional != option:
            parser.error(f"{name} given twice: {positional} and --{name} {option}")
        if not (positional or option):
            parser.error(f"{name.upper()} is required (positional or --{name})")
        setattr(args, name, positional or option)
    if args.max_accuracy_drop is not None and args.target_speedup is not None:
        parser.error("give one of --max-accuracy-drop and --target-speedup, not both")
    if args.max_accuracy_drop is not None and not args.max_accuracy_drop >= 0:
        parser.error(f"--max-accuracy-drop must be >= 0 points, got {args.max_accuracy_drop}")
    if args.target_speedup is not None and not args.target_speedup >= 1:
        parser.error(f"--target-speedup must be >= 1 (layer-count), got {args.target_speedup}")
    try:
        if args.thresholds is not None and not isinstance(args.thresholds, Quantiles):
            check_thresholds(args.policy, args.thresholds)
        check_split(args.data, args.split)
    except ValueError as e:
        parser.error(str(e))
    if not Path(args.checkpoint).is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if use_cuda else "cpu")
    try:
        model, task, _ = load_for_inference(args.checkpoint, args.data, device, multi_exit=True)
    except CheckpointError as e:
        print(f"acl-fairseq-sweep: error: {e}", file=sys.stderr)
        return 2
    head = args.head or getattr(task.cfg, "classification_head_name", None) or DEFAULT_HEAD
    num_classes = int(model.classification_heads[head].out_proj.out_features)
    from fairseq import utils

    max_positions = utils.resolve_max_positions(task.max_positions(), model.max_positions())
    rows: list[dict[str, Any]] = []
    scores: dict[int, float] | None = None
    for batch_size in args.batch_sizes:
        batches = load_batches(
            task, args.split, batch_size, args.max_examples, device, max_positions
        )
        if scores is None:  # one pass over every exit: scores, quantiles, oracle
            exit_logits, targets = collect_exits(model, batches, head)
            scores = exit_accuracies(exit_logits, targets)
            thresholds = sweep_thresholds(args.thresholds, args.policy, exit_logits, num_classes)
            oracles = oracle_rows(exit_logits, targets, batch_size)
        rows += sweep(
            model,
            batches,
            args.policy,
            thresholds,
            head,
            args.repeats,
            batch_size=batch_size,
            progress=_progress,
        )

    print(
        f"# early-exit sweep: {Path(args.checkpoint).name}, split {args.split} "
        f"({rows[0]['examples']} examples), policy {args.policy}, {model.num_layers} layers, "
        f"exits at {', '.join(map(str, model.shallow_exit_layers))} + {model.num_layers}\n"
        f"# device: {_machine(device)}; {args.repeats} timed rounds, median\n"
    )
    assert scores is not None
    first = [r for r in rows if r["batch_size"] == args.batch_sizes[0]]
    rows += oracles
    print("Accuracy of every exit (one pass over all exits):\n")
    print(format_layer_scores(scores, model.num_layers) + "\n")
    print(format_markdown(rows))
    if args.out:
        write_table(rows, args.out)
        print(f"\nwrote {args.out}")
    if args.max_accuracy_drop is not None or args.target_speedup is not None:
        try:
            path, row = choose_and_save(
                first, args.checkpoint, args.split, args.max_accuracy_drop, args.target_speedup
            )
        except TargetError as e:
            print(f"acl-fairseq-sweep: error: {e}", file=sys.stderr)
            return 2
        print(
            f"\nchosen: {args.policy} {row['threshold']:g} (accuracy {row['accuracy']:.2f}%, "
            f"layer-count speed-up {row['layer_speedup']:.2f} on {args.split}); wrote {path}: "
            "acl-fairseq-predict and predict_early_exit use it when no policy is given"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
