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
from acl_fairseq.cli.sweep_checks import check_split, check_thresholds
from acl_fairseq.cli.sweep_table import (
    COLUMNS,
    format_layer_scores,
    format_markdown,
    write_table,
)
from acl_fairseq.exit_policies import EntropyPolicy, ExitPolicy, MaxProbPolicy, PatiencePolicy

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

POLICY_KINDS = ("entropy", "maxprob", "patience")
DEFAULT_HEAD = "sentence_classification_head"


# ----------------------------------------------------------------------------- policies


def make_policy(kind: str, threshold: float) -> ExitPolicy:
    """The ``ExitPolicy`` of ``kind`` at ``threshold`` (patience: an integer)."""
    if kind == "entropy":
        return EntropyPolicy(float(threshold))
    if kind == "maxprob":
        return MaxProbPolicy(float(threshold))
    if kind == "patience":
        if float(threshold) != int(threshold):
            raise ValueError(f"patience must be an integer, got {threshold}")
        return PatiencePolicy(int(threshold))
    raise ValueError(f"unknown policy kind {kind!r}: expected one of {POLICY_KINDS}")


def default_thresholds(kind: str, num_classes: int, num_shallow_exits: int) -> list[float]:
    """A grid from 'never exits early' to '(almost) always exits at the first exit'.

    entropy: 0 .. ln(K) in 10 steps; maxprob: 1.0 .. 1/K in 10 steps (for K = 2: 1.0 .. 0.5);
    patience: E .. 0 for E shallow exits (patience E never exits early).
    """
    if kind == "entropy":
        top = math.log(num_classes)
        return [round(top * i / 10, 4) for i in range(11)]
    if kind == "maxprob":
        low = 1.0 / num_classes
        return [round(1.0 - (1.0 - low) * i / 10, 4) for i in range(11)]
    if kind == "patience":
        return [float(p) for p in range(num_shallow_exits, -1, -1)]
    raise ValueError(f"unknown policy kind {kind!r}: expected one of {POLICY_KINDS}")


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


def simulate_exits(
    exit_logits: Sequence[tuple[int, Tensor]], policy: ExitPolicy
) -> tuple[Tensor, Tensor]:
    """Exit layers and predictions that ``early_exit`` gives, from every exit's logits.

    Policies decide row by row, so running them on all rows of a full ``exit_outputs`` pass
    (no row removal) gives the same exits as the batched ``early_exit``; this makes threshold
    searches cheap (one encoder pass for any number of thresholds).

    Args:
        exit_logits: ``[(layer, B x K logits)]`` by layer, the last one the final exit.
    Returns:
        ``(exit_layers B, predictions B)``.
    """
    *shallow, (last_layer, last_logits) = exit_logits
    exit_layers = torch.full_like(last_logits[:, 0], last_layer, dtype=torch.long)
    predictions = last_logits.argmax(dim=-1)
    done = torch.zeros_like(exit_layers, dtype=torch.bool)
    state = policy.init_state(last_logits.size(0), last_logits.device)
    for layer, logits in shallow:
        exit_mask, state = policy.decide(logits, state)
        new = exit_mask & ~done
        exit_layers[new] = layer
        predictions[new] = logits[new].argmax(dim=-1)
        done |= exit_mask
    return exit_layers, predictions


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


def _float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,0.1,inf, got {text!r}") from None


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
        type=_float_list,
        help="comma-separated thresholds (default: a grid per policy; 'inf' is accepted)",
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
    try:
        if args.thresholds is not None:
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
    thresholds = args.thresholds or default_thresholds(
        args.policy, num_classes, len(model.shallow_exit_layers)
    )
    from fairseq import utils

    max_positions = utils.resolve_max_positions(task.max_positions(), model.max_positions())
    rows: list[dict[str, Any]] = []
    scores: dict[int, float] | None = None
    for batch_size in args.batch_sizes:
        batches = load_batches(
            task, args.split, batch_size, args.max_examples, device, max_positions
        )
        if scores is None:
            scores = layer_scores(model, batches, head)
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
    print("Accuracy of every exit (one pass over all exits):\n")
    print(format_layer_scores(scores, model.num_layers) + "\n")
    print(format_markdown(rows))
    if args.out:
        write_table(rows, args.out)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
