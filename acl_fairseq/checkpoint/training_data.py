"""What a checkpoint was trained on: the data folder, the label list in class order, single
sentences or pairs, the input dictionary and tokenizer files.

Recorded at training in the checkpoint's ``task_state`` (plain strings and lists) and
compared at inference with the folder given (:func:`check_folder`). A checkpoint without the
record is used with a warning.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

from ..data.prepared import META_FILE, read_meta
from ..errors import AclValueError

__all__ = [
    "KEY",
    "DataMismatch",
    "FolderCheck",
    "check_folder",
    "describe_folder",
    "dictionary_labels",
    "record_training_data",
    "recorded",
]

KEY = "acl_fairseq_training_data"
_META = META_FILE
_TOKENIZER_FILES = ("gpt2_encoder_json", "gpt2_vocab_bpe", "vocab", "spm_model")


class DataMismatch(AclValueError):
    """The folder given is not one the checkpoint can be used with; the message says why."""


def dictionary_labels(dictionary: Any) -> list[str]:
    """The labels of a fairseq label dictionary in class order (no special symbols, no unused
    padding symbols such as ``madeupword0000``)."""
    return [
        dictionary.symbols[i]
        for i in range(dictionary.nspecial, len(dictionary))
        if dictionary.count[i] > 0 and dictionary.symbols[i] != "<mask>"
    ]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _symbols_hash(dict_file: Path) -> str | None:
    """Hash of the symbols of a fairseq ``dict.txt`` in order (their ids), counts ignored."""
    if not dict_file.is_file():
        return None
    symbols = [line.split(" ")[0] for line in dict_file.read_text(encoding="utf-8").splitlines()]
    return _sha256("\n".join(symbols).encode("utf-8"))


def _tokenizer_hash(
    data: Path, meta: dict[str, Any] | None = None
) -> tuple[str | None, str | None]:
    """(task name, tokenizer fingerprint) of ``prepare_glue.json`` (``meta``: that file, read
    by the caller): the tokenizer's kind, its lowercasing and its files' contents; (None, None)
    without that file."""
    if meta is None:
        if not (data / _META).is_file():
            return None, None

        meta = read_meta(data)
    config = dict(meta.get("tokenizer") or {})
    digest = hashlib.sha256(json.dumps([config.get("kind"), config.get("lowercase")]).encode())
    for field in _TOKENIZER_FILES:
        file = config.get(field)
        if file and Path(file).is_file():
            digest.update(Path(file).read_bytes())
    return meta.get("task"), digest.hexdigest()[:16]


def describe_folder(
    data: str | Path, label_dictionary: Any = None, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What :func:`check_folder` compares, for the prepared folder ``data``; the labels come
    from ``label_dictionary`` (default: ``DATA/label/dict.txt``; ``None`` without one, as for
    regression); ``meta``: its ``prepare_glue.json`` when the caller has read it."""
    data = Path(data)
    if label_dictionary is None and (data / "label" / "dict.txt").is_file():
        from fairseq.data import Dictionary

        label_dictionary = Dictionary.load(str(data / "label" / "dict.txt"))
    task, tokenizer = _tokenizer_hash(data, meta)
    return {
        "data": str(data.resolve()),
        "task": task,
        "labels": None if label_dictionary is None else dictionary_labels(label_dictionary),
        "num_inputs": 2 if (data / "input1").is_dir() else 1,
        "dictionary": _symbols_hash(data / "input0" / "dict.txt"),
        "tokenizer": tokenizer,
    }


def record_training_data(task: Any, from_checkpoint: bool = False) -> None:
    """Records the task's data folder in its state (saved with every checkpoint); a task set
    up to load a checkpoint (``from_checkpoint``) records nothing: the checkpoint's record is
    merged into its state by fairseq."""
    if from_checkpoint:
        return
    regression = bool(getattr(task.cfg, "regression_target", False))
    labels = None if regression else task.label_dictionary
    task.state.merge_state_dict({KEY: describe_folder(task.cfg.data, labels)})


def recorded(state_or_task: Any) -> dict[str, Any] | None:
    """The record of a checkpoint (its state dict, read) or of a task that loaded one."""
    if isinstance(state_or_task, dict):
        return (state_or_task.get("task_state") or {}).get(KEY)
    state = getattr(state_or_task, "state", None)
    return getattr(state, "state_dict", {}).get(KEY) if state is not None else None


class FolderCheck(NamedTuple):
    """What :func:`check_folder` found."""

    labels: list[str] | None  # class names in the model's class order (None: regression)
    notes: list[str]  # what the user should know (no record; labels in another order)


def _kind(num_inputs: int) -> str:
    return "sentence pairs" if num_inputs == 2 else "single sentences"


def _listed(labels: list[str]) -> str:
    return ", ".join(labels[:10]) + (", ..." if len(labels) > 10 else "")


def check_folder(
    record: dict[str, Any] | None,
    folder: dict[str, Any],
    checkpoint: str | Path,
    flag: str = "--data",
    num_classes: int | None = None,
) -> FolderCheck:
    """Compares a checkpoint's ``record`` (None: none; then ``num_classes`` is checked) with
    the folder given by ``flag``: ``DataMismatch`` for pairs against single sentences, other
    labels, another dictionary or tokenizer."""
    here = f"{flag} {folder['data']}"
    labels = folder["labels"]
    if record is None:
        if labels is not None and num_classes is not None and len(labels) != num_classes:
            raise DataMismatch(
                f"{here} lists {len(labels)} labels ({_listed(labels)}), but {checkpoint} "
                f"classifies into {num_classes}: give the prepared folder it was trained on"
            )
        note = (
            f"{checkpoint} does not record the data it was trained on (trained with an older "
            "acl-fairseq or --task sentence_prediction): the labels are named by "
            f"{folder['data']}/label/dict.txt; make sure that is the folder it was trained on"
        )
        return FolderCheck(labels, [note] if labels is not None else [])
    trained = f"{checkpoint} was trained on {record['data']}"
    fix = "Give the prepared folder it was trained on"
    if folder["num_inputs"] != record["num_inputs"]:
        raise DataMismatch(
            f"{here} holds {_kind(folder['num_inputs'])}, but {trained}, which holds "
            f"{_kind(record['num_inputs'])}: {fix.lower()}"
        )
    ours = record.get("labels")
    if (ours is None) != (labels is None):
        what = "a regression" if ours is None else "a classification"
        raise DataMismatch(f"{here} is not {what} task's folder, but {trained}. {fix}")
    if ours is not None and sorted(ours) != sorted(labels):
        raise DataMismatch(
            f"{here} lists the labels {_listed(labels)}, but {trained}, whose labels are "
            f"{_listed(ours)}: its predictions would be named wrongly. {fix}"
        )
    encoding = (("dictionary", "input dictionary (input0/dict.txt)"), ("tokenizer", "tokenizer"))
    for key, what in encoding:
        if record.get(key) and folder.get(key) and record[key] != folder[key]:
            raise DataMismatch(
                f"{here} has another {what} than the one {checkpoint} was trained with (on "
                f"{record['data']}): new text would be encoded into other ids. {fix}, or one "
                "prepared with the same tokenizer and --srcdict"
            )
    if ours is None:
        return FolderCheck(None, [])
    notes = []
    if ours != labels:
        notes.append(
            f"{folder['data']}/label/dict.txt lists the labels in another order "
            f"({_listed(labels)}) than the checkpoint ({_listed(ours)}): the checkpoint's "
            "order is used"
        )
    return FolderCheck(list(ours), notes)
