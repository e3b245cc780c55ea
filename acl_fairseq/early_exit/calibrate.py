"""Policies fitted to a labelled split for an accuracy target, from one pass over every exit.

Everything works on ``[(layer, N x K logits)]`` by layer with the final exit last
(``thresholds.collect_exits``) and the gold labels (N):

* ``best_single_threshold``: one entropy / max-probability threshold at every exit, chosen
  exactly (every distinct cut of the rows' confidences is tried): the fastest within the target;
* ``best_patience``: the fastest PABEE patience within the target;
* ``calibrate_per_exit``: a per-exit policy (``per_exit``: one threshold per exit, optionally
  PABEE's patience beside them), the fastest within the target (``calibration_search``: exact
  on small splits); on the split it meets the target by construction and costs no more than
  the best single threshold;
* ``calibrate`` with ``learned``: the learned decision (``learned_calibration``);
* ``evaluate``: what a policy does on a split (accuracy, agreement with the final exit, mean
  exit layer, cost).

The target is ``max_accuracy_drop`` points, read per ``constraint``:

* ``accuracy``: the split's accuracy at most that many points below the final exit's. On a few
  hundred dev rows this over-fits: the search exploits the rows whose errors happen to cancel,
  and on test the drop is a multiple of the target (``docs/results.md``).
* ``agreement`` (CALM's consistency): at most that percent of the rows change their prediction
  from the final exit's. Rows that agree are equally right, so this bounds the accuracy drop
  too, and it tracks its target on test: the sweep's default.

``cost``: the mean exit layer plus ``head_cost`` layers per shallow exit a row passes through
(an exit head's time at batch 1, relative to a layer); with ``head_cost > 0`` an exit that lets
too few rows out to pay for its head is left out of a per-exit policy (its head does not run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .calibration_search import (
    NEVER,
    Split,
    cut_threshold,
    error_budget,
    never_threshold,
    policy_of,
    search,
    single_cuts,
)
from .evidence import check_split
from .learned_calibration import calibrate_learned
from .policies import ExitPolicy, PatiencePolicy, make_policy
from .thresholds import ExitLogits, TargetError, simulate_exits

__all__ = [
    "CONSTRAINTS",
    "Calibration",
    "best_patience",
    "best_single_threshold",
    "calibrate",
    "calibrate_per_exit",
    "calibrated_family",
    "evaluate",
    "within",
]

CONSTRAINTS = ("agreement", "accuracy")
"""How a target drop is read (the first is the default)."""


class Calibration(NamedTuple):
    """A policy and what it does on a split (percentages)."""

    policy: ExitPolicy
    accuracy: float
    full_accuracy: float
    agreement: float  # rows whose prediction equals the final exit's
    mean_exit_layer: float
    cost: float  # mean exit layer + head_cost x shallow exits evaluated per row
    layer_speedup: float  # final layer / mean exit layer


def evaluate(
    exit_logits: ExitLogits, targets: Tensor, policy: ExitPolicy, head_cost: float = 0.0
) -> Calibration:
    """``policy`` on a split, from its one-pass exit logits (``simulate_exits``: the batched
    loop's decisions)."""
    layers, preds = simulate_exits(exit_logits, policy)
    shallow = [layer for layer, _ in exit_logits[:-1]]
    used = torch.tensor(policy.exits(shallow), dtype=torch.long)
    heads = (used.unsqueeze(0) <= layers.unsqueeze(1)).sum(dim=1).double()
    targets = targets.view(-1).to(preds.device)
    final = exit_logits[-1][1].argmax(dim=-1)
    mean_layer = float(layers.double().mean())
    return Calibration(
        policy=policy,
        accuracy=100.0 * float(preds.eq(targets).double().mean()),
        full_accuracy=100.0 * float(final.eq(targets).double().mean()),
        agreement=100.0 * float(preds.eq(final).double().mean()),
        mean_exit_layer=mean_layer,
        cost=mean_layer + head_cost * float(heads.mean()),
        layer_speedup=exit_logits[-1][0] / mean_layer,
    )


def _reference(exit_logits: ExitLogits, targets: Tensor | None, constraint: str) -> Tensor:
    """What the target counts errors against: the labels, or the final exit's predictions."""
    if constraint == "agreement":
        return exit_logits[-1][1].argmax(dim=-1)
    if constraint != "accuracy":
        raise ValueError(
            f"--constraint must be one of {', '.join(CONSTRAINTS)}, got {constraint!r}"
        )
    if targets is None:
        raise ValueError("constraint 'accuracy' needs the gold labels (targets)")
    return targets


def _gold(exit_logits: ExitLogits, targets: Tensor | None) -> Tensor:
    return exit_logits[-1][1].argmax(dim=-1) if targets is None else targets


def within(calibration: Calibration, max_accuracy_drop: float, constraint: str) -> bool:
    """True when ``calibration`` meets the target as ``constraint`` reads it."""
    if constraint == "agreement":
        return calibration.agreement >= 100.0 - max_accuracy_drop - 1e-9
    return calibration.accuracy >= calibration.full_accuracy - max_accuracy_drop - 1e-9


def best_single_threshold(
    exit_logits: ExitLogits,
    targets: Tensor | None,
    max_accuracy_drop: float,
    kind: str = "entropy",
    head_cost: float = 0.0,
    constraint: str = "accuracy",
) -> Calibration:
    """The single threshold (every exit) with the lowest cost within the target on the split
    (ties: more accurate); every distinct confidence value of the split is tried."""
    split = Split(exit_logits, _reference(exit_logits, targets, constraint), kind, None)
    _, value, pooled = single_cuts(split, error_budget(split, max_accuracy_drop), head_cost)
    if value is None:
        threshold = never_threshold(kind)
    else:
        above = pooled[pooled > np.float32(value)]
        if above.size:
            threshold = cut_threshold(kind, value, float(above[0]))
        else:
            threshold = math.inf if kind == "entropy" else 0.0
    policy = make_policy(kind, threshold)
    return evaluate(exit_logits, _gold(exit_logits, targets), policy, head_cost)


def best_patience(
    exit_logits: ExitLogits,
    targets: Tensor | None,
    max_accuracy_drop: float,
    head_cost: float = 0.0,
    constraint: str = "accuracy",
) -> Calibration:
    """The fastest ``PatiencePolicy`` within the target on the split (every patience tried;
    patience = the number of shallow exits never leaves early)."""
    gold = _gold(exit_logits, targets)
    _reference(exit_logits, targets, constraint)  # checks the constraint
    best = evaluate(exit_logits, gold, PatiencePolicy(len(exit_logits) - 1), head_cost)
    for patience in range(len(exit_logits) - 2, -1, -1):
        result = evaluate(exit_logits, gold, PatiencePolicy(patience), head_cost)
        if within(result, max_accuracy_drop, constraint) and result.cost < best.cost:
            best = result
    return best


def calibrate_per_exit(
    exit_logits: ExitLogits,
    targets: Tensor | None,
    max_accuracy_drop: float,
    kind: str = "entropy",
    patience: int | None = None,
    head_cost: float = 0.0,
    allow_skip: bool | None = None,
    constraint: str = "accuracy",
) -> Calibration:
    """The cheapest per-exit policy within the target on the split (module docstring).

    Args:
        exit_logits: ``[(layer, N x K)]``, the last the final exit (at least one shallow).
        targets: N gold labels (may be None with ``constraint="agreement"``).
        kind: the single kind whose rule applies at each exit: ``entropy`` or ``maxprob``.
        patience: also leave after ``patience`` agreeing exits (None: thresholds only).
        head_cost: cost of evaluating one exit head, in layers (0: mean exit layer only).
        allow_skip: drop exits that do not pay for their head (default: when ``head_cost > 0``
            and there is no patience, which counts every exit).
        constraint: ``accuracy`` or ``agreement`` (module docstring).
    Returns:
        the policy and what it does on the split; ``accuracy`` against ``targets`` (or, with
        ``targets=None``, against the final exit).
    Raises:
        TargetError: with patience, when patience alone exceeds the target.
    """
    split = Split(exit_logits, _reference(exit_logits, targets, constraint), kind, patience)
    budget = error_budget(split, max_accuracy_drop)
    skip = (head_cost > 0 and patience is None) if allow_skip is None else allow_skip
    if skip and patience is not None:
        raise ValueError("allow_skip needs patience=None (patience counts every exit)")
    starts = [([NEVER] * split.num_shallow, [True] * split.num_shallow)]
    if patience is None:
        starts.append((single_cuts(split, budget, head_cost)[0], [True] * split.num_shallow))
    cuts, active = search(split, budget, head_cost, skip, starts)
    policy = policy_of(split, cuts, active, patience)
    return evaluate(exit_logits, _gold(exit_logits, targets), policy, head_cost)


def calibrate(
    kind: str,
    exit_logits: ExitLogits,
    targets: Tensor | None,
    max_accuracy_drop: float,
    constraint: str = "agreement",
    head_cost: float = 0.0,
    patience: int | None = None,
    split: str = "the split",
) -> Calibration:
    """The fastest policy of registry ``kind`` within the target on the split: the best single
    threshold (``entropy``, ``maxprob``), patience, or per-exit thresholds (``per_exit_*``,
    with ``patience`` beside them when given), or the learned decision (``learned``:
    ``learned_calibration``, its threshold on out-of-fold scores). A split too small for the
    kind (``evidence.check_split``) raises ``TooLittleEvidence`` naming ``split``."""
    check_split(exit_logits, targets, kind, split)
    if kind == "learned":
        if patience is not None:
            raise ValueError("patience goes beside a per-exit policy's thresholds, not learned")
        reference = _reference(exit_logits, targets, constraint)
        policy = calibrate_learned(exit_logits, reference, max_accuracy_drop, head_cost)
        return evaluate(exit_logits, _gold(exit_logits, targets), policy, head_cost)
    if kind.startswith("per_exit_"):
        single = kind[len("per_exit_") :]
        return calibrate_per_exit(
            exit_logits, targets, max_accuracy_drop, single, patience, head_cost,
            constraint=constraint,
        )  # fmt: skip
    if kind == "patience":
        return best_patience(exit_logits, targets, max_accuracy_drop, head_cost, constraint)
    return best_single_threshold(
        exit_logits, targets, max_accuracy_drop, kind, head_cost, constraint
    )


def calibrated_family(
    kind: str,
    exit_logits: ExitLogits,
    targets: Tensor | None,
    drops: Sequence[float],
    constraint: str = "agreement",
    head_cost: float = 0.0,
    patience: int | None = None,
    split: str = "the split",
) -> list[ExitPolicy]:
    """The distinct policies ``calibrate`` finds at each target of ``drops`` (points), in
    that order: the sweep's rows for a calibrated kind. Unreachable targets are left out; a
    split too small for the kind raises ``TooLittleEvidence``."""
    policies: list[ExitPolicy] = []
    for drop in drops:
        try:
            policy = calibrate(
                kind, exit_logits, targets, drop, constraint, head_cost, patience, split
            ).policy
        except TargetError:
            continue
        if policy not in policies:
            policies.append(policy)
    return policies
