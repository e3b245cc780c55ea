"""Convert a Hugging Face BERT checkpoint into a fairseq RoBERTa-architecture checkpoint.

Input: ``config.json``, ``vocab.txt`` and the weights (safetensors, ``.bin``, or sharded) of a
``BertModel`` or a ``BertFor...`` checkpoint. Output (``acl-fairseq-convert-bert HF_DIR
OUTDIR``): ``model.pt`` (tensors and plain containers, loaded strictly by ``fairseq-train
--restore-file``), ``dict.txt`` (BERT's specials as fairseq's; the task appends ``<mask>``),
``fairseq_args.txt`` (the model flags), ``bert_to_fairseq_ids.json`` and the tokenizer files.

Both are post-LN encoders: positions shift by ``padding_idx + 1`` rows, and BERT's segment-A
embedding is added to every position row. BERT's LayerNorm eps differs from fairseq's: set
every ``nn.LayerNorm``'s eps to ``model.pt["conversion"]["layer_norm_eps"]`` to match it.
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from acl_fairseq.atomic_write import write_json, write_text, write_with
from acl_fairseq.hf_bert.state import (
    DEFAULT_HEAD,
    ArchSpec,
    ConversionError,
    arch_from_config,
    bert_state_to_fairseq,
    find_bert_prefix,
    load_hf_config,
    load_hf_state_dict,
)
from acl_fairseq.hf_bert.vocab import (
    TOKENIZER_FILES,
    build_vocab_mapping,
    read_special_tokens,
    read_vocab,
    write_dict,
)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- checkpoint


def build_checkpoint(
    model_state: Mapping[str, torch.Tensor],
    spec: ArchSpec,
    metadata: Mapping[str, Any],
) -> dict[str, Any]:
    """Wrap a state dict into the dict ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` and
    ``Trainer.load_checkpoint`` expect (plain containers only)."""
    model_cfg = {"_name": "roberta", "arch": "roberta", **asdict(spec)}
    model_cfg.update(
        encoder_normalize_before=False,
        layernorm_embedding=True,
        untie_weights_roberta=False,
        encoder_learned_pos=True,
        no_scale_embedding=True,
    )
    return {
        "model": OrderedDict(model_state),
        "cfg": {
            "model": model_cfg,
            "task": {"_name": "masked_lm", "data": "."},
            "criterion": {"_name": "masked_lm"},
            "bpe": None,  # BERT WordPiece is not a fairseq BPE: tokenize with vocab.txt
            "tokenizer": None,
        },
        "optimizer_history": [
            {
                "criterion_name": "MaskedLmLoss",
                "optimizer_name": "none",
                "lr_scheduler_state": {"best": None},
                "num_updates": 0,
            }
        ],
        "last_optimizer_state": None,
        "extra_state": {
            "train_iterator": {"epoch": 1, "iterations_in_epoch": 0, "shuffle": True, "version": 2}
        },
        "conversion": dict(metadata),
    }


def convert(
    hf_dir: str | Path,
    out_dir: str | Path,
    classification_head: str | None = DEFAULT_HEAD,
    num_classes: int | None = None,
) -> dict[str, Any]:
    """Converts ``hf_dir`` into ``out_dir``; a summary: ``fairseq_args``, ``arch``,
    ``num_embeddings`` (``len(dictionary) + 1``), ``bert_to_fairseq`` and the paths."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise ConversionError(f"HF_DIR {hf_dir} is not a directory")
    config = load_hf_config(hf_dir)
    spec = arch_from_config(config, source=str(hf_dir / "config.json"))
    vocab = read_vocab(hf_dir / "vocab.txt")
    state = load_hf_state_dict(hf_dir)
    word = state[find_bert_prefix(state) + "embeddings.word_embeddings.weight"]
    if len(vocab) != word.shape[0]:
        raise ConversionError(
            f"{hf_dir / 'vocab.txt'} has {len(vocab)} tokens but word_embeddings has "
            f"{word.shape[0]} rows; use the vocab.txt the model was trained with"
        )
    if "vocab_size" in config and int(config["vocab_size"]) != word.shape[0]:
        raise ConversionError(
            f"config.json vocab_size={config['vocab_size']} but word_embeddings has "
            f"{word.shape[0]} rows"
        )
    special_tokens = read_special_tokens(hf_dir)
    mapping = build_vocab_mapping(vocab, special_tokens)
    pad_id = config.get("pad_token_id")
    if pad_id is not None and vocab[pad_id] != special_tokens["pad_token"]:
        logger.warning("config.json pad_token_id=%s is not %r", pad_id, special_tokens["pad_token"])

    model_state = bert_state_to_fairseq(
        state, spec, mapping.fairseq_to_bert, classification_head, num_classes
    )
    fairseq_args = spec.fairseq_args()
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = {
        "source": hf_dir.resolve().name,
        "hf_config": config,
        "fairseq_args": " ".join(fairseq_args),
        "num_embeddings": len(mapping.symbols),
        "special_tokens": special_tokens,
        "layer_norm_eps": float(config.get("layer_norm_eps", 1e-12)),
    }
    checkpoint = build_checkpoint(model_state, spec, metadata)
    write_with(out_dir / "model.pt", lambda tmp: torch.save(checkpoint, tmp))
    write_dict(out_dir / "dict.txt", mapping)
    write_text(out_dir / "fairseq_args.txt", " ".join(fairseq_args) + "\n")
    write_json(out_dir / "bert_to_fairseq_ids.json", mapping.bert_to_fairseq, indent=None)
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            write_with(out_dir / name, functools.partial(shutil.copyfile, hf_dir / name))
    return {
        "model": str(out_dir / "model.pt"),
        "dict": str(out_dir / "dict.txt"),
        "fairseq_args": fairseq_args,
        "arch": asdict(spec),
        "num_embeddings": len(mapping.symbols),
        "bert_to_fairseq": mapping.bert_to_fairseq,
    }
