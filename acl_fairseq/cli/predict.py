"""Classify raw text with a fine-tuned checkpoint, at full depth or with early exit.

Usage::

    echo "a gripping, beautifully acted film" | acl-fairseq-predict --path CHECKPOINT
    acl-fairseq-predict CHECKPOINT --input sentences.txt --policy entropy:0.3
    acl-fairseq-predict CHECKPOINT --input pairs.tsv --text-columns 1,2 --header

One output line per input line, in input order: ``label<TAB>probability<TAB>exit_layer``
(the label dictionary's string, the softmax probability of that label at the exit it was taken
from, the 1-based layer of that exit). A summary goes to stderr. A blank input line (every
text empty or white space) is not classified: its output line is ``-<TAB>-<TAB>-`` and a note
on stderr counts them; a line cut at the model's positions (a checkpoint trained with
``--shorten-method truncate``) is counted in a note too.

The text is encoded exactly as the training data: the tokenizer recorded by
``acl-fairseq-prepare`` in ``DATA/prepare_glue.json``, the source dictionary, the task's
``--init-token`` / ``--separator-token`` (``acl_fairseq.data.text_encoder``).
``DATA`` is the checkpoint's own data folder unless ``--data`` is given.

``--backend onnxruntime`` runs the same early-exit loop on ONNX Runtime sessions of the model's
segments (``acl_fairseq.runtime.onnx_runtime``; ``--dtype fp32`` or ``int8``, CPU), exported
once into ``--onnx-cache`` (default: ``onnx_runtime/`` next to the checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor

from acl_fairseq.data.input_lines import (
    PredictError,
    blank_lines,
    count_lines,
    cut_lines,
    encode_rows,
    line_list,
    parse_columns,
    read_input,
    read_rows,
)
from acl_fairseq.early_exit.policies import ExitPolicy
from acl_fairseq.errors import run_tool
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.inference.plan import ONNXRUNTIME, Request, decide
from acl_fairseq.inference.saved_policy import policy_path
from acl_fairseq.models.heads import DEFAULT_HEAD
from acl_fairseq.runtime.onnx_runtime import (
    BACKENDS,
    ONNX_CACHE,
    check_cache_folder,
    require_onnxruntime,
)
from acl_fairseq.runtime.precision import PRECISIONS

PROG = "acl-fairseq-predict"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Classify raw text (one example per line) with a fine-tuned checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", nargs="?", help="fairseq checkpoint (or --path)")
    p.add_argument("--path", dest="path_opt", metavar="CHECKPOINT", help="same as CHECKPOINT")
    p.add_argument("--input", default="-", help="text file, one example per line; - is stdin")
    p.add_argument(
        "--text-columns", help="read the input as TSV: its 1-based text column(s), e.g. 1,2"
    )
    p.add_argument("--header", action="store_true", help="skip the first input line")
    p.add_argument(
        "--policy",
        help="early exit, e.g. entropy:0.3, maxprob:0.9, patience:2; 'saved': the policy "
        "acl-fairseq-sweep wrote to early_exit_policy.json next to the checkpoint; 'none': "
        "full depth (default: saved when that file exists, else full depth)",
    )
    p.add_argument(
        "--dtype",
        choices=PRECISIONS,
        help="precision: fp32, bf16 (weights in bfloat16), int8 (torch's dynamic quantization, "
        "CPU only) (default: the saved policy's precision, else fp32)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        help="what runs the model: fairseq (torch), or onnxruntime (the same early-exit loop on "
        "ONNX Runtime sessions of the model's segments, --dtype fp32 or int8, CPU; pip install "
        "onnxruntime onnx onnxscript) (default: the saved policy's backend, else fairseq)",
    )
    p.add_argument(
        "--onnx-cache",
        help=f"folder of the exported ONNX segments (--backend onnxruntime; default: "
        f"{ONNX_CACHE}/ next to the checkpoint)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="examples per forward pass")
    p.add_argument("--head", default=DEFAULT_HEAD, help="classification head")
    p.add_argument("--data", help="prepared data folder (default: the checkpoint's own)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if CUDA is available")
    return p


def shallow_exits(model: Any) -> tuple[int, ...]:
    """The layers of a model's shallow exits (none for plain RoBERTa or ``--exit-layers none``)."""
    return tuple(getattr(model, "shallow_exit_layers", ()) if hasattr(model, "early_exit") else ())


def num_layers(model: Any) -> int:
    """Encoder layer count of a (multi-exit or plain) RoBERTa model."""
    if hasattr(model, "num_layers"):
        return int(model.num_layers)
    return len(model.encoder.sentence_encoder.layers)


def run_batches(
    model: Any,
    examples: Sequence[Tensor],
    policy: ExitPolicy | None,
    head: str,
    batch_size: int,
    pad: int,
    device: torch.device,
) -> list[tuple[int, float, int, float]]:
    """``(class index, probability, exit layer, first logit)`` per example, in the order of
    ``examples`` (the first logit is a regression model's output); batches are formed by
    length (less padding) and the order restored. One copy to the host per batch."""
    from fairseq.data import data_utils

    order = sorted(range(len(examples)), key=lambda i: examples[i].numel())
    results: list[tuple[int, float, int, float]] = [(0, 0.0, 0, 0.0)] * len(examples)
    depth = num_layers(model)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            ids = order[start : start + batch_size]
            tokens = data_utils.collate_tokens([examples[i] for i in ids], pad).to(device)
            if policy is None:
                logits = model(tokens, classification_head_name=head)[0]
                layers = torch.full((len(ids),), depth, device=logits.device)
            else:
                result = model.early_exit(tokens, policy, classification_head_name=head)
                logits, layers = result.logits, result.exit_layers
            logits = logits.float()
            best, preds = torch.softmax(logits, dim=-1).max(dim=-1)
            columns = torch.stack([preds.double(), best.double(), layers.double(),
                                   logits[:, 0].double()], dim=1)  # fmt: skip
            for i, (pred, prob, layer, value) in zip(ids, columns.tolist()):
                results[i] = (int(pred), prob, int(layer), value)
    return results


def _unused_cache(folder: str, backend: str) -> str:
    return (
        f"--onnx-cache {folder}: only the ONNX Runtime backend uses it, and this run is on "
        f"{backend}: add --backend onnxruntime, or drop --onnx-cache"
    )


def predict_main(args: argparse.Namespace, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    columns = parse_columns(args.text_columns)
    if args.batch_size < 1:
        raise PredictError(f"--batch-size must be >= 1, got {args.batch_size}")
    request = Request(args.backend, args.dtype, args.policy).checked()  # before loading
    if request.policy == "saved" and not policy_path(args.checkpoint).is_file():
        decide(request, None, what=args.checkpoint)  # says that there is no saved policy
    if not Path(args.checkpoint).is_file():
        raise PredictError(f"checkpoint {args.checkpoint} not found (--path)")
    if request.backend == ONNXRUNTIME:
        require_onnxruntime()  # its error names the install command
    if args.onnx_cache is not None:
        if request.backend == ONNXRUNTIME:
            check_cache_folder(args.onnx_cache)  # before loading the model
        elif request.backend is not None:
            raise PredictError(_unused_cache(args.onnx_cache, f"--backend {request.backend}"))
    source = "stdin" if args.input == "-" else args.input
    rows = read_rows(read_input(args.input, stdin), source, columns, args.header)  # early
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    loaded = load_for_inference(  # a CheckpointError is printed as this tool's error
        args.checkpoint, args.data, device, label_order=False, request=request,
        text="required",
    )  # fmt: skip
    plan, model = loaded.plan, loaded.model
    if args.onnx_cache is not None and not plan.onnxruntime:
        raise PredictError(_unused_cache(args.onnx_cache, f"the {plan.backend} backend"))
    for note in loaded.notes:
        stderr.write(f"{PROG}: note: {note}\n")
    if args.head not in model.classification_heads:
        heads = ", ".join(sorted(model.classification_heads)) or "none"
        raise PredictError(f"--head {args.head}: not in {args.checkpoint} (heads: {heads})")
    stderr.write(f"{PROG}: policy: {plan.why}\n{PROG}: dtype: {plan.dtype}\n")
    if plan.policy is not None:
        try:
            plan.policy.exits(model.shallow_exit_layers)
        except ValueError as e:
            raise PredictError(f"--policy: {e}") from None
    encoder = loaded.examples
    if columns is None and encoder.num_inputs == 2:
        raise PredictError(
            f"{args.checkpoint} is a sentence-pair model: give a TSV with --text-columns 1,2"
        )
    blank = set(blank_lines(rows))  # not classified: '-' on their output lines
    if blank:
        lines = f"{count_lines(blank, 'blank input line')} ({line_list(sorted(blank))})"
        stderr.write(f"{PROG}: note: {lines}: not classified, '-' on their output lines\n")
    texts = [row for row in rows if row.line not in blank]
    examples = encode_rows(encoder, texts, source)
    cut = cut_lines(encoder, texts, examples)
    if cut:
        lines = f"{count_lines(cut, 'input line')} ({line_list(cut)})"
        stderr.write(
            f"{PROG}: note: {lines} cut at the model's {encoder.max_positions} positions (the "
            "checkpoint was trained with --shorten-method truncate)\n"
        )

    policy, pad = plan.policy, encoder.dictionary.pad()
    # this command's process: ONNX Runtime's sessions share one thread pool
    runner = loaded.runner(args.head, args.onnx_cache, shared_pool=True)
    if plan.onnxruntime:
        device = torch.device("cpu")
        if policy is not None:
            runner.prepare(policy)  # exported once, untimed
        stderr.write(f"{PROG}: backend: onnxruntime, segments in {runner.folder}\n")
    if examples:  # the first forwards pay one-time costs (threads, the padded path): untimed
        by_length = sorted(examples, key=len)
        warm_up = [by_length[0], by_length[-1]][: min(2, args.batch_size, len(examples))]
        run_batches(runner, warm_up, policy, args.head, args.batch_size, pad, device)
    start = time.perf_counter()
    results = run_batches(runner, examples, policy, args.head, args.batch_size, pad, device)
    seconds = time.perf_counter() - start
    divisor = float((loaded.meta or {}).get("label_divisor") or 1.0)
    answers = iter(results)
    for row in rows:
        if row.line in blank:
            stdout.write("-\t-\t-\n")
            continue
        index, prob, layer, value = next(answers)
        if loaded.regression or loaded.labels is None:  # the score in the raw labels' units
            stdout.write(f"{value * divisor:.4g}\t-\t{layer}\n")
        else:
            stdout.write(f"{loaded.labels[index]}\t{prob:.4f}\t{layer}\n")
    stdout.flush()
    mean_layer = sum(r[2] for r in results) / len(results) if results else 0.0
    rate = len(results) / seconds if seconds > 0 else float("inf")
    stderr.write(
        f"{PROG}: {len(results)} sentences, {rate:.1f} sentences/s (timed after one warm-up "
        f"forward), mean exit layer {mean_layer:.2f} of {num_layers(model)} ({plan.label})\n"
    )
    return 0


def main(
    argv: Sequence[str] | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoint and args.path_opt and args.checkpoint != args.path_opt:
        parser.error(f"checkpoint given twice: {args.checkpoint} and --path {args.path_opt}")
    args.checkpoint = args.checkpoint or args.path_opt
    if not args.checkpoint:
        parser.error("CHECKPOINT is required (positional or --path)")
    stderr = stderr or sys.stderr
    with contextlib.redirect_stderr(stderr):  # run_tool's one-line error goes to ``stderr``
        return run_tool(PROG, predict_main, args, stdin or sys.stdin, stdout or sys.stdout, stderr)


if __name__ == "__main__":
    sys.exit(main())
