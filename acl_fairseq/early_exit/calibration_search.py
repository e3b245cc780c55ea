"""The exact search behind per-exit thresholds (``early_exit.calibrate``), in numpy.

The split is one pass over every exit, ``[(layer, N x K logits)]`` by layer with the final
exit last, and a reference per row (gold labels, or the final exit's predictions for the
agreement constraint); a configuration is, per shallow exit, a *cut* (the rows whose confidence
ranks at or below it leave there; ``NEVER``: none) and whether the exit is evaluated at all.

1. *Lagrangian coordinate descent.* For a price ``lam`` (layers per error) minimise
   ``cost + lam * errors`` one exit at a time: with the other cuts fixed, the rows that reach
   exit ``e`` either leave there (cost: its depth; right or wrong per its argmax) or go on to
   the rest of the policy (a cost and a verdict that do not depend on ``e``'s cut). Leaving is
   a prefix of the rows sorted by confidence, so the best cut is the best prefix of the per-row
   difference: exact, in ``O(N log N)``. Sweeps repeat until nothing changes (the objective
   never increases). ``lam`` runs down a geometric grid, each start warm from the last, tracing
   cost against errors from full depth to the first exit.
2. *Candidates:* every configuration visited, and the starts given (the best single threshold).
3. *Polish:* from the ten cheapest feasible candidates, the same descent with the error budget
   as a constraint (each exit's best feasible cut, exactly); then pair moves (every cut of one
   exit, within 32 values of the current one, with the best feasible cut of another) until none
   lowers the cost. On small splits the result equals brute force over every combination of
   cuts (tested).

``cost``: the exit layer, plus ``head_cost`` (in layers) per shallow exit a row passes through;
with ``skip`` an exit may be left out (its head not evaluated) when it does not pay for itself.
Thresholds are set strictly between two neighbouring confidence values of the split (float32,
as the policies compute them), so the policy's decisions on the split are the ones counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from torch import Tensor

from ..portable import decide as host
from .per_exit import PerExitPolicy, per_exit_policy
from .policies import on_host
from .thresholds import ExitLogits, TargetError

__all__ = ["NEVER", "KINDS", "Split", "cut_threshold", "error_budget", "never_threshold",
           "policy_of", "search", "single_cuts"]  # fmt: skip

NEVER = -1  # "no row leaves here" as a cut index
KINDS = ("entropy", "maxprob")
"""The single kinds whose rule a per-exit threshold applies."""


class Split:
    """The split as arrays: confidences sorted per exit, correctness, patience exits."""

    def __init__(
        self, exit_logits: ExitLogits, targets: Tensor, kind: str, patience: int | None
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if len(exit_logits) < 2:
            raise ValueError("calibration needs at least one shallow exit")
        targets = targets.view(-1).cpu()
        self.kind = kind
        self.layers = [int(layer) for layer, _ in exit_logits]
        self.n = int(targets.numel())
        preds = [x.argmax(dim=-1).cpu() for _, x in exit_logits]
        self.correct = np.stack([p.eq(targets).numpy() for p in preds], axis=1)  # N x (E+1)
        scores = []  # "smaller = more confident", float32 as the decision computes them
        for _, x in exit_logits[:-1]:
            if kind == "entropy":
                scores.append(host.entropy(on_host(x)))
            else:
                scores.append(-host.maxprob(on_host(x)))
        self.scores = np.stack(scores, axis=1).astype(np.float32)  # N x E
        # per exit: distinct values ascending; rank[r, e] = index of the row's value
        self.values, self.rank = [], []
        for e in range(self.scores.shape[1]):
            values, rank = np.unique(self.scores[:, e], return_inverse=True)
            self.values.append(values)
            self.rank.append(rank)
        self.rank = np.stack(self.rank, axis=1)
        self.forced = np.zeros_like(self.correct[:, :-1], dtype=bool)  # patience exits
        if patience is not None:  # PABEE's counter over all shallow exits
            counter = np.zeros(self.n, dtype=np.int64)
            prev = np.full(self.n, -1)
            for e in range(len(preds) - 1):
                pred = preds[e].numpy()
                counter = np.where(pred == prev, counter + 1, 0)
                self.forced[:, e] = counter >= patience
                prev = pred

    @property
    def num_shallow(self) -> int:
        return self.scores.shape[1]

    def run(self, cuts: Sequence[int], active: Sequence[bool], head_cost: float):
        """Per row ``(cost, error)`` of a configuration: at exit e rows with
        ``rank <= cuts[e]`` leave (``NEVER``: none), and inactive exits are skipped."""
        n, num = self.n, self.num_shallow
        exit_at = np.full(n, num)  # index into layers; num = the final exit
        undecided = np.ones(n, dtype=bool)
        for e in range(num):
            if not active[e]:
                continue
            leave = undecided & ((self.rank[:, e] <= cuts[e]) | self.forced[:, e])
            exit_at[leave] = e
            undecided &= ~leave
        return self._outcome(exit_at, active, head_cost)

    def _outcome(self, exit_at: np.ndarray, active: Sequence[bool], head_cost: float):
        layers = np.asarray(self.layers)
        heads_before = np.cumsum(np.asarray(active, dtype=np.float64))  # evaluated up to e
        heads_before = np.append(heads_before, heads_before[-1] if len(heads_before) else 0.0)
        cost = layers[exit_at] + head_cost * heads_before[exit_at]
        error = 1 - self.correct[np.arange(self.n), exit_at]
        return cost.astype(np.float64), error.astype(np.float64)

    def threshold(self, e: int, cut: int) -> float:
        """The policy threshold that lets out the rows with rank ``<= cut`` at exit ``e``."""
        values = self.values[e]
        if cut == NEVER:
            return never_threshold(self.kind)
        if cut >= len(values) - 1:
            return math.inf if self.kind == "entropy" else 0.0  # every row
        return cut_threshold(self.kind, float(values[cut]), float(values[cut + 1]))


def never_threshold(kind: str) -> float:
    return 0.0 if kind == "entropy" else 1.5  # H < 0, p >= 1.5: nobody leaves


def cut_threshold(kind: str, low: float, high: float) -> float:
    """A threshold that lets out the score ``low`` and keeps ``high`` (scores: entropy, or
    minus the top probability; ``low < high``), checked in float32 as the policies compare.

    entropy (leaves when H < t): ``low < t <= high``; maxprob (leaves when p >= t):
    ``-high < t <= -low``. The midpoint, rounded to 6 significant digits when that stays
    inside, else the inclusive end.
    """
    a, b = (low, high) if kind == "entropy" else (-high, -low)
    mid = float(np.float32((a + b) / 2))
    value = mid if a < mid <= b else b
    rounded = float(f"{value:.6g}")
    return rounded if a < float(np.float32(rounded)) <= b else value


class _Options(NamedTuple):
    """What exit ``e`` can do, the other exits fixed (totals over the split)."""

    cost: float  # exit e active, nobody leaves there (patience still applies)
    errors: float
    cut_cost: np.ndarray  # per cut (distinct value index): change in total cost
    cut_errors: np.ndarray  # ... and in total errors
    drop: tuple[float, float] | None  # (cost, errors) with exit e left out, if allowed


def _options(split: Split, cuts, active, e: int, head_cost: float, skip: bool) -> _Options:
    """Exit ``e``'s options: rows reaching it either leave there (a prefix of them sorted by
    confidence) or go on to the rest of the policy, whose outcome does not depend on ``e``."""
    num, n = split.num_shallow, split.n
    exit_at = np.full(n, num)  # where rows leave when nobody leaves at e by confidence
    undecided = np.ones(n, dtype=bool)
    reach = undecided
    for k in range(num):
        if k == e:
            reach = undecided.copy()
            leave = undecided & split.forced[:, k]  # patience still lets these out
        elif active[k]:
            leave = undecided & (split.forced[:, k] | (split.rank[:, k] <= cuts[k]))
        else:
            continue
        exit_at[leave] = k
        undecided &= ~leave
    on = list(active)
    on[e] = True
    stay_cost, stay_err = split._outcome(exit_at, on, head_cost)
    free = np.nonzero(reach & ~split.forced[:, e])[0]
    heads = float(np.cumsum(np.asarray(on, dtype=np.float64))[e])
    leave_cost = split.layers[e] + head_cost * heads
    leave_err = 1.0 - split.correct[free, e]
    bins = len(split.values[e])
    rank = split.rank[free, e]
    cut_cost = np.cumsum(np.bincount(rank, weights=leave_cost - stay_cost[free], minlength=bins))
    cut_errors = np.cumsum(np.bincount(rank, weights=leave_err - stay_err[free], minlength=bins))
    drop = None
    if skip and not split.forced[:, e].any():
        off = list(active)
        off[e] = False
        drop_cost, drop_err = split._outcome(exit_at, off, head_cost)
        drop = (float(drop_cost.sum()), float(drop_err.sum()))
    return _Options(float(stay_cost.sum()), float(stay_err.sum()), cut_cost, cut_errors, drop)


def _choose(
    options: _Options, cuts, active, e: int, lam: float | None, max_errors: float
) -> tuple[list[int], list[bool]]:
    """Exit ``e``'s best option: the least ``cost + lam * errors`` (``lam`` given), or the
    least cost within ``max_errors`` (``lam=None``; ties: fewer errors)."""
    costs = np.concatenate([[options.cost], options.cost + options.cut_cost])
    errors = np.concatenate([[options.errors], options.errors + options.cut_errors])
    choices = [NEVER, *range(len(options.cut_cost))]
    if options.drop is not None:
        costs = np.append(costs, options.drop[0])
        errors = np.append(errors, options.drop[1])
        choices.append(None)  # left out
    if lam is None:
        ok = errors <= max_errors + 1e-9
        if not ok.any():  # keep the current configuration
            return list(cuts), list(active)
        key = np.where(ok, costs, np.inf)
        best = int(np.lexsort((errors, key))[0])
    else:
        best = int(np.argmin(costs + lam * errors))  # ties: the most conservative
    new_cuts, new_active = list(cuts), list(active)
    if choices[best] is None:
        new_cuts[e], new_active[e] = NEVER, False
    else:
        new_cuts[e], new_active[e] = choices[best], True
    return new_cuts, new_active


def _lambdas(split: Split) -> list[float]:
    """Prices from 'an error costs every layer of every row' down to nearly free."""
    top = float(split.layers[-1]) * split.n
    return [top * 0.7**i for i in range(80)] + [0.0]


def search(
    split: Split,
    max_errors: float,
    head_cost: float,
    skip: bool,
    starts: Sequence[tuple[list[int], list[bool]]],
    polish_starts: int = 10,
) -> tuple[list[int], list[bool]]:
    num = split.num_shallow
    seen: dict[tuple, tuple[float, float]] = {}

    def score(cuts, active) -> tuple[float, float]:
        key = (tuple(cuts), tuple(active))
        if key not in seen:
            cost, err = split.run(cuts, active, head_cost)
            seen[key] = (float(cost.sum()), float(err.sum()))
        return seen[key]

    for start in starts:
        score(*start)
    cuts, active = [NEVER] * num, [True] * num
    for lam in _lambdas(split):
        cuts, active = _descend(split, cuts, active, head_cost, skip, lam, max_errors, score)
    # polish the cheapest feasible configurations (without patience full depth is one) with the same
    # descent, the target as a constraint instead of a price; keep the best result
    feasible = sorted((c, err, key) for key, (c, err) in seen.items() if err <= max_errors + 1e-9)
    if not feasible:  # only with patience, which lets rows out whatever the thresholds
        raise TargetError(
            f"patience alone costs more than the allowed {max_errors:g} errors on the split "
            "(with every threshold at 'never'): allow a larger drop or a larger patience"
        )
    results = []
    for _, _, (start_cuts, start_active) in feasible[:polish_starts]:
        config = _descend(
            split, list(start_cuts), list(start_active), head_cost, skip, None, max_errors, score
        )
        results.append((*score(*config), config))
    cuts, active = min(results, key=lambda r: (r[0], r[1]))[2]
    return _pair_moves(split, cuts, active, head_cost, skip, max_errors, score)


def _pair_moves(split: Split, cuts, active, head_cost, skip, max_errors, score, window=32):
    """Escape the descent's local optima: for every exit ``e`` and every cut of it within
    ``window`` distinct values of the current one, the best feasible cut of every other exit
    ``f`` (exact, as in the descent); take the best improving pair, repeat until none
    improves."""
    while True:
        cost, errors = score(cuts, active)
        best = (cost - 1e-9, errors, None)
        for e in range(split.num_shallow):
            if not active[e]:
                continue
            low, high = max(NEVER, cuts[e] - window), min(len(split.values[e]), cuts[e] + window)
            for cut in range(low, high + 1):
                if cut == cuts[e] or cut >= len(split.values[e]):
                    continue
                moved = list(cuts)
                moved[e] = cut
                for f in range(split.num_shallow):
                    if f == e:
                        continue
                    options = _options(split, moved, active, f, head_cost, skip)
                    new = _choose(options, moved, active, f, None, max_errors)
                    new_cost, new_errors = score(*new)
                    if new_errors <= max_errors + 1e-9 and (new_cost, new_errors) < best[:2]:
                        best = (new_cost, new_errors, new)
        if best[2] is None:
            return cuts, active
        cuts, active = best[2]


def _descend(split: Split, cuts, active, head_cost, skip, lam, max_errors, score):
    """Coordinate descent, one exit at a time, until no exit changes (at most 50 sweeps);
    a step is taken only if it lowers the objective, so the search cannot cycle."""

    def better(new, old) -> bool:
        (new_cost, new_err), (old_cost, old_err) = score(*new), score(*old)
        if lam is not None:
            return new_cost + lam * new_err < old_cost + lam * old_err - 1e-9
        if new_err > max_errors + 1e-9:
            return False
        return new_cost < old_cost - 1e-9 or (
            new_cost <= old_cost + 1e-9 and new_err < old_err - 1e-9
        )

    for _sweep in range(50):
        changed = False
        for e in range(split.num_shallow):
            new = _choose(
                _options(split, cuts, active, e, head_cost, skip), cuts, active, e, lam, max_errors
            )
            if new != (cuts, active) and better(new, (cuts, active)):
                cuts, active = new
                changed = True
        if not changed:
            break
    return cuts, active


def policy_of(split: Split, cuts, active, patience: int | None) -> PerExitPolicy:
    """The policy of a configuration; without patience an exit nobody leaves at is left out
    (its head need not run: the same decisions), and so are the exits after one every row
    leaves at."""
    keep = []
    for e in range(split.num_shallow):
        if active[e] and (patience is not None or cuts[e] != NEVER):
            keep.append(e)
            if cuts[e] >= len(split.values[e]) - 1:
                break  # every row leaves here: later exits are never reached
    layers = tuple(split.layers[e] for e in keep)
    thresholds = tuple(split.threshold(e, cuts[e]) for e in keep)
    return per_exit_policy(split.kind, layers, thresholds, patience)


def error_budget(split: Split, max_accuracy_drop: float) -> float:
    """The errors allowed on the split: the final exit's, plus ``max_accuracy_drop`` percent
    of the rows."""
    if not max_accuracy_drop >= 0:
        raise ValueError(f"max_accuracy_drop must be >= 0 points, got {max_accuracy_drop}")
    full_errors = float(split.n - split.correct[:, -1].sum())
    return full_errors + max_accuracy_drop * split.n / 100.0


def single_cuts(split: Split, max_errors: float, head_cost: float):
    """``(cuts, value)`` of the best single threshold: rows whose score is at most ``value``
    (a distinct score of the split; None: nobody) leave at every exit."""
    pooled = np.unique(split.scores)
    best = None
    active = [True] * split.num_shallow
    for v in [None, *pooled.tolist()]:
        if v is None:
            cuts = [NEVER] * split.num_shallow
        else:
            cuts = [
                int(np.searchsorted(split.values[e], np.float32(v), side="right")) - 1
                for e in range(split.num_shallow)
            ]
        cost, err = split.run(cuts, active, head_cost)
        key = (float(cost.sum()), float(err.sum()))
        if key[1] <= max_errors + 1e-9 and (best is None or key < best[0]):
            best = (key, cuts, v, pooled)
    assert best is not None  # nobody leaving is always feasible
    return best[1], best[2], best[3]
