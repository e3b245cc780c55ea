"""``acl-fairseq-bundle CHECKPOINT OUT``: a fine-tuned checkpoint as a self-contained early-exit
bundle, one folder that runs with numpy, onnxruntime and tokenizers only (no torch, no
fairseq): what ``acl-fairseq-predict --backend onnxruntime`` runs, at the same precision and
policy (``acl_fairseq.inference.bundle`` says what is written)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from acl_fairseq.errors import run_tool
from acl_fairseq.inference.bundle import RUNNER, write_bundle
from acl_fairseq.models.heads import DEFAULT_HEAD
from acl_fairseq.runtime.onnx_runtime import ORT_DTYPES

PROG = "acl-fairseq-bundle"
DESCRIPTION = (
    "Write a fine-tuned checkpoint as an early-exit bundle: the ONNX segments of the policy's "
    "exits (fp32 or int8), the policy, the tokenizer, the label names and the weights' "
    "fingerprint, with a runner that needs only numpy, onnxruntime and tokenizers: python "
    "OUT/run.py < sentences.txt prints what acl-fairseq-predict --backend onnxruntime prints."
)
EPILOG = "docs/inference.md, 'A bundle without torch', says what is written and how to run it."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="a multi-exit classifier")
    p.add_argument("out_dir", type=Path, metavar="OUT", help="the bundle's folder (new, or empty)")
    precision = "the segments' precision (default: the saved policy's, else fp32)"
    p.add_argument("--dtype", choices=ORT_DTYPES, help=precision)
    p.add_argument(
        "--policy",
        help="early exit, e.g. entropy:0.3; 'saved': the policy acl-fairseq-sweep wrote to "
        "early_exit_policy.json next to the checkpoint; 'none': full depth (default: saved "
        "when that file exists, else full depth)",
    )
    p.add_argument("--data", type=Path, help="prepared data folder (default: the checkpoint's)")
    p.add_argument("--head", default=DEFAULT_HEAD, help="classification head")
    cache = "the exported ONNX segments' cache (default: predict's, onnx_runtime/ beside it)"
    p.add_argument("--onnx-cache", type=Path, help=cache)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(PROG, _bundle, build_parser().parse_args(argv))


def _bundle(args: argparse.Namespace) -> int:
    summary = write_bundle(
        args.checkpoint, args.out_dir, args.dtype, args.policy, args.data, args.head,
        args.onnx_cache,
    )  # fmt: skip
    out = summary.out_dir
    print(
        f"wrote {out} ({summary.size / 2**20:.1f} MiB): {summary.dtype} segments ending at "
        f"layers {', '.join(map(str, summary.exits))}; policy: {summary.why}\n"
        f"run it (numpy, onnxruntime, tokenizers): python {out}/run.py --input sentences.txt\n"
        f"or install the runner: pip install {out}; then early-exit-runner {out} < "
        f"sentences.txt\nfrom Python: sys.path.insert(0, '{out}'); from {RUNNER} import Bundle; "
        f"Bundle('{out}').predict(['a sentence'])"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
