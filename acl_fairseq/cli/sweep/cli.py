"""Early-exit sweep: accuracy and speed of a multi-exit checkpoint over exit policies, per
precision, and the policy to deploy.

For one policy kind and every precision (``--dtypes``), batch size and policy, the table gives
the accuracy, the agreement with the full model's predictions, the mean exit layer, the
layer-count speed-up ``num_layers / mean exit layer`` (the ideal), the measured wall-clock
speed-up (time of the full-depth forward / time of ``early_exit`` over the same batches, same
process, same precision) and the fraction of the ideal that the measurement achieves. A first
row per precision and batch size is the full model. Per precision, the accuracy of every exit
is printed once, and each precision's full-depth accuracy and agreement with fp32.

One ``exit_outputs`` pass per precision and batch size gives the accuracy and exit layers of
every policy (simulated: the loop's decisions); only the timing runs the early-exit loop:
``--repeats`` interleaved rounds after an untimed warm-up, medians; the times exclude the
warm-up (``acl_fairseq.inference.measure``); ``--repeats 0`` skips timing. Every precision and
backend is timed in the same rounds (each keeps its model until then), so their times compare
with each other, not only with their own full depth. ``torch.set_num_threads`` is left as it
is.

Policies: ``entropy``, ``maxprob`` (``--thresholds``, default a fixed grid; ``quantiles[:N]``:
N thresholds whose mean exit layers spread evenly from full depth to the first exit),
``patience``, and the per-exit kinds ``per_exit_entropy`` / ``per_exit_maxprob`` (a threshold
per exit, exits that do not pay for their head skipped; their rows are the policies calibrated
on the split at each ``--drops`` target), and ``learned`` (a logistic model on the exits'
confidence and agreement predicts whether an exit agrees with the final one; fitted to the split
by cross-fitting, its threshold calibrated like the per-exit kinds'). Two rows bound any
policy, with no timing:
``oracle-final`` (the earliest exit that agrees with the final exit) and ``oracle-gold`` (the
earliest exit that is right).

Deploying: ``--max-accuracy-drop D`` chooses, per precision, the fastest policy of the kind
that changes at most D percent of the full model's predictions on ``--split`` (``--constraint
agreement``, the default: it bounds the accuracy drop by D too). ``--constraint accuracy``
(within D points of the full model's accuracy on the split) over-fits a small dev split: its
drop on test is a multiple of D (docs/results.md, "Exit policies chosen on dev").
``--risk-control DELTA`` certifies that at most D percent of the predictions change, with
probability 1 - DELTA (Learn-then-Test; conservative).
``--target-speedup S``: the most accurate swept row with a layer-count speed-up of at least S.
A policy is not deployed when it would be slower than full depth: by its cost in layers with
``--head-cost`` per exit evaluated, or as timed at the first batch size (with ``--repeats``
above 0).
The choice is written to ``early_exit_policy.json`` next to the checkpoint, every precision's
under ``by_dtype``, the first of ``--dtypes`` as the default that ``acl-fairseq-predict``
(``--dtype`` defaults to it) and the hub's ``predict_early_exit`` use, with the fingerprint of
the checkpoint's weights: another checkpoint in that folder (``checkpoint_last.pt``, one
retrained after the sweep, a copied one) runs at full depth instead, saying why::

    acl-fairseq-sweep CKPT DATA --dtypes int8,fp32 --max-accuracy-drop 1
    acl-fairseq-predict CKPT --input sentences.txt   # int8 + the policy chosen for int8

``--backend onnxruntime`` measures and chooses on the ONNX Runtime backend's segments
(``acl_fairseq.runtime.onnx_runtime``; fp32 / int8, CPU) from their own exits' logits, and
records the backend in the file, so that ``acl-fairseq-predict`` runs the policy there by
default; give ``--head-cost`` the segments' cost (``benchmarks/exit_cost_batch1.py --dtypes
int8,ort``), so that the per-exit kinds leave out the exits that do not pay::

    acl-fairseq-sweep CKPT DATA --backend onnxruntime --dtypes int8 --policy per_exit_entropy \
        --max-accuracy-drop 1 --head-cost C --cpu
    acl-fairseq-predict CKPT --input sentences.txt   # ONNX Runtime int8 + that policy

``--backend fairseq,onnxruntime`` sweeps each precision on both (bf16 on fairseq only) and
saves it with the backend whose chosen policy ran faster per row at the first batch size
(``timed_backends`` in its entry: both times); predict runs each precision on its own.

``DATA`` is the binarized ``sentence_prediction`` directory; ``--out`` gets a TSV (a CSV if
the name ends in ``.csv``); Markdown goes to stdout.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from acl_fairseq.atomic_write import check_writable
from acl_fairseq.cli import HelpFormatter
from acl_fairseq.cli.sweep.checks import (
    DEFAULT_DROPS,
    backend_list,
    check_flags,
    dtype_list,
    float_list,
    head_cost_spec,
    int_list,
    threshold_spec,
)
from acl_fairseq.cli.sweep.precision import Precision, calibrate, fastest, finish, time_all
from acl_fairseq.data.splits import check_split, load_batches
from acl_fairseq.early_exit.calibrate import CONSTRAINTS
from acl_fairseq.early_exit.policies import POLICIES
from acl_fairseq.early_exit.table import format_markdown, write_table
from acl_fairseq.early_exit.thresholds import TargetError
from acl_fairseq.errors import run_tool
from acl_fairseq.inference import deploy
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.inference.saved_policy import FINGERPRINT, policy_path, read_policy
from acl_fairseq.models.heads import DEFAULT_HEAD
from acl_fairseq.runtime.onnx_runtime import (
    BACKENDS,
    ONNX_CACHE,
    ORT_DTYPES,
    OrtEarlyExit,
    require_onnxruntime,
)
from acl_fairseq.runtime.precision import prepare_for_inference

PROG = "acl-fairseq-sweep"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
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
        "(default: a fixed grid per policy; not for the per-exit kinds)",
    )
    parser.add_argument(
        "--drops",
        type=float_list,
        help="per_exit_* and learned kinds: one row per accuracy-drop target (points), the "
        "policy "
        f"calibrated on the split for it (default: {','.join(f'{d:g}' for d in DEFAULT_DROPS)})",
    )
    parser.add_argument(
        "--patience",
        type=int,
        metavar="P",
        help="per_exit_* kinds: also leave after P agreeing exits (patience or confidence)",
    )
    parser.add_argument(
        "--dtypes",
        type=dtype_list,
        default=["fp32"],
        help="precisions to measure and deploy: fp32, bf16 (weights in bfloat16), int8 "
        "(torch's dynamic quantization, CPU only); the first is the saved default",
    )
    target = parser.add_argument_group("choose a policy to deploy (written next to CHECKPOINT)")
    target.add_argument(
        "--max-accuracy-drop",
        type=float,
        metavar="D",
        help="the fastest policy within D points of the full model on --split, read per "
        "--constraint",
    )
    target.add_argument(
        "--target-speedup",
        type=float,
        metavar="S",
        help="the most accurate swept row with a layer-count speed-up of at least S",
    )
    target.add_argument(
        "--constraint",
        choices=CONSTRAINTS,
        default=CONSTRAINTS[0],
        help="agreement: at most D%% of the predictions change from the full model's (bounds "
        "the accuracy drop by D; holds on test); accuracy: accuracy within D points on the "
        "split (over-fits a small dev split: the test drop is a multiple of D)",
    )
    target.add_argument(
        "--risk-control",
        type=float,
        metavar="DELTA",
        help="certify that at most D%% of the predictions change, with probability 1 - DELTA "
        "(Learn-then-Test on the split; conservative)",
    )
    target.add_argument(
        "--head-cost",
        type=head_cost_spec,
        default=deploy.head_costs("0.03"),
        metavar="C[,NAME=C]",
        help="an exit head's time in layers (larger at batch 1 and in bf16 / int8 than at "
        "batch 32, largest on onnxruntime; benchmarks/exit_cost_batch1.py measures yours), "
        "then NAME=C for a precision or onnxruntime, e.g. 0.1,int8=0.2,onnxruntime=0.4: "
        "per-exit kinds skip the exits that do not pay for their head"
        ' (default "0.03")',
    )
    parser.add_argument(
        "--backend",
        type=backend_list,
        default=[BACKENDS[0]],
        help="what runs the model: fairseq (torch), or onnxruntime (the early-exit loop on ONNX "
        "Runtime sessions of the model's segments, --dtypes fp32 / int8, CPU): the policies are "
        "chosen on its own exits, and acl-fairseq-predict runs the saved one on it; "
        "fairseq,onnxruntime: both, and each precision is saved with the one whose chosen "
        "policy ran faster (timed at the first --batch-sizes, both in the same rounds)",
    )
    parser.add_argument(
        "--onnx-cache",
        type=Path,
        help=f"--backend onnxruntime: folder of the exported segments (default: {ONNX_CACHE}/ "
        "next to the checkpoint, as acl-fairseq-predict)",
    )
    parser.add_argument(
        "--batch-sizes", type=int_list, default=[1, 32], help="comma-separated batch sizes"
    )
    parser.add_argument("--max-examples", type=int, help="use only the first N examples")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed rounds (median); 0: no timing"
    )
    parser.add_argument("--head", help="classification head (default: the task's)")
    parser.add_argument("--out", type=Path, help="write the table here (TSV; CSV if *.csv)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if CUDA is available")
    return parser


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    return f"CPU, {torch.get_num_threads()} threads"


def _progress(message: str) -> None:
    print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


def _resolve_positionals(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("checkpoint", "data"):
        positional, option = getattr(args, name), getattr(args, f"{name}_opt")
        if positional and option and positional != option:
            parser.error(f"{name} given twice: {positional} and --{name} {option}")
        if not (positional or option):
            parser.error(f"{name.upper()} is required (positional or --{name})")
        setattr(args, name, positional or option)


def _describe(dtype: str, choice: deploy.Choice, entry: dict[str, Any], split: str) -> str:
    timed = entry.get("timed_backends")
    on = (
        f" on {entry['backend']} ("
        + ", ".join(f"{b} {ms:.3f} ms" for b, ms in timed.items())
        + " per row)"
        if timed
        else ""
    )
    return (
        f"{dtype}{on}: {choice.policy.spec} ({choice.method}): accuracy {entry['accuracy']:.2f}% "
        f"(full depth {entry['full_accuracy']:.2f}%), agreement {entry['agreement']:.2f}%, "
        f"mean exit layer {entry['mean_exit_layer']:.2f}, layer-count speed-up "
        f"{entry['layer_speedup']:.2f} on {split}"
    )


def _runner(
    backend: str, model: Any, dtype: str, head: str, cache: Path, fingerprint: str, last: bool
) -> Any:
    """``model`` at ``dtype`` on ``backend``: ONNX Runtime sessions of its fp32 segments, or the
    torch model prepared (in place at the ``last`` precision, else a copy)."""
    if backend == "onnxruntime":
        return OrtEarlyExit(model, head, cache, dtype, None, fingerprint, shared_pool=True)
    return prepare_for_inference(model if last else copy.deepcopy(model), dtype)


def _replaced_policy(checkpoint: str, fingerprint: str) -> str:
    """The checkpoint named in the policy file next to ``checkpoint`` when that file was chosen
    on other weights (it is about to be replaced), else ""."""
    try:
        old = read_policy(checkpoint)
    except ValueError:
        return ""  # not a valid file: replaced without a word
    if old is None or old.fields.get(FINGERPRINT) == fingerprint:
        return ""
    return str(old.fields.get("checkpoint", "another checkpoint"))


def main(argv: Sequence[str] | None = None) -> int:
    """The tool: the plugin's errors as one line, ``acl-fairseq-sweep: error: ...``."""
    return run_tool(PROG, _sweep_main, argv)


def _sweep_main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve_positionals(parser, args)
    if args.repeats < 0:
        parser.error(f"--repeats must be >= 0, got {args.repeats}")
    ort = "onnxruntime" in args.backend
    use_cuda = torch.cuda.is_available() and not args.cpu and not ort
    try:
        target = check_flags(args, use_cuda)
        if ort:
            require_onnxruntime()  # its error names the install command
            other = [d for d in args.dtypes if d not in ORT_DTYPES]
            if other and args.backend == ["onnxruntime"]:
                raise ValueError(
                    f"--backend onnxruntime runs fp32 or int8, not --dtypes {','.join(other)}"
                )
        check_split(args.data, args.split)
    except ValueError as e:
        parser.error(str(e))
    if not Path(args.checkpoint).is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    if target is not None:  # before the sweep: where the chosen policy goes
        check_writable(policy_path(args.checkpoint), "the policy file",
                       "the policy is saved next to the checkpoint: copy the checkpoint to a "
                       "folder you may write to and sweep that copy")  # fmt: skip
    if args.out is not None:
        check_writable(args.out, "--out", "give --out a file in a folder you may write to")
    device = torch.device("cuda" if use_cuda else "cpu")
    loaded = load_for_inference(
        args.checkpoint, args.data, device, multi_exit=True, fingerprint=target is not None or ort
    )
    model, task, max_positions = loaded.model, loaded.task, loaded.max_positions
    head = args.head or getattr(task.cfg, "classification_head_name", None) or DEFAULT_HEAD
    num_classes = int(model.classification_heads[head].out_proj.out_features)
    batches = {
        size: load_batches(task, args.split, size, args.max_examples, device, max_positions)
        for size in args.batch_sizes
    }
    reference = None  # fp32 full-depth predictions at the first batch size
    if args.dtypes != ["fp32"]:
        with torch.no_grad():
            reference = torch.cat(
                [model(t, classification_head_name=head)[0].argmax(-1).cpu()
                 for t, _ in batches[args.batch_sizes[0]]]
            )  # fmt: skip
    found: list[Precision] = []  # every (precision, backend), for the table
    chosen: list[Precision] = []  # per precision, the backend whose policy ran faster
    thresholds = None
    cache = args.onnx_cache or Path(args.checkpoint).parent / ONNX_CACHE
    plans: list[tuple[str, list[Precision], list[str], bool]] = []  # per precision
    for number, dtype in enumerate(args.dtypes):
        # the last precision may take the model in place, unless every runner waits for timing
        last = number == len(args.dtypes) - 1 and not args.repeats
        backends = [b for b in args.backend if b != "onnxruntime" or dtype in ORT_DTYPES]
        backends.sort(key=lambda b: b != "onnxruntime")  # it exports the fp32 model first
        tried, failed = [], []
        for backend in backends:
            model_d = _runner(backend, model, dtype, head, cache, loaded.fingerprint, last)
            try:
                result, thresholds = calibrate(
                    args, model_d, dtype, backend, batches, head, num_classes, target,
                    reference, thresholds,
                )  # fmt: skip
            except TargetError as e:
                failed.append(f"{dtype}{f' on {backend}' if len(backends) > 1 else ''}: {e}")
                continue
            finally:
                del model_d
            if not args.repeats:
                result.model = None  # nothing to time: free it now
            tried.append(result)
        if not tried:
            raise TargetError("; ".join(failed))
        plans.append((dtype, tried, failed, len(backends) > 1))
    if args.repeats:  # every precision and backend in the same rounds
        time_all([p for plan in plans for p in plan[1]], batches, head, args, _progress)
    for dtype, tried, failed, several in plans:
        done = []
        for p in tried:
            p.model = None
            try:
                finish(args, p)
            except TargetError as e:
                failed.append(f"{dtype}{f' on {p.backend}' if several else ''}: {e}")
                continue
            done.append(p)
        if not done:
            raise TargetError("; ".join(failed))
        for message in failed:  # another backend's policy was deployable
            _progress(f"not deployed: {message}")
        found += tried
        chosen.append(fastest(done))

    rows = [r for p in found for r in p.rows]
    oracles = [r for p in found for r in p.oracles]
    timing = (
        f"{args.repeats} timed rounds after an untimed warm-up, median; times exclude the warm-up"
        if args.repeats
        else "no timing (--repeats 0)"
    )
    print(
        f"# early-exit sweep: {Path(args.checkpoint).name}, split {args.split} "
        f"({rows[0]['examples']} examples), policy {args.policy}, {model.num_layers} layers, "
        f"exits at {', '.join(map(str, model.shallow_exit_layers))} + {model.num_layers}\n"
        f"# device: {_machine(device)}; backend {','.join(args.backend)}; dtypes "
        f"{', '.join(args.dtypes)}; {timing}\n"
    )
    print(f"Accuracy of every exit (one pass over all exits, batch {args.batch_sizes[0]}):\n")
    print("\n".join(p.note for p in found))
    print(format_markdown(rows + oracles))
    if args.out:
        write_table(rows + oracles, args.out)
        print(f"\nwrote {args.out}")
    if target is not None:
        entries = {p.dtype: p.entry for p in chosen if p.entry is not None}
        chosen_by = {"split": args.split, "examples": rows[0]["examples"]}
        if args.head_cost.own:
            chosen_by["head_costs"] = dict(args.head_cost.own)
        replaced = _replaced_policy(args.checkpoint, loaded.fingerprint)
        path = deploy.save(args.checkpoint, entries, target, loaded.fingerprint, **chosen_by)
        if replaced:
            print(f"\nreplaced {path}, which was chosen on other weights ({replaced})")
        print("\nchosen (" + ", ".join(f"{k} {v}" for k, v in target.describe().items()) + "):")
        for p in chosen:
            print("  " + _describe(p.dtype, p.choice, p.entry, args.split))
            if p.entry.get("warning"):  # deployed, and said so (here and in the file)
                print(
                    f"  warning: {p.entry['warning']}; saved with this warning: check on a "
                    "larger split, or choose another --policy"
                )
                _progress(f"warning: {p.dtype}: {p.entry['warning']}")
        on = (
            " on onnxruntime (acl-fairseq-predict's default backend now)"
            if chosen[0].backend == "onnxruntime"
            else ""
        )
        print(
            f"wrote {path}: acl-fairseq-predict and predict_early_exit use {args.dtypes[0]} "
            f"and its policy{on} when no policy is given (--dtype picks another precision's)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
