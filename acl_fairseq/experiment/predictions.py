"""Per-example predictions of a trained run (``predictions.tsv``), for paired tests over
examples: computed (:func:`predict_split`), written and read here.

One row per example of each split, in the split's order: ``split index label exit1 ...``;
``exitL`` is the class the exit at layer ``L`` predicts (the last column: the final exit),
classes as ``sample["target"]`` holds them.
"""

from __future__ import annotations

import csv
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..atomic_write import open_atomic
from ..autocast import forward_precision
from ..errors import AclValueError

__all__ = [
    "PREDICTIONS_FILE",
    "SplitPredictions",
    "predict_split",
    "read_predictions",
    "write_predictions",
]

PREDICTIONS_FILE = "predictions.tsv"


@dataclass
class SplitPredictions:
    """Gold labels and every exit's prediction for the N examples of one split."""

    split: str
    labels: list[int]  # N, by example index
    exits: dict[int, list[int]]  # layer -> N predictions; the largest layer is the final exit

    @property
    def final(self) -> list[int]:
        """The final exit's predictions (N)."""
        return self.exits[max(self.exits)]

    def correct(self, layer: int | None = None) -> list[bool]:
        """Per example: the exit at ``layer`` (default: the final exit) is right."""
        preds = self.final if layer is None else self.exits[layer]
        return [p == y for p, y in zip(preds, self.labels)]

    def accuracy(self, layer: int | None = None) -> float:
        """Accuracy in percent of the exit at ``layer`` (default: the final exit)."""
        right = self.correct(layer)
        return 100.0 * sum(right) / len(right) if right else float("nan")


def predict_split(
    model: Any, task: Any, split: str, batch_size: int = 64, head: str | None = None
) -> SplitPredictions:
    """Every exit's prediction for every example of ``split`` (a plain RoBERTa: its final
    head), run as the task validates (under its ``--autocast``)."""

    head = head or getattr(task.cfg, "classification_head_name", "sentence_classification_head")
    if split not in task.datasets:
        task.load_dataset(split)
    dataset = task.dataset(split)
    device = next(model.parameters()).device
    size = len(dataset)
    labels = [-1] * size
    exits: dict[int, list[int]] = {}
    autocast = str(getattr(task, "autocast", "none"))
    with torch.no_grad(), forward_precision(autocast, model), warnings.catch_warnings():
        # fairseq's iterator asks torch's data loader to pin memory: no accelerator, a warning
        warnings.filterwarnings("ignore", message=".*pin_memory", category=UserWarning)
        iterator = task.get_batch_iterator(
            dataset=dataset, max_sentences=batch_size, ignore_invalid_inputs=False, num_workers=0
        ).next_epoch_itr(shuffle=False)
        for sample in iterator:
            ids = sample["id"].tolist()
            tokens = sample["net_input"]["src_tokens"].to(device)
            for i, y in zip(ids, sample["target"].view(-1).tolist()):
                labels[i] = int(y)
            for layer, logits in _exit_logits(model, tokens, head):
                column = exits.setdefault(layer, [-1] * size)
                for i, p in zip(ids, logits.argmax(dim=-1).tolist()):
                    column[i] = int(p)
    missing = [i for i, y in enumerate(labels) if y < 0]
    if missing:
        raise RuntimeError(f"split {split!r}: no prediction for {len(missing)} example(s)")
    return SplitPredictions(split, labels, dict(sorted(exits.items())))


def _exit_logits(model: Any, tokens: torch.Tensor, head: str) -> Iterable[tuple[int, Any]]:
    """``(layer, B x K logits)`` of every exit of ``model`` on ``tokens`` (B x T)."""
    if hasattr(model, "exit_outputs"):
        return [(o.layer, o.logits) for o in model.exit_outputs(tokens, head)]
    layers = len(model.encoder.sentence_encoder.layers)
    return [(layers, model(tokens, classification_head_name=head)[0])]


def write_predictions(path: str | Path, splits: Sequence[SplitPredictions]) -> Path:
    """Writes ``splits`` to ``path`` (``predictions.tsv``); every split has the same exits."""
    path = Path(path)
    layers = sorted({layer for s in splits for layer in s.exits})
    for s in splits:
        if sorted(s.exits) != layers:
            raise ValueError(f"split {s.split}: exits {sorted(s.exits)}, expected {layers}")
    with open_atomic(path, "w", newline="") as f:  # whole or not at all
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(["split", "index", "label", *(f"exit{layer}" for layer in layers)])
        for s in splits:
            columns = [s.exits[layer] for layer in layers]
            for i, label in enumerate(s.labels):
                writer.writerow([s.split, i, label, *(c[i] for c in columns)])
    return path


def read_predictions(path: str | Path) -> dict[str, SplitPredictions]:
    """``{split: SplitPredictions}`` of a ``predictions.tsv``; a header or row of the wrong
    form is refused, naming the file."""
    path = Path(path)
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    if not rows or rows[0][:3] != ["split", "index", "label"]:
        raise AclValueError(f"{path}: expected the header split<TAB>index<TAB>label<TAB>exitL...")
    try:
        layers = [int(name[len("exit") :]) for name in rows[0][3:]]
    except ValueError:
        raise AclValueError(
            f"{path}: exit columns must be named exitL, got {rows[0][3:]}"
        ) from None
    if not layers:
        raise AclValueError(f"{path}: no exit column")
    out: dict[str, SplitPredictions] = {}
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != 3 + len(layers):
            expected = 3 + len(layers)
            raise AclValueError(f"{path} line {number}: {len(row)} columns, expected {expected}")
        split, index, label, *preds = row
        s = out.setdefault(split, SplitPredictions(split, [], {layer: [] for layer in layers}))
        if int(index) != len(s.labels):
            raise AclValueError(f"{path} line {number}: index {index}, expected {len(s.labels)}")
        s.labels.append(int(label))
        for layer, p in zip(layers, preds):
            s.exits[layer].append(int(p))
    return out
