"""The tokenizer travels with the data: its files are copied into the binarized folder and
``prepare_glue.json`` records them relative to that folder, so a moved or copied folder still
encodes new text exactly as its splits were encoded."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from ..task_specs import DataError
from .kinds import TokenizerConfig

TOKENIZER_DIR = "tokenizer"
SPM_MODEL = "sentencepiece.model"
PATH_FIELDS = ("gpt2_encoder_json", "gpt2_vocab_bpe", "vocab", "spm_model")


def _stored_name(field: str, source: Path) -> str:
    """Where ``field``'s file lives inside the binarized folder (relative, POSIX)."""
    if field == "spm_model":
        return SPM_MODEL
    return f"{TOKENIZER_DIR}/{source.name}"


def store_tokenizer(config: TokenizerConfig, bin_dir: Path) -> TokenizerConfig:
    """Copy the files of ``config`` into ``bin_dir`` (``sentencepiece.model``,
    ``tokenizer/encoder.json``, ``tokenizer/vocab.txt``...) and return ``config`` with those
    paths, relative to ``bin_dir``."""
    changes: dict[str, str] = {}
    for field in PATH_FIELDS:
        value = getattr(config, field)
        if value is None:
            continue
        source = Path(value)
        name = _stored_name(field, source)
        dest = bin_dir / name
        if not dest.exists() or source.resolve() != dest.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest)
        changes[field] = name
    return dataclasses.replace(config, **changes)


def resolve_tokenizer(config: TokenizerConfig, data_dir: str | Path) -> TokenizerConfig:
    """``config`` with usable paths: relative ones against ``data_dir``; an absolute one (as
    older versions recorded) is used if it exists, else the copy of the same name in
    ``data_dir``. A sentencepiece model in ``data_dir/sentencepiece.model`` always wins."""
    data_dir = Path(data_dir)
    changes: dict[str, str] = {}
    for field in PATH_FIELDS:
        value = getattr(config, field)
        if value is None:
            continue
        recorded = Path(value)
        local = data_dir / _stored_name(field, recorded)
        if field == "spm_model" and local.is_file():
            path = local
        elif not recorded.is_absolute():
            path = data_dir / recorded
        elif recorded.is_file() or not local.is_file():
            path = recorded
        else:
            path = local
        if not path.is_file():
            raise DataError(
                f"tokenizer file {path} (recorded as {value!r} in {data_dir}/prepare_glue.json) "
                f"not found: prepare the data again with acl-fairseq-prepare"
            )
        changes[field] = str(path)
    return dataclasses.replace(config, **changes)


def relative_to(path: str | Path, folder: Path) -> str:
    """``path`` relative to ``folder`` (POSIX), or absolute on another drive."""
    try:
        return Path(os.path.relpath(Path(path).resolve(), folder.resolve())).as_posix()
    except ValueError:  # another drive (Windows)
        return Path(path).resolve().as_posix()
