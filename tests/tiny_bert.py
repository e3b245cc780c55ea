"""A tiny random Hugging Face BERT that stands in for MiniLM / roberta.base where a test runs
the user's commands end to end (the README's, the demo): its folder has what a real download
has (config.json, model.safetensors, vocab.txt, tokenizer.json), and its WordPiece vocabulary
covers the words of ``fairseq_helpers.write_tsv``'s sentences."""

from __future__ import annotations

from pathlib import Path

import torch

from fairseq_helpers import NEGATIVE, NEUTRAL, POSITIVE

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIALS + [w.lower() for w in POSITIVE + NEGATIVE + NEUTRAL] + [".", ",", "film", "a"]


def tiny_bert(root: Path, positions: int = 512) -> Path:
    """``root`` holding a 2-layer BERT of hidden size 32 (random weights, seed 0)."""
    import transformers
    from tokenizers import BertWordPieceTokenizer

    config = transformers.BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=positions, type_vocab_size=2,
    )  # fmt: skip
    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    transformers.BertModel(config).save_pretrained(root, safe_serialization=True)
    (root / "vocab.txt").write_text("".join(f"{t}\n" for t in VOCAB), encoding="utf-8")
    BertWordPieceTokenizer(str(root / "vocab.txt"), lowercase=True).save(
        str(root / "tokenizer.json")
    )
    return root
