"""``acl-fairseq-export-hf CHECKPOINT OUTDIR``: a fine-tuned checkpoint's final exit (or, with
``--exit L``, its exit at layer L as a model of L layers) as a Hugging Face ``transformers``
sequence-classification folder (``acl_fairseq.hf_bert.export`` says what is written and what
cannot be)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from acl_fairseq.errors import run_tool
from acl_fairseq.hf_bert.export import export_checkpoint

PROG = "acl-fairseq-export-hf"
DESCRIPTION = (
    "Write a fine-tuned checkpoint as a Hugging Face transformers folder that "
    "AutoModelForSequenceClassification and AutoTokenizer load with no custom code: config.json "
    "(BertForSequenceClassification, id2label from the checkpoint's labels), model.safetensors, "
    "and a tokenizer that encodes text as the training data was encoded (tokenizer.json, and "
    "vocab.txt for WordPiece)."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    p.add_argument("checkpoint", type=Path, help="fine-tuned checkpoint (.pt)")
    p.add_argument("out_dir", type=Path, help="output folder (created if missing)")
    p.add_argument(
        "--data",
        type=Path,
        help="the prepared data folder it was trained on (its tokenizer and labels; default: "
        "the folder the checkpoint recorded)",
    )
    p.add_argument(
        "--exit",
        dest="layer",
        type=int,
        metavar="LAYER",
        help="export the exit at LAYER as a model of LAYER layers (default: the final exit)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_tool(PROG, _export, args)


def _export(args: argparse.Namespace) -> int:
    summary = export_checkpoint(args.checkpoint, args.out_dir, args.data, args.layer)
    unknown = (
        f"; {summary.unknown_tokens} tokens the dictionary lacks read as <unk>, as in training"
        if summary.unknown_tokens
        else ""
    )
    print(
        f"wrote {summary.out_dir}: exit {summary.layer} of {summary.num_layers} layers as "
        f"BertForSequenceClassification ({', '.join(summary.files)}); vocabulary "
        f"{summary.vocab_size}{unknown}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
