"""The study's few-shot protocol, run by ``acl-fairseq-fewshot`` and ``python -m studies``.

Per size k and draw d: k per class for training and k for dev, drawn from the pool; every
method trains ``UPDATES`` updates with seed d at each of ``LEARNING_RATES``; the rate best on
dev is chosen (:func:`best_on_dev`) and reported on test (:func:`read_draw`). The protocol:
docs/usage.md, "Few-shot on your own labelled TSV".
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from ..errors import AclValueError
from .predictions import PREDICTIONS_FILE, read_predictions
from .recipe import flag_groups
from .results import RESULT_FILE

__all__ = [
    "LEARNING_RATES",
    "METHODS",
    "DrawResult",
    "FewshotLengthError",
    "best_on_dev",
    "check_positions",
    "compare_args",
    "draw_name",
    "model_positions",
    "protocol_extra",
    "read_draw",
    "run_folder",
    "runs_folder",
]

METHODS = ("ce", "ce_scl", "acl")
NAMES = {"ce": "CE", "ce_scl": "CE+SCL", "acl": "ACL"}
LEARNING_RATES = (1e-4, 2e-4, 5e-4)
UPDATES = 60
VALIDATE_EVERY = 5
CONTRASTIVE_LAMBDA = 0.5
TEMPERATURE = 0.3
BATCH_SIZE = 32
# batches of similar length (the study's batching), and no validation (so no checkpoint) at
# epoch ends: only every VALIDATE_EVERY updates
PROTOCOL_EXTRA = "--group-by-length --validate-interval 1000 --save-interval 1000"

K = TypeVar("K")


class FewshotLengthError(AclValueError):
    """A draw's example longer than the model's positions, before any run trains on it."""


def draw_name(per_class: int, draw: int) -> str:
    """The name of a draw's data folder and runs (``k16-d3``)."""
    return f"k{per_class}-d{draw}"


def runs_folder(out: str | Path, per_class: int, draw: int, lr: float) -> Path:
    """The ``acl-fairseq-compare --out`` of one learning rate of one draw
    (``OUT/runs/k16-d3/lr0.0001``)."""
    return Path(out) / "runs" / draw_name(per_class, draw) / f"lr{lr:g}"


def run_folder(out: str | Path, per_class: int, draw: int, lr: float, method: str) -> Path:
    """One method's run there (``.../lr0.0001/runs/acl-seed3``: the draw is its seed)."""
    return runs_folder(out, per_class, draw, lr) / "runs" / f"{method}-seed{draw}"


def protocol_extra(extra: str = "") -> str:
    """The fairseq-train flags of every run: ``PROTOCOL_EXTRA``, then those of ``extra`` it
    does not already set the same way (a flag given twice is one setting, not another run).
    ``ValueError`` for an ``extra`` that does not split (an unclosed quote)."""
    protocol = flag_groups(shlex.split(PROTOCOL_EXTRA))
    own = [g for g in flag_groups(shlex.split(extra)) if g not in protocol]
    return " ".join([PROTOCOL_EXTRA, *own])


def compare_args(
    data: str | Path,
    out: str | Path,
    draw: int,
    lr: float,
    methods: Sequence[str] = METHODS,
    updates: int = UPDATES,
    validate_every: int = VALIDATE_EVERY,
    batch_size: int = BATCH_SIZE,
    lam: float = CONTRASTIVE_LAMBDA,
    temperature: float = TEMPERATURE,
    model: Sequence[str] = (),
    extra: str = "",
) -> list[str]:
    """The ``acl-fairseq-compare`` arguments of one learning rate of one draw (seed ``draw``,
    ``updates`` updates, validated every ``validate_every``); ``model``: the model flags;
    ``extra``: more fairseq-train flags (:func:`protocol_extra`)."""
    return [
        str(data), "--out", str(out), "--methods", ",".join(methods), "--seeds", str(draw),
        "--lr", f"{lr:g}", "--max-update", str(updates),
        "--validate-interval-updates", str(validate_every), "--batch-size", str(batch_size),
        "--contrastive-lambda", f"{lam:g}", "--temperature", f"{temperature:g}",
        "--ce-scl-plain", "--extra", protocol_extra(extra), *model,
    ]  # fmt: skip


def best_on_dev(dev_scores: Mapping[K, float]) -> K:
    """The key (a learning rate, a grid point) with the best dev score; among ties the first
    in the mapping's (the grid's) order."""
    keys = list(dev_scores)
    return max(keys, key=lambda k: (dev_scores[k], -keys.index(k)))


@dataclass(frozen=True)
class DrawResult:
    """One method on one draw, at the learning rate chosen on dev."""

    per_class: int
    draw: int
    method: str
    dev_by_lr: dict[float, float] = field(compare=False)  # dev accuracy at each rate
    test_by_lr: dict[float, float] = field(compare=False)  # test accuracy at each rate
    # per test example, whether the chosen rate's run is right (None: no predictions kept)
    test_correct: tuple[bool, ...] | None = field(default=None, compare=False)

    @property
    def lr(self) -> float:
        return best_on_dev(self.dev_by_lr)

    @property
    def dev(self) -> float:
        return self.dev_by_lr[self.lr]

    @property
    def test(self) -> float:
        return self.test_by_lr[self.lr]


def read_draw(
    out: str | Path, per_class: int, draw: int, methods: Sequence[str], lrs: Sequence[float]
) -> list[DrawResult]:
    """Every method's result on a draw from its runs under ``out``: dev and test accuracy per
    learning rate, the chosen run's per-example predictions; ``FileNotFoundError`` naming the
    first unfinished run."""
    results = []
    for method in methods:
        dev, test, subset = {}, {}, "test"
        for lr in lrs:
            path = run_folder(out, per_class, draw, lr, method) / RESULT_FILE
            if not path.is_file():
                raise FileNotFoundError(f"{path}: not found (the run is not finished)")
            result = json.loads(path.read_text(encoding="utf-8"))
            dev[lr], test[lr] = float(result["dev"]["accuracy"]), float(result["test"]["accuracy"])
            subset = result.get("test_subset", subset)
        found = DrawResult(per_class, draw, method, dev, test)
        predictions = run_folder(out, per_class, draw, found.lr, method) / PREDICTIONS_FILE
        if predictions.is_file():
            split = read_predictions(predictions).get(subset)
            if split is not None:
                found = replace(found, test_correct=tuple(split.correct()))
        results.append(found)
    return results


def _flag(args: Sequence[str], name: str) -> str | None:
    """The last value of ``name`` (``--flag V`` or ``--flag=V``) in ``args``, else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def model_positions(model: Sequence[str], extra: str = "") -> int | None:
    """The positions the runs' model takes: ``--max-positions`` of the model flags
    (``--arch-args-file FILE`` / ``--arch-args '...'`` in ``model``) or ``extra``, else the
    architecture's default; None when it cannot be told (no ``--arch``)."""
    from argparse import Namespace

    arch_file, arch_text = _flag(model, "--arch-args-file"), _flag(model, "--arch-args")
    if arch_file:
        flags = shlex.split(Path(arch_file).read_text(encoding="utf-8"))
    else:
        flags = shlex.split(arch_text or "")
    flags += shlex.split(extra)
    given = _flag(flags, "--max-positions")
    if given is not None:
        return int(given)
    arch = _flag(flags, "--arch") or _flag(flags, "-a")
    from fairseq.models import ARCH_CONFIG_REGISTRY

    if arch not in ARCH_CONFIG_REGISTRY:
        return None
    defaults = Namespace()
    ARCH_CONFIG_REGISTRY[arch](defaults)
    positions = getattr(defaults, "max_positions", None)
    return int(positions) if positions is not None else None


def _sizes(prefix: Path) -> Any:
    """The token counts of a binarized split (a copy: the file's map closes with its
    dataset)."""
    from fairseq.data import indexed_dataset

    dataset = indexed_dataset.make_dataset(str(prefix), impl="mmap")
    sizes = dataset.sizes.astype("int64")
    del dataset
    return sizes


def check_positions(data: str | Path, name: str, positions: int | None, extra: str = "") -> None:
    """Before any run trains on draw ``name`` (its binarized ``data``): an example longer than
    the model's ``positions`` (counting ``<s>`` and the separator, as the task builds it)
    stops here in one line naming ``--shorten-method truncate``, unless ``extra`` passes it
    (training would stop on it after the model is built, deep in the run's log)."""
    if positions is None or _flag(shlex.split(extra), "--shorten-method") == "truncate":
        return
    data = Path(data)
    pair = (data / "input1").is_dir()
    for split in ("train", "valid", "test"):  # the draw's training, dev and test splits
        if not (data / "input0" / f"{split}.idx").is_file():
            continue
        sizes = _sizes(data / "input0" / split) + 1  # <s>
        if pair:
            sizes = sizes + _sizes(data / "input1" / split) + 1  # the separator
        long = int((sizes > positions).sum())
        if long:
            verb = "is" if long == 1 else "are"
            raise FewshotLengthError(
                f"draw {name}: {long} of the {len(sizes)} {split} examples {verb} longer than "
                f"the model's {positions} positions (the longest has {int(sizes.max())} "
                "tokens, counting <s> and the separator): pass --extra '--shorten-method "
                "truncate' to cut them, or shorten the texts"
            )
