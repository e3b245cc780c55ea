"""``prepare_glue.json``, the summary ``acl-fairseq-prepare`` writes into a ``TASK-bin`` folder
(task, tokenizer, labels, row counts): its writer and its reader."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..atomic_write import write_json
from .task_specs import DataError
from .tokenizer.files import resolve_tokenizer
from .tokenizer.kinds import Tokenizer, TokenizerConfig, build_tokenizer

META_FILE = "prepare_glue.json"


def write_meta(bin_dir: Path, meta: dict[str, Any]) -> Path:
    """Writes ``bin_dir/prepare_glue.json``."""
    return write_json(bin_dir / META_FILE, meta, indent=2)


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    """The ``prepare_glue.json`` of a prepared ``TASK-bin`` folder, with the tokenizer's file
    paths resolved (relative ones against ``data_dir``, see :func:`resolve_tokenizer`)."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise DataError(f"{path} not found: was {data_dir} written by acl-fairseq-prepare?")
    meta = json.loads(path.read_text(encoding="utf-8"))
    config = resolve_tokenizer(TokenizerConfig(**meta["tokenizer"]), data_dir)
    return {**meta, "tokenizer": asdict(config)}


def read_num_classes(data_dir: str | Path) -> int | None:
    """The ``num_classes`` a prepared folder's ``prepare_glue.json`` records; None without the
    file or the field. ``DataError`` for a file that is not JSON."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text(encoding="utf-8")).get("num_classes")
    except (json.JSONDecodeError, AttributeError) as e:
        raise DataError(f"{path}: not the JSON object acl-fairseq-prepare writes ({e})") from None
    return None if recorded is None else int(recorded)


def meta_tokenizer_config(data_dir: str | Path) -> TokenizerConfig:
    """The tokenizer recorded at preparation, its files in the folder (``sentencepiece.model``,
    ``tokenizer/...``); older absolute paths are still accepted."""
    return TokenizerConfig(**read_meta(data_dir)["tokenizer"])


def meta_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The ``Tokenizer`` a prepared folder's text was encoded with, to encode new text alike."""
    return build_tokenizer(meta_tokenizer_config(data_dir))
