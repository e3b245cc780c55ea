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

import numpy as np
import torch
from torch import Tensor

from acl_fairseq.data.input_lines import PredictError, cut_lines, encode_rows
from acl_fairseq.early_exit.policies import ExitPolicy
from acl_fairseq.errors import run_tool
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.inference.plan import ONNXRUNTIME, Request, decide
from acl_fairseq.inference.saved_policy import policy_path
from acl_fairseq.models.heads import DEFAULT_HEAD
from acl_fairseq.portable import lines
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
) -> list[tuple[np.ndarray, int]]:
    """``(logits K float32, exit layer)`` per example, in the order of ``examples``; batches
    are formed by length (less padding, ``portable.lines.length_batches``, as the bundle's
    runner forms them) and the order restored. One copy to the host per batch."""
    results: list[tuple[np.ndarray, int]] = [(np.zeros(0, np.float32), 0)] * len(examples)
    depth = num_layers(model)
    with torch.no_grad():
        for ids in lines.length_batches([len(e) for e in examples], batch_size):
            rows = [examples[i].numpy() for i in ids]
            tokens = torch.from_numpy(lines.collate(rows, pad)).to(device)
            if policy is None:
                logits = model(tokens, classification_head_name=head)[0]
                layers = [depth] * len(ids)
            else:
                result = model.early_exit(tokens, policy, classification_head_name=head)
                logits, layers = result.logits, result.exit_layers.tolist()
            host = logits.float().cpu().numpy()
            for i, row, layer in zip(ids, host, layers):
                results[i] = (row, int(layer))
    return results


def _unused_cache(folder: str, backend: str) -> str:
    return (
        f"--onnx-cache {folder}: only the ONNX Runtime backend uses it, and this run is on "
        f"{backend}: add --backend onnxruntime, or drop --onnx-cache"
    )


def predict_main(args: argparse.Namespace, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    try:
        return _predict(args, stdin, stdout, stderr)
    except lines.InputError as e:  # the input lines' own errors (portable.lines)
        raise PredictError(str(e)) from None


def _predict(args: argparse.Namespace, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    columns = lines.parse_columns(args.text_columns)
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
    text = lines.read_input(args.input, stdin)
    rows = lines.read_rows(text, source, columns, args.header)  # early
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
    lines.check_inputs(rows, encoder.num_inputs, source, args.checkpoint, columns)
    blank = set(lines.blank_lines(rows))  # not classified: '-' on their output lines
    if blank:
        stderr.write(f"{PROG}: {lines.blank_note(sorted(blank))}\n")
    texts = [row for row in rows if row.line not in blank]
    examples = encode_rows(encoder, texts, source)
    cut = cut_lines(encoder, texts, examples)
    if cut:
        what = f"{lines.count_lines(cut, 'input line')} ({lines.line_list(cut)})"
        stderr.write(
            f"{PROG}: note: {what} cut at the model's {encoder.max_positions} positions (the "
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
    first = lines.warm_up(examples, args.batch_size)  # one-time costs, untimed
    run_batches(runner, first, policy, args.head, args.batch_size, pad, device)
    start = time.perf_counter()
    results = run_batches(runner, examples, policy, args.head, args.batch_size, pad, device)
    seconds = time.perf_counter() - start
    divisor = float((loaded.meta or {}).get("label_divisor") or 1.0)  # the raw labels' units
    layers = [layer for _, layer in results]
    answered = []
    if results:
        logits = np.stack([row for row, _ in results])
        answered = lines.output_lines(logits, layers, loaded.labels, loaded.regression, divisor)
    for line in lines.with_blanks(rows, blank, answered):
        stdout.write(line + "\n")
    stdout.flush()
    depth = num_layers(model)
    stderr.write(f"{PROG}: {lines.summary(len(results), seconds, layers, depth, plan.label)}\n")
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
