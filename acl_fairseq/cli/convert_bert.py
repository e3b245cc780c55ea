"""``acl-fairseq-convert-bert HF_DIR OUTDIR``: convert a Hugging Face BERT folder into a fairseq
RoBERTa-architecture checkpoint folder (``acl_fairseq.hf_bert.convert`` says what is written)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from acl_fairseq.errors import run_tool
from acl_fairseq.hf_bert.convert import convert
from acl_fairseq.models.heads import DEFAULT_HEAD

PROG = "acl-fairseq-convert-bert"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Convert a Hugging Face BERT directory (config.json, vocab.txt, model.safetensors or "
            "pytorch_model.bin) into a fairseq RoBERTa checkpoint OUTDIR/model.pt plus "
            "OUTDIR/dict.txt and OUTDIR/fairseq_args.txt (the --arch/--encoder-* flags for "
            "fairseq-train --restore-file OUTDIR/model.pt)."
        ),
    )
    parser.add_argument("hf_dir", type=Path, help="Hugging Face BERT model directory")
    parser.add_argument("out_dir", type=Path, help="output directory (created if missing)")
    head = parser.add_mutually_exclusive_group()
    head.add_argument(
        "--classification-head",
        metavar="NAME",
        default=DEFAULT_HEAD,
        help="write classification_heads.NAME initialised from BERT's pooler (dense) and, when "
        "the checkpoint has one, its classifier (out_proj); without a classifier and without "
        "--num-classes only the pooler is written and the multi-exit model gives the head a "
        "fresh out_proj (default: %(default)s, fairseq's head name)",
    )
    head.add_argument(
        "--no-classification-head",
        dest="classification_head",
        action="store_const",
        const=None,
        help="write no classification head: the final head starts from fairseq's random "
        "initialisation",
    )
    parser.add_argument(
        "--num-classes",
        type=int,
        help="outputs of the classification head's out_proj when the checkpoint has no "
        "classifier.* weights (random init); default: none, the task adds them",
    )
    parser.add_argument("--quiet", action="store_true", help="only log warnings")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return run_tool(PROG, _convert, args)


def _convert(args: argparse.Namespace) -> int:
    result = convert(args.hf_dir, args.out_dir, args.classification_head, args.num_classes)
    flags = " ".join(result["fairseq_args"])
    print(
        f"wrote {args.out_dir}/model.pt ({result['num_embeddings']} embedding rows incl. <mask>), "
        f"dict.txt, fairseq_args.txt\n"
        f"fairseq-train flags: {flags} --restore-file {args.out_dir}/model.pt "
        "--reset-optimizer --reset-dataloader --reset-meters"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
