"""How much of a split a policy may be chosen from, and the policies a degenerate fit makes.

A policy fitted to a few rows is whatever those rows allow: on one row every exit agrees with
the final one, so the fastest policy "within the target" lets every row leave at the first exit
(``entropy:inf``, ``per_exit_entropy:1=inf``, a learned model with every weight 0), and the
sweep would deploy it. The rule, checked before anything is fitted (:func:`check_split`):

* every kind: at least :data:`MIN_PER_CLASS` rows of each of the head's classes (by the gold
  labels; without labels, ``MIN_PER_CLASS`` times the classes in all);
* ``learned`` (a logistic model of "this exit agrees with the final exit"): both outcomes in
  the rows every cross-fitting fold is fitted on, and in the whole split (a (row, shallow exit)
  that agrees and one that does not); with one outcome the fit has nothing to separate and its
  weights are all 0.

:class:`TooLittleEvidence` names the split, its size and the size needed, in one line. A
policy that passes and still decides without looking at the row (:func:`degenerate`: it lets a
row with uniform probabilities, no confidence at all, leave at its first exit) is deployed only
with a warning (the sweep prints it and the saved file records it). Pure torch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import AclValueError
from .policies import ExitPolicy
from .thresholds import ExitLogits, simulate_exits

__all__ = ["MIN_PER_CLASS", "TooLittleEvidence", "check_learned", "check_split", "degenerate"]

MIN_PER_CLASS = 5
"""Rows of each class a split needs before a policy is chosen from it."""


class TooLittleEvidence(AclValueError):
    """A split too small (or too one-sided) for the policy kind: nothing is fitted or saved."""


def _class_counts(exit_logits: ExitLogits, targets: Tensor | None) -> tuple[list[int], int]:
    """Rows of each class (gold labels; None: no labels) and the number of classes."""
    classes = int(exit_logits[-1][1].size(-1))
    if targets is None:
        return [], classes
    labels = targets.view(-1).long().cpu()
    counts = torch.bincount(labels.clamp(0, classes - 1), minlength=classes).tolist()
    return counts, classes


def _rows(n: int) -> str:
    return f"{n} row{'' if n == 1 else 's'}"


def check_split(
    exit_logits: ExitLogits, targets: Tensor | None, kind: str, split: str = "the split"
) -> None:
    """Raises :class:`TooLittleEvidence` when ``split`` (its one-pass exit logits and gold
    labels, None without) is too small for choosing a ``kind`` policy (the module's rule)."""
    n = int(exit_logits[-1][1].size(0))
    counts, classes = _class_counts(exit_logits, targets)
    need = MIN_PER_CLASS * classes
    if counts and min(counts) < MIN_PER_CLASS:
        shown = ", ".join(f"class {c}: {k}" for c, k in enumerate(counts))
        raise TooLittleEvidence(
            f"{split} has {_rows(n)} ({shown}): choosing an early-exit policy needs at least "
            f"{MIN_PER_CLASS} rows of each of the {classes} classes: use a larger split (at "
            f"least {need} rows, {MIN_PER_CLASS} of each class)"
        )
    if not counts and n < need:
        raise TooLittleEvidence(
            f"{split} has {_rows(n)}: choosing an early-exit policy needs at least {need} "
            f"({MIN_PER_CLASS} per class of the {classes}): use a larger split"
        )
    if kind == "learned":
        check_learned(exit_logits, split)


def check_learned(
    exit_logits: ExitLogits, split: str = "the split", folds: int | None = None, seed: int = 0
) -> None:
    """Raises :class:`TooLittleEvidence` unless the rows of every cross-fitting fold's fit
    (``learned_calibration.cross_fit``'s folds) and the whole split hold both outcomes: a
    shallow exit that agrees with the final exit and one that does not."""
    from .learned_calibration import FOLDS, fold_ids

    if len(exit_logits) < 2:
        return
    final = exit_logits[-1][1].argmax(dim=-1).cpu()
    agree = torch.stack([x.argmax(dim=-1).cpu().eq(final) for _, x in exit_logits[:-1]], 1)
    n = agree.size(0)
    differs = int((~agree).any(dim=1).sum())  # rows where some shallow exit disagrees
    alike = int(agree.any(dim=1).sum())  # rows where some shallow exit agrees
    if not differs:
        raise TooLittleEvidence(
            f"on {split} every shallow exit agrees with the final exit on all {n} rows: the "
            "learned kind has one outcome to fit (its weights would all be 0): use a larger "
            "split, or another kind (--policy entropy or per_exit_entropy)"
        )
    if not alike:
        raise TooLittleEvidence(
            f"on {split} no shallow exit agrees with the final exit on any of the {n} rows: "
            "the learned kind has one outcome to fit and early exit would change every "
            "prediction: train the shallow exits longer"
        )
    folds = min(FOLDS if folds is None else folds, n // 2)
    if folds < 2:
        return
    fold_of = fold_ids(n, folds, seed)
    for k in range(folds):
        fitted = agree[fold_of.ne(k)]
        if bool(fitted.all()) or not bool(fitted.any()):
            need = math.ceil(n * 2 * folds / min(differs, alike))
            raise TooLittleEvidence(
                f"{split} has {n} rows, {differs} where a shallow exit disagrees with the "
                f"final exit: the learned kind's cross-fitting fold {k + 1} of {folds} would "
                "be fitted on rows of one outcome only (its weights all 0): use a larger split "
                f"(about {need} rows: at least 2 of each outcome per fold), or another kind "
                "(--policy entropy)"
            )


def degenerate(policy: ExitPolicy, exit_logits: ExitLogits) -> str:
    """Why ``policy`` decides without looking at the row, in a few words (it lets a row with
    uniform probabilities leave at its first exit), or "" when it does not."""
    shallow = [layer for layer, _ in exit_logits[:-1]]
    used = policy.exits(shallow)
    if not used or policy.never_exits(len(used)):
        return ""
    classes = int(exit_logits[-1][1].size(-1))
    uniform = [(layer, torch.zeros(1, classes)) for layer, _ in exit_logits]
    layers, _ = simulate_exits(uniform, policy)
    first = min(used)
    if int(layers[0]) != first:
        return ""
    return (
        f"{policy.spec} lets every row leave at exit {first} whatever its confidence (a row "
        "with uniform probabilities too): no row of the split argued against it"
    )
