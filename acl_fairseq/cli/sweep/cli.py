"""Early-exit sweep: accuracy and speed of a multi-exit checkpoint over exit thresholds.

For one policy kind (``entropy``, ``maxprob`` or ``patience``) and every batch size and
threshold, the table gives the accuracy, the mean exit layer, the layer-count speed-up
``num_layers / mean exit layer`` (the ideal), the measured wall-clock speed-up (time of the
full-depth forward / time of ``early_exit`` over the same batches, in the same process) and the
fraction of the ideal that the measurement achieves. A first row per batch size is the full
model (no early exit); the accuracy of every exit (one ``exit_outputs`` pass, the layer-score
curve) is printed once.

Timing: one untimed warm-up pass per configuration (it also yields the accuracy and exit
layers), then ``--repeats`` rounds; each round times the full forward and every threshold over
all batches, in alternating order, so machine noise hits them alike. The wall-clock speed-up is
the median over rounds of the per-round ratio. ``torch.set_num_threads`` is left as it is.

Usage::

    acl-fairseq-sweep CHECKPOINT DATA --policy entropy --out sweep.tsv
    acl-fairseq-sweep --checkpoint CHECKPOINT --data DATA --split test
    acl-fairseq-sweep CHECKPOINT DATA --policy patience --thresholds 0,1,2,3 \\
        --batch-sizes 1,8,32 --max-examples 500 --cpu

``DATA`` is the binarized ``sentence_prediction`` directory (``DATA/{input0,input1,label}``).

The whole curve: ``--thresholds quantiles[:N]`` (N = 10 by default) takes N thresholds from the
exits' confidences on the split (one ``exit_outputs`` pass), spaced so that their mean exit
layers are evenly spread from full depth to the first exit
(``acl_fairseq.early_exit.thresholds.quantile_thresholds``); without ``--thresholds`` the fixed
grid of ``default_thresholds`` is swept. Two rows bound any policy, from the same pass and with
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
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import acl_fairseq  # noqa: F401  (registers the plugin; safe checkpoint loading)
from acl_fairseq.cli.sweep.checks import check_split, check_thresholds
from acl_fairseq.cli.sweep.curve import (
    POLICY_KINDS,
    Quantiles,
    choose_and_save,
    collect_exits,
    default_thresholds,
    exit_accuracies,
    make_policy,
    oracle_rows,
    sweep_thresholds,
    threshold_spec,
)
from acl_fairseq.early_exit.policies import ExitPolicy
from acl_fairseq.early_exit.table import (
    COLUMNS,
    format_layer_scores,
    format_markdown,
    write_table,
)
from acl_fairseq.early_exit.thresholds import TargetError, simulate_exits

__all__ = [
    "COLUMNS",
    "Batch",
    "POLICY_KINDS",
    "default_thresholds",
    "format_markdown",
    "layer_scores",
    "load_batches",
    "load_checkpoint",
    "main",
    "make_policy",
    "simulate_exits",
    "sweep",
    "write_table",
]

Batch = tuple[Tensor, Tensor]
"""``(src_tokens B x T, target B)`` on the model's device."""

DEFAULT_HEAD = "sentence_classification_head"


# ----------------------------------------------------------------------------- loading


def load_checkpoint(
    path: str | Path,
    data: str | Path,
    device: torch.device | str = "cpu",
    multi_exit: bool = True,
    state: dict[str, Any] | None = None,
):
    """``(model, task)`` of a fairseq checkpoint, in eval mode on ``device``.

    Args:
        multi_exit: stop unless the model has ``early_exit`` (a multi-exit model).
        state: the checkpoint already read (``checkpoint_utils.load_checkpoint_to_cpu``).
    """
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import overwrite_args_by_name

    overrides = {"data": str(data)}
    if state is not None:  # fairseq applies arg_overrides only to a state it reads itself
        overwrite_args_by_name(state["cfg"], overrides)
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(path)], arg_overrides=overrides, state=state
    )
    model = models[0]
    if multi_exit and not hasattr(model, "early_exit"):
        raise SystemExit(
            f"{path} holds a {type(model).__name__}, not a multi-exit model "
            "(train it with --arch multi_exit_roberta*)"
        )
    return model.to(device).eval(), task


def load_batches(
    task: Any,
    split: str,
    batch_size: int,
    max_examples: int | None = None,
    device: torch.device | str = "cpu",
    max_positions: Any = None,
) -> list[Batch]:
    """The first ``max_examples`` examples of ``split`` in fixed order, ``batch_size`` per batch.

    Uses the task's dataset and ``task.get_batch_iterator`` (no shuffling), so every batch size
    sees the same examples in the same order. Examples longer than ``max_positions`` are
    skipped.
    """
    if split not in task.datasets:
        task.load_dataset(split)
    dataset = task.dataset(split)
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_sentences=batch_size,
        max_positions=max_positions,
        ignore_invalid_inputs=True,
        seed=1,
        num_workers=0,
    ).next_epoch_itr(shuffle=False)
    pad = task.source_dictionary.pad()
    batches: list[Batch] = []
    remaining = math.inf if max_examples is None else max_examples
    for sample in itr:
        if remaining <= 0:
            break
        tokens = sample["net_input"]["src_tokens"]
        target = sample["target"].view(-1)
        if tokens.size(0) > remaining:
            keep = int(remaining)
            tokens, target = tokens[:keep], target[:keep]
            width = int(tokens.ne(pad).sum(dim=1).max())
            tokens = tokens[:, :width]
        remaining -= tokens.size(0)
        batches.append((tokens.to(device), target.to(device)))
    if not batches:
        raise ValueError(f"split {split!r} has no examples")
    return batches


# ----------------------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _full_pass(model: Any, batches: Sequence[Batch], head: str) -> list[Tensor]:
    """Predictions of the final exit (plain full-depth forward) for every batch."""
    return [model(tokens, classification_head_name=head)[0].argmax(dim=-1) for tokens, _ in batches]


def _early_pass(model: Any, batches: Sequence[Batch], policy: ExitPolicy, head: str) -> list:
    return [
        model.early_exit(tokens, policy, classification_head_name=head) for tokens, _ in batches
    ]


def layer_scores(
    model: Any, batches: Sequence[Batch], head: str = DEFAULT_HEAD
) -> dict[int, float]:
    """Accuracy (%) of every exit, ``{layer: accuracy}``, from one ``exit_outputs`` pass."""
    correct: dict[int, int] = {}
    total = 0
    with torch.no_grad():
        for tokens, target in batches:
            for out in model.exit_outputs(tokens, classification_head_name=head):
                hits = int(out.logits.argmax(dim=-1).eq(target).sum())
                correct[out.layer] = correct.get(out.layer, 0) + hits
            total += target.numel()
    return {layer: 100.0 * n / total for layer, n in sorted(correct.items())}


def sweep(
    model: Any,
    batches: Sequence[Batch],
    policy_kind: str,
    thresholds: Sequence[float],
    head: str = DEFAULT_HEAD,
    repeats: int = 3,
    batch_size: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Accuracy, exit layers and speed of ``early_exit`` at every threshold, on ``batches``.

    Args:
        model: a ``MultiExitRobertaModel`` (or anything with ``num_layers``, ``early_exit``
            and ``__call__(tokens, classification_head_name=...)``), in eval mode.
        batches: ``(src_tokens, target)`` pairs on the model's device.
        policy_kind: ``entropy``, ``maxprob`` or ``patience``.
        thresholds: one table row each.
        repeats: timed rounds (after one untimed warm-up pass per configuration).
        batch_size: label of the rows (default: the size of the first batch).
        progress: called with one line per configuration and per timed round.
    Returns:
        one dict per row (keys ``COLUMNS``): first the full model (``policy="none"``), then one
        per threshold in the given order. ``accuracy`` is in percent, ``full_ms`` / ``early_ms``
        are median milliseconds per example.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    policies = [make_policy(policy_kind, t) for t in thresholds]
    num_layers = int(model.num_layers)
    device = batches[0][0].device
    examples = sum(int(target.numel()) for _, target in batches)
    batch_size = batch_size or int(batches[0][0].size(0))
    targets = [target for _, target in batches]
    start = time.perf_counter()

    def report(message: str) -> None:
        if progress is not None:
            progress(f"batch {batch_size}: {message} [{time.perf_counter() - start:.0f} s]")

    def full() -> Any:
        return _full_pass(model, batches, head)

    def runner(policy: ExitPolicy) -> Callable[[], Any]:
        return lambda: _early_pass(model, batches, policy, head)

    with torch.no_grad():
        # warm-up: also the statistics (predictions do not depend on timing)
        full_correct = sum(int(p.eq(t).sum()) for p, t in zip(full(), targets))
        report(f"full depth: accuracy {100.0 * full_correct / examples:.1f}%")
        stats = []
        for number, (threshold, policy) in enumerate(zip(thresholds, policies), start=1):
            results = runner(policy)()
            correct = sum(int(r.predictions.eq(t).sum()) for r, t in zip(results, targets))
            layers = torch.cat([r.exit_layers for r in results]).cpu()
            share = {
                int(layer): float(n) / examples
                for layer, n in zip(*torch.unique(layers, return_counts=True))
            }
            stats.append((correct, float(layers.float().mean()), share))
            report(
                f"{policy_kind} {threshold:g} ({number}/{len(policies)}): accuracy "
                f"{100.0 * correct / examples:.1f}%, mean exit layer {stats[-1][1]:.2f}"
            )

        # timed rounds, full forward and thresholds interleaved, order alternating
        jobs = [full] + [runner(p) for p in policies]
        times: list[list[float]] = [[] for _ in jobs]
        for round_idx in range(repeats):
            order = range(len(jobs)) if round_idx % 2 == 0 else reversed(range(len(jobs)))
            for j in order:
                times[j].append(_timed(jobs[j], device))
            report(f"timed round {round_idx + 1}/{repeats}")

    def per_example_ms(seconds: list[float]) -> float:
        return 1000.0 * statistics.median(seconds) / examples

    full_ms = per_example_ms(times[0])
    rows = [
        {
            "batch_size": batch_size,
            "policy": "none",
            "threshold": None,
            "examples": examples,
            "accuracy": 100.0 * full_correct / examples,
            "mean_exit_layer": float(num_layers),
            "layer_speedup": 1.0,
            "full_ms": full_ms,
            "early_ms": full_ms,
            "wall_speedup": 1.0,
            "fraction_of_ideal": 1.0,
            "exit_share": {num_layers: 1.0},
        }
    ]
    for threshold, (correct, mean_layer, share), t in zip(thresholds, stats, times[1:]):
        layer_speedup = num_layers / mean_layer
        wall = statistics.median(f / e for f, e in zip(times[0], t))
        rows.append(
            {
                "batch_size": batch_size,
                "policy": policy_kind,
                "threshold": threshold,
                "examples": examples,
                "accuracy": 100.0 * correct / examples,
                "mean_exit_layer": mean_layer,
                "layer_speedup": layer_speedup,
                "full_ms": full_ms,
                "early_ms": per_example_ms(t),
                "wall_speedup": wall,
                "fraction_of_ideal": wall / layer_speedup,
                "exit_share": share,
            }
        )
    return rows


# ----------------------------------------------------------------------------- command line


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,32, got {text!r}")
    return values


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
    parser.add_argument("--policy", choices=POLICY_KINDS, default="entropy", help="policy kind")
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
        "--batch-sizes", type=_int_list, default=[1, 32], help="comma-separated batch sizes"
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
    model, task = load_checkpoint(args.checkpoint, args.data, device)
    head = args.head or getattr(task.cfg, "classification_head_name", None) or DEFAULT_HEAD
    num_classes = int(model.classification_heads[head].out_proj.out_features)
    default = default_thresholds(args.policy, num_classes, len(model.shallow_exit_layers))
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
            thresholds = sweep_thresholds(args.thresholds, args.policy, exit_logits, default)
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
