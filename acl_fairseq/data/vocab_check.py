"""A ``--srcdict`` that does not belong to the tokenizer turns much of the text into
``<unk>``; fairseq-preprocess only logs that. This check stops the preparation instead."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .task_specs import DataError
from .tokenizer.kinds import TokenizerConfig

MAX_UNK_SHARE = 0.05
"""The largest share of train tokens allowed to map to ``<unk>`` in ``--srcdict``."""

TOKENIZER_FLAGS = {
    "gpt2": "--gpt2-encoder-json/--gpt2-vocab-bpe",
    "wordpiece": "--vocab",
    "sentencepiece": "--spm-model",
}


def unk_count(lines: Iterable[str], srcdict: Path) -> tuple[int, int]:
    """``(tokens mapping to <unk>, all tokens)`` of space-separated ``lines`` in ``srcdict``."""
    from fairseq.data import Dictionary

    dictionary = Dictionary.load(str(srcdict))
    unk = dictionary.unk()
    unknown = total = 0
    for line in lines:
        for token in line.split():
            total += 1
            unknown += dictionary.index(token) == unk
    return unknown, total


def check_srcdict_coverage(
    task: str,
    train_lines: Iterable[str],
    srcdict: Path,
    config: TokenizerConfig,
    max_share: float = MAX_UNK_SHARE,
) -> float:
    """Raise ``DataError`` if more than ``max_share`` of the train tokens are not in
    ``srcdict``; returns the share."""
    unknown, total = unk_count(train_lines, srcdict)
    share = unknown / total if total else 0.0
    if share > max_share:
        flag = TOKENIZER_FLAGS.get(config.kind, "--tokenizer")
        raise DataError(
            f"{task}: {share:.1%} of the train tokens ({unknown} of {total}) are not in "
            f"--srcdict {srcdict} and would become <unk> (at most {max_share:.0%} allowed): "
            f"the dictionary does not belong to the tokenizer (--tokenizer {config.kind} "
            f"{flag}). Use the dict.txt that matches the tokenizer (for a BERT model the "
            "dict.txt that acl-fairseq-convert-bert wrote next to it, for RoBERTa its "
            "dict.txt), or the tokenizer files that match the dictionary"
        )
    return share
