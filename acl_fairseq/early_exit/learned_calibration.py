"""The learned exit decision fitted to a split: cross-fitting and an exact threshold search.

From one pass over every exit (``[(layer, N x K logits)]``, the final exit last):

1. *Cross-fitting* (``cross_fit``): the rows are dealt into ``folds`` folds (a seeded
   permutation); for each fold a logistic model (``learned.fit_logistic``) is fitted on the
   other folds' (row, shallow exit) pairs, labelled "this exit's argmax equals the final
   exit's", and scores the fold's rows: out-of-fold probabilities, as honest as new data. The
   model deployed is fitted on every row.
2. *Threshold* (``best_threshold``): a row leaves at the first exit whose probability (its
   logit, as the policy compares it) is ``>= t``, so its exit moves only where ``t`` passes
   a new running maximum of its scores; sweeping those values from the top gives the cost and
   errors of every distinct threshold in ``O(NE log NE)``: the cheapest within the error
   budget on the out-of-fold scores, exactly (``probability_threshold`` writes it as a
   probability).

``calibrate_learned`` does both for a target (``early_exit.calibrate``'s constraints);
``risk_controlled_learned`` builds the family on one half of the split and certifies it on the
other (``risk_control``). Pure torch / numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .evidence import check_learned
from .learned import LearnedPolicy, fit_logistic, probability_logit, split_features
from .thresholds import ExitLogits

__all__ = [
    "CrossFit",
    "Cut",
    "best_threshold",
    "calibrate_learned",
    "cross_fit",
    "exit_costs",
    "fold_ids",
    "learned_family",
    "probability_threshold",
]

FOLDS = 5
L2 = 1e-3
NEVER = 2.0  # a threshold no probability reaches


class CrossFit(NamedTuple):
    """Out-of-fold logits (N x E float32; the probabilities' sigmoid arguments) and the model
    fitted on every row."""

    scores: Tensor
    model: LearnedPolicy  # at threshold ``NEVER``


def _fitted(features: Tensor, labels: Tensor, l2: float) -> LearnedPolicy:
    """The policy of a fit, its weights rounded to float32's precision (as it runs)."""
    weights, bias = fit_logistic(features, labels, l2)
    short = tuple(float(f"{float(w):.9g}") for w in weights.float())
    return LearnedPolicy(NEVER, short, float(f"{bias:.9g}"))


def fold_ids(n: int, folds: int, seed: int = 0) -> Tensor:
    """The fold (0 .. folds - 1) of each of ``n`` rows: a seeded permutation dealt in turn."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    fold_of = torch.empty(n, dtype=torch.long)
    fold_of[order] = torch.arange(n) % folds
    return fold_of


def cross_fit(
    exit_logits: ExitLogits, folds: int = FOLDS, l2: float = L2, seed: int = 0
) -> CrossFit:
    """Out-of-fold probabilities of every (row, shallow exit) and the model fitted on all rows
    (module docstring). With fewer than ``2 * folds`` rows, one fold per row pair at least
    (``folds = N // 2``; a single row is scored in-sample)."""
    if len(exit_logits) < 2:
        raise ValueError("the learned policy needs at least one shallow exit")
    shallow = [x for _, x in exit_logits[:-1]]
    final = exit_logits[-1][1].argmax(dim=-1).cpu()
    features = split_features([x.cpu() for x in shallow])  # N x E x F
    labels = torch.stack([x.argmax(dim=-1).cpu().eq(final) for x in shallow], dim=1)  # N x E
    n, e, f = features.shape
    model = _fitted(features.reshape(-1, f), labels.reshape(-1), l2)
    folds = min(folds, n // 2)
    if folds < 2:
        return CrossFit(model.logit(features), model)
    fold_of = fold_ids(n, folds, seed)
    scores = torch.empty(n, e, dtype=torch.float32)
    for k in range(folds):
        out = fold_of.eq(k)
        fold_model = _fitted(features[~out].reshape(-1, f), labels[~out].reshape(-1), l2)
        scores[out] = fold_model.logit(features[out])
    return CrossFit(scores, model)


def exit_costs(layers: Sequence[int], head_cost: float) -> np.ndarray:
    """The cost of leaving at each exit (``layers``: the shallow ones, then the final): its
    layer plus ``head_cost`` per exit head evaluated up to it (every shallow exit's)."""
    layers = np.asarray(layers, dtype=np.float64)
    heads = np.minimum(np.arange(1, len(layers) + 1), len(layers) - 1)
    return layers + head_cost * heads


class Cut(NamedTuple):
    """A threshold on scores: rows whose score is ``>= high`` leave, and any threshold in
    ``(low, high]`` does the same on the split; its total cost and errors."""

    low: float
    high: float
    cost: float
    errors: float


def best_threshold(
    scores: np.ndarray, costs: np.ndarray, errors: np.ndarray, max_errors: float
) -> Cut:
    """The cheapest threshold on ``scores`` within ``max_errors`` (ties: fewer errors, then
    the higher threshold), exactly.

    A row leaves at the first shallow exit whose score is ``>= threshold``, else at the final.

    Args:
        scores: N x E float32.
        costs: E + 1, the cost of leaving at each exit (the final last).
        errors: N x (E + 1), 1 where the row's answer at that exit counts as an error.
        max_errors: the errors allowed in total.
    Returns:
        the ``Cut``; ``high = inf`` when only full depth fits, ``low = -inf`` when every row
        leaves at the first exit.
    """
    scores = np.asarray(scores, dtype=np.float32)
    errors = np.asarray(errors, dtype=np.float64)
    n, e = scores.shape
    top = float(scores.max()) if scores.size else -math.inf
    best = Cut(top, math.inf, float(costs[e]) * n, float(errors[:, e].sum()))
    if n == 0 or e == 0:
        return best
    running = np.maximum.accumulate(scores, axis=1)
    record = np.ones((n, e), dtype=bool)  # where a row's running maximum rises
    record[:, 1:] = running[:, 1:] > running[:, :-1]
    rows, cols = np.nonzero(record)  # by row, exits ascending
    values = scores[rows, cols]
    # a row's next record (a higher value, later exit) is where it leaves before this one
    nxt = np.full(rows.size, e)
    same_row = rows[1:] == rows[:-1]
    nxt[:-1][same_row] = cols[1:][same_row]
    d_cost = costs[cols] - costs[nxt]
    d_err = errors[rows, cols] - errors[rows, nxt]
    order = np.argsort(-values, kind="stable")
    values = values[order]
    cost = best.cost + np.cumsum(d_cost[order])
    err = best.errors + np.cumsum(d_err[order])
    ends = np.nonzero(np.append(values[1:] != values[:-1], True))[0]  # last of each value
    for i in ends:
        c, r = float(cost[i]), float(err[i])
        if r > max_errors + 1e-9:
            continue
        if c < best.cost - 1e-9 or (c <= best.cost + 1e-9 and r < best.errors):
            low = float(values[i + 1]) if i + 1 < values.size else -math.inf
            best = Cut(low, float(values[i]), c, r)
    return best


def probability_threshold(cut: Cut) -> float:
    """A probability threshold whose logit (``probability_logit``) lies in ``cut``'s
    ``(low, high]`` (scores: logits): 0 lets every row out, ``NEVER`` none; else the sigmoid
    of the midpoint, as short as it stays inside."""
    if cut.high == math.inf:
        return NEVER
    if cut.low == -math.inf:
        return 0.0
    candidates = []
    for z in ((cut.low + cut.high) / 2, cut.high):
        p = 1.0 / (1.0 + math.exp(-z))
        candidates += [float(f"{p:.{digits}g}") for digits in (6, 9)] + [p]
    for p in candidates:
        if cut.low < probability_logit(p) <= cut.high:
            return p
    return candidates[-1]  # a logit so large that its sigmoid rounds to 1 in float64


def calibrate_learned(
    exit_logits: ExitLogits,
    reference: Tensor,
    max_accuracy_drop: float,
    head_cost: float = 0.0,
    fit: CrossFit | None = None,
) -> LearnedPolicy:
    """The learned policy for a target: the model fitted on every row, at the cheapest
    threshold whose out-of-fold decisions make at most the final exit's errors against
    ``reference`` (gold labels, or the final exit's predictions) plus ``max_accuracy_drop``
    percent of the rows. ``fit``: a ``cross_fit`` of the same split, to reuse (without one,
    a split whose folds hold one outcome raises ``evidence.TooLittleEvidence``)."""
    if not max_accuracy_drop >= 0:
        raise ValueError(f"max_accuracy_drop must be >= 0 points, got {max_accuracy_drop}")
    if fit is None:
        check_learned(exit_logits)
        fit = cross_fit(exit_logits)
    reference = reference.view(-1).cpu()
    preds = torch.stack([x.argmax(dim=-1).cpu() for _, x in exit_logits], dim=1)
    errors = preds.ne(reference.unsqueeze(1)).numpy()
    n = errors.shape[0]
    budget = float(errors[:, -1].sum()) + max_accuracy_drop * n / 100.0
    costs = exit_costs([layer for layer, _ in exit_logits], head_cost)
    cut = best_threshold(fit.scores.numpy(), costs, errors, budget)
    return fit.model.with_threshold(probability_threshold(cut))


def learned_family(
    exit_logits: ExitLogits,
    drops: Sequence[float],
    head_cost: float = 0.0,
    fit: CrossFit | None = None,
) -> list[LearnedPolicy]:
    """The distinct policies ``calibrate_learned`` finds (agreement with the final exit) at
    each of ``drops``, from the most to the least conservative (highest threshold first)."""
    if fit is None:
        check_learned(exit_logits, "the half of the split the family is fitted on")
        fit = cross_fit(exit_logits)
    final = exit_logits[-1][1].argmax(dim=-1)
    found = {calibrate_learned(exit_logits, final, d, head_cost, fit) for d in drops}
    return sorted(found, key=lambda p: -p.threshold)
