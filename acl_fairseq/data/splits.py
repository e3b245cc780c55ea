"""The splits of a data folder: few-shot draws from raw rows (disjoint by text), and a prepared
folder's binarized splits: present or not, examples and classes, evaluation batches."""

from __future__ import annotations

import random
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fairseq.data import BaseWrapperDataset
from torch import Tensor

from ..errors import AclFileNotFoundError, AclValueError

__all__ = [
    "DEV_SEED_OFFSET",
    "FirstExamples",
    "Overlap",
    "check_disjoint",
    "check_split",
    "count_classes",
    "count_examples",
    "fewshot_train",
    "fewshot_train_dev",
    "load_batches",
    "overlaps",
    "raw_files",
    "repeated_texts",
    "split_off",
    "unique_texts",
    "without_texts",
]

DEV_SEED_OFFSET = 10_000  # the dev draw's seed: never one of a training draw
Row = tuple[str, ...]  # the text(s) of an example, its label last


def fewshot_train(train: list[Row], per_class: int, seed: int) -> list[Row]:
    """``per_class`` rows of each label (the last field) drawn with ``seed``, in a shuffled
    order. ``ValueError`` when a label has fewer rows."""
    rng = random.Random(seed)
    chosen: list[Row] = []
    for label in sorted({row[-1] for row in train}):
        pool = [row for row in train if row[-1] == label]
        if per_class > len(pool):
            raise ValueError(f"{per_class} examples per class asked, {label} has {len(pool)}")
        chosen += rng.sample(pool, per_class)
    rng.shuffle(chosen)
    return chosen


def fewshot_train_dev(pool: list[Row], per_class: int, seed: int) -> tuple[list[Row], list[Row]]:
    """A few-shot training set (:func:`fewshot_train`) and a dev set of the same size drawn
    from the rest of ``pool`` (disjoint: no row of the training set, duplicates included), as
    a user with ``2 x per_class`` labelled examples per class would split them."""
    train = fewshot_train(pool, per_class, seed)
    taken = set(train)
    rest = [row for row in pool if row not in taken]
    return train, fewshot_train(rest, per_class, DEV_SEED_OFFSET + seed)


def split_off(rows: list[Row], size: int, seed: int = 0) -> tuple[list[Row], list[Row]]:
    """``(rest, held_out)``: ``size`` rows drawn with ``seed`` held out (e.g. a test split),
    both in the rows' order."""
    if not 0 < size < len(rows):
        raise ValueError(f"cannot hold out {size} of {len(rows)} rows")
    held = set(random.Random(seed).sample(range(len(rows)), size))
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def text_of(row: Row) -> tuple[str, ...]:
    """An example's text(s): every field but the label."""
    return row[:-1]


def repeated_texts(rows: Sequence[Row]) -> list[list[int]]:
    """The indices of the rows of every text that occurs more than once (each list in row
    order; the lists in the order of their first row)."""
    where: dict[tuple[str, ...], list[int]] = {}
    for i, row in enumerate(rows):
        where.setdefault(text_of(row), []).append(i)
    return [indices for indices in where.values() if len(indices) > 1]


def unique_texts(rows: Sequence[Row]) -> tuple[list[Row], int]:
    """``(rows without a row whose text an earlier row has, how many were removed)``: a pool
    where a training row and a dev row can never be one example twice."""
    seen: set[tuple[str, ...]] = set()
    kept = []
    for row in rows:
        if text_of(row) not in seen:
            seen.add(text_of(row))
            kept.append(row)
    return kept, len(rows) - len(kept)


def without_texts(rows: Sequence[Row], others: Sequence[Row]) -> tuple[list[Row], int]:
    """``(rows whose text is none of others' texts, how many were removed)``, in order: a
    pool without the test split's examples."""
    taken = {text_of(row) for row in others}
    kept = [row for row in rows if text_of(row) not in taken]
    return kept, len(rows) - len(kept)


@dataclass(frozen=True)
class Overlap:
    """Two splits that share texts: ``shared`` rows of ``second`` whose text is in ``first``;
    ``pairs``: the first few as ``(index in first, index in second)``."""

    first: str
    second: str
    shared: int
    texts: int  # distinct shared texts
    pairs: tuple[tuple[int, int], ...]


def overlaps(splits: Mapping[str, Sequence[Row]], shown: int = 3) -> list[Overlap]:
    """Every pair of ``splits`` (in their order) whose rows share a text (every field but
    the label): an example seen in training and scored in dev or test."""
    names, found = list(splits), []
    for i, a in enumerate(names):
        where: dict[Row, int] = {}
        for index, row in enumerate(splits[a]):
            where.setdefault(text_of(row), index)
        for b in names[i + 1 :]:
            hits = [(where[text_of(row)], j) for j, row in enumerate(splits[b])
                    if text_of(row) in where]  # fmt: skip
            if hits:
                distinct = len({text_of(splits[b][j]) for _, j in hits})
                found.append(Overlap(a, b, len(hits), distinct, tuple(hits[:shown])))
    return found


def check_disjoint(splits: Mapping[str, Sequence[Row]]) -> None:
    """``ValueError`` naming two splits that share a text (an example seen in training and
    scored in dev or test), how many texts and the first."""
    for overlap in overlaps(splits, shown=1):
        first = text_of(splits[overlap.second][overlap.pairs[0][1]])
        raise ValueError(
            f"{overlap.first} and {overlap.second} share {overlap.texts} text(s), e.g. {first!r}"
        )


def raw_files(data: str | Path) -> str:
    """Up to three TSV files in ``data`` or, when it has none, in its subfolders (a GLUE
    download), comma-joined; '' when there are none."""
    data = Path(data)
    if not data.is_dir():
        return ""
    found = sorted(p.name for p in data.glob("*.tsv"))
    if not found:
        found = sorted(f"{p.parent.name}/{p.name}" for p in data.glob("*/*.tsv"))
    return ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")


def check_split(data: str | Path, split: str) -> None:
    """Raise ``ValueError`` (naming ``--split`` / ``--data``) unless ``split`` is binarized."""
    input0 = Path(data) / "input0"
    if not input0.is_dir():
        raise AclValueError(
            f"--data {data}: no input0/ folder (a binarized sentence_prediction dir)"
        )
    if not (input0 / f"{split}.idx").is_file():
        found = ", ".join(sorted(p.stem for p in input0.glob("*.idx"))) or "none"
        raise AclValueError(
            f"--split {split}: {input0}/{split}.bin/.idx not found (splits there: {found}); "
            "pick one with --split"
        )


def count_examples(data: Path, split: str = "train") -> int:
    """Examples in ``DATA/input0/SPLIT``, from the index header (``FileNotFoundError`` naming
    the index file when missing)."""
    idx = data / "input0" / f"{split}.idx"
    if not idx.exists():
        raise AclFileNotFoundError(
            f"{idx} not found: is {data} a binarized sentence_prediction dataset?"
        )
    with open(idx, "rb") as f:
        if f.read(9) == b"MMIDIDX\x00\x00":
            f.read(8 + 1)  # version, dtype code
            return struct.unpack("<Q", f.read(8))[0]
    from fairseq.data import data_utils

    dataset = data_utils.load_indexed_dataset(str(data / "input0" / split), None)
    return len(dataset)


def count_classes(data: Path) -> int:
    """Labels with a non-zero count in ``DATA/label/dict.txt`` (``FileNotFoundError`` when
    missing)."""
    path = data / "label" / "dict.txt"
    if not path.exists():
        raise AclFileNotFoundError(f"{path} not found: pass --num-classes")
    n = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] != "<mask>" and parts[1].lstrip("-").isdigit():
            n += int(parts[1]) > 0
    return n


def load_batches(
    task: Any,
    split: str,
    batch_size: int,
    max_examples: int | None = None,
    device: torch.device | str = "cpu",
    max_positions: Any = None,
) -> list[tuple[Tensor, Tensor]]:
    """The first ``max_examples`` examples of ``split`` in file order, as ``(src_tokens B x T,
    target B)`` batches on ``device``, unshuffled; longer than ``max_positions``: skipped."""
    if split not in task.datasets:
        task.load_dataset(split)
    dataset = task.dataset(split)
    if max_examples is not None:
        dataset = FirstExamples(dataset, max_examples)
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_sentences=batch_size,
        max_positions=max_positions,
        ignore_invalid_inputs=True,
        seed=1,
        num_workers=0,
    ).next_epoch_itr(shuffle=False)
    batches = [
        (sample["net_input"]["src_tokens"].to(device), sample["target"].view(-1).to(device))
        for sample in itr
    ]
    if not batches:
        raise AclValueError(f"split {split!r} has no examples")
    return batches


class FirstExamples(BaseWrapperDataset):
    """A split's first ``n`` examples in file order (the first ``n`` in the task's length order
    would be its shortest, flattering accuracy and speed)."""

    def __init__(self, dataset: Any, n: int):
        super().__init__(dataset)
        self.n = n

    def ordered_indices(self) -> np.ndarray:
        order = np.asarray(self.dataset.ordered_indices())
        return order[order < self.n]
