"""The tokenizer's command-line flags (``--tokenizer``, ``--srcdict``, ``--vocab``, ...) of the
tools that prepare data (``acl-fairseq-prepare``, ``acl-fairseq-fewshot``), checked into a
``TokenizerConfig``; ``model_folder_tokenizer`` takes them from a converted BERT's folder."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..task_specs import DataError
from .kinds import TOKENIZERS, TokenizerConfig

__all__ = ["add_tokenizer_arguments", "model_folder_tokenizer", "tokenizer_config"]

logger = logging.getLogger("prepare_glue")


def add_tokenizer_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    """``--tokenizer`` and the files and sizes it takes."""
    p.add_argument("--tokenizer", choices=TOKENIZERS, required=required)
    p.add_argument(
        "--srcdict",
        type=Path,
        help="fairseq dict.txt of the model (required for gpt2 and wordpiece)",
    )
    p.add_argument("--gpt2-encoder-json", help="GPT-2 encoder.json (gpt2)")
    p.add_argument("--gpt2-vocab-bpe", help="GPT-2 vocab.bpe (gpt2)")
    p.add_argument("--vocab", help="BERT vocab.txt or tokenizer.json (wordpiece)")
    p.add_argument(
        "--lowercase",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lowercase for wordpiece (default: from tokenizer.json, else yes)",
    )
    p.add_argument(
        "--spm-vocab-size",
        type=int,
        default=8000,
        help="sentencepiece vocabulary size (upper bound; capped by the data)",
    )
    p.add_argument("--spm-character-coverage", type=float, default=1.0)
    p.add_argument("--spm-model", help="use this sentencepiece model instead of training one")


def tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    """The flags of :func:`add_tokenizer_arguments` checked (``DataError`` naming the missing
    flag or file) and collected."""

    def need(*names: str) -> None:
        missing = [n for n in names if getattr(args, n.lstrip("-").replace("-", "_")) is None]
        if missing:
            raise DataError(f"--tokenizer {args.tokenizer} needs {', '.join(missing)}")

    if args.tokenizer == "gpt2":
        need("--gpt2-encoder-json", "--gpt2-vocab-bpe", "--srcdict")
    elif args.tokenizer == "wordpiece":
        need("--vocab", "--srcdict")
    elif args.srcdict is not None and args.spm_model is None:
        raise DataError("--srcdict with sentencepiece needs the matching --spm-model")
    if args.lowercase is not None and args.tokenizer != "wordpiece":
        logger.warning("--lowercase/--no-lowercase only applies to --tokenizer wordpiece")
    for name in ("gpt2_encoder_json", "gpt2_vocab_bpe", "vocab", "spm_model", "srcdict"):
        value = getattr(args, name)
        if value is not None and not Path(value).is_file():
            raise DataError(f"--{name.replace('_', '-')}: no such file {value}")
    return TokenizerConfig(
        kind=args.tokenizer,
        gpt2_encoder_json=args.gpt2_encoder_json,
        gpt2_vocab_bpe=args.gpt2_vocab_bpe,
        vocab=args.vocab,
        lowercase=args.lowercase,
        spm_model=args.spm_model,
    )


def model_folder_tokenizer(model_dir: Path) -> tuple[TokenizerConfig, Path]:
    """(WordPiece tokenizer, ``dict.txt``) of a folder written by ``acl-fairseq-convert-bert``
    (its ``tokenizer.json``, else ``vocab.txt``)."""
    vocab = next(
        (model_dir / f for f in ("tokenizer.json", "vocab.txt") if (model_dir / f).is_file()), None
    )
    srcdict = model_dir / "dict.txt"
    if vocab is None or not srcdict.is_file():
        raise DataError(
            f"--model {model_dir}: expected the folder acl-fairseq-convert-bert writes (dict.txt "
            "and tokenizer.json or vocab.txt); otherwise give --tokenizer and its files"
        )
    return TokenizerConfig("wordpiece", vocab=str(vocab)), srcdict
