"""A BERT ``vocab.txt`` as a fairseq dictionary (``build_vocab_mapping``, ``write_dict``, for
``convert``); the way back, a dictionary as a tokenizer's vocabulary, is
``data.tokenizer.hf_json.exported_vocab``."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..atomic_write import write_text
from .state import ConversionError

logger = logging.getLogger(__name__)

#: fairseq ``Dictionary`` special symbols at indices 0..3 and the BERT tokens mapped onto them.
FAIRSEQ_SPECIALS: tuple[str, ...] = ("<s>", "<pad>", "</s>", "<unk>")
SPECIAL_ROLES: tuple[str, ...] = ("cls_token", "pad_token", "sep_token", "unk_token")
MASK_SYMBOL = "<mask>"
DEFAULT_SPECIAL_TOKENS: dict[str, str] = {
    "cls_token": "[CLS]",
    "pad_token": "[PAD]",
    "sep_token": "[SEP]",
    "unk_token": "[UNK]",
    "mask_token": "[MASK]",
}

#: Files copied verbatim so that data preparation tokenizes with the same vocabulary.
TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class VocabMapping:
    """Row order of the fairseq embedding matrix: ``symbols[j]``, the BERT row it comes from
    (``fairseq_to_bert[j]``, -1: none), and ``bert_to_fairseq[i]`` for BERT token id ``i``."""

    symbols: list[str]
    fairseq_to_bert: list[int]
    bert_to_fairseq: list[int]

    @property
    def dict_symbols(self) -> list[str]:
        """Symbols written to ``dict.txt`` (without the fairseq specials and ``<mask>``)."""
        return self.symbols[len(FAIRSEQ_SPECIALS) : -1]


def read_vocab(path: Path) -> list[str]:
    """Read a WordPiece ``vocab.txt`` exactly like ``transformers.BertTokenizer`` (line = id)."""
    if not path.is_file():
        raise ConversionError(f"{path} not found: the BERT WordPiece vocabulary is required")
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f.readlines()]


def read_special_tokens(hf_dir: Path) -> dict[str, str]:
    """Special token strings from ``special_tokens_map.json`` (BERT defaults otherwise)."""
    tokens = dict(DEFAULT_SPECIAL_TOKENS)
    path = hf_dir / "special_tokens_map.json"
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        for role in tokens:
            value = data.get(role)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                tokens[role] = value
    return tokens


def build_vocab_mapping(
    vocab: Sequence[str], special_tokens: Mapping[str, str] | None = None
) -> VocabMapping:
    """BERT's vocabulary as a fairseq dictionary: its specials as ``<s> <pad> </s> <unk>``,
    the rest in id order, ``<mask>`` last; a token ``dict.txt`` cannot hold keeps its row as
    ``<bert_unreachable_ID>``."""
    special_tokens = {**DEFAULT_SPECIAL_TOKENS, **(special_tokens or {})}
    last_index = {tok: i for i, tok in enumerate(vocab)}  # later duplicates win, as in BERT
    special_ids: list[int] = []
    for role in SPECIAL_ROLES:
        token = special_tokens[role]
        if token not in last_index:
            raise ConversionError(
                f"vocab.txt has no {role} {token!r}; fix special_tokens_map.json or the vocabulary"
            )
        special_ids.append(last_index[token])
    mask_id = last_index.get(special_tokens["mask_token"], -1)
    if mask_id < 0:
        logger.warning(
            "vocab.txt has no mask_token %r: <mask> is initialised with the mean embedding",
            special_tokens["mask_token"],
        )
    taken = set(special_ids) | {mask_id}
    if len(taken - {-1}) != len(SPECIAL_ROLES) + (mask_id >= 0):
        raise ConversionError(f"vocab.txt: special tokens {special_tokens} share a token id")

    reserved = set(FAIRSEQ_SPECIALS) | {MASK_SYMBOL}
    symbols = list(FAIRSEQ_SPECIALS)
    fairseq_to_bert = list(special_ids)
    renamed: list[str] = []
    used = set(symbols) | set(vocab)
    for i, tok in enumerate(vocab):
        if i in taken:
            continue
        name = tok
        if not tok or any(ch.isspace() for ch in tok) or tok in reserved or last_index[tok] != i:
            name = f"<bert_unreachable_{i}>"
            while name in used:
                name = "_" + name
            used.add(name)
            renamed.append(f"{i}:{tok!r}")
        symbols.append(name)
        fairseq_to_bert.append(i)
    symbols.append(MASK_SYMBOL)
    fairseq_to_bert.append(mask_id)
    if renamed:
        logger.warning(
            "%d vocab.txt tokens cannot appear in a fairseq dict.txt and were renamed "
            "<bert_unreachable_ID> (their embeddings are kept): %s",
            len(renamed),
            ", ".join(renamed[:20]) + (" ..." if len(renamed) > 20 else ""),
        )

    bert_to_fairseq = [-1] * len(vocab)
    for j, i in enumerate(fairseq_to_bert):
        if i >= 0:
            bert_to_fairseq[i] = j
    return VocabMapping(symbols, fairseq_to_bert, bert_to_fairseq)


def write_dict(path: Path, mapping: VocabMapping) -> None:
    """Write ``dict.txt`` (``SYMBOL 1`` per line; fairseq adds the specials and ``<mask>``)."""
    write_text(path, "".join(f"{sym} 1\n" for sym in mapping.dict_symbols))
