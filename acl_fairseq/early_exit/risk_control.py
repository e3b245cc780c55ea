"""Exit thresholds with a guarantee: Learn-then-Test on the disagreement with the full model.

Choosing the fastest threshold whose dev accuracy stays within a drop over-fits dev: on test
the drop is often larger. Risk control (Angelopoulos et al. 2021, "Learn then Test"; used for
early exit by CALM, Schuster et al. 2022) instead certifies, with probability ``1 - delta`` over
the calibration split (test rows exchangeable with it), that the chosen policy's *disagreement
rate with the full model* on new data is at most ``epsilon``. Where the two agree they are
equally right, so the accuracy drop is at most the disagreement rate: the guarantee bounds the
test drop by ``epsilon`` too (conservatively, as disagreements that fix the full model's
errors count against it). No labels are needed.

The procedure is fixed-sequence testing: candidates ordered from the most conservative to the
most aggressive, fixed before looking at the calibration rows; for each, the p-value of
"disagreement > epsilon" is the binomial tail ``P(Binom(n, epsilon) <= observed)``; walk the
sequence while ``p <= delta`` and keep the last one passed (full depth when none).

* ``risk_controlled``: any ordered family of policies.
* ``risk_controlled_single``: single entropy / maxprob thresholds on a fixed grid (no data used
  to build it, so the whole split calibrates).
* ``risk_controlled_per_exit``: per-exit thresholds; the family (``calibrate_per_exit`` at
  growing drop targets) is built on one half of the split and tested on the other half (on a
  few hundred rows the halves are often too small to certify anything);
* ``risk_controlled_learned``: the learned decision, fitted and thresholded on one half
  (``learned_calibration``), certified on the other;
* ``risk_controlled_kind``: the one of these for a registry kind (patience: every patience,
  the most patient first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .calibrate import calibrate_per_exit
from .evidence import check_split
from .learned_calibration import learned_family
from .policies import EntropyPolicy, ExitPolicy, MaxProbPolicy, PatiencePolicy
from .thresholds import ExitLogits, simulate_exits

__all__ = [
    "RiskControl",
    "binomial_cdf",
    "risk_controlled",
    "risk_controlled_kind",
    "risk_controlled_learned",
    "risk_controlled_per_exit",
    "risk_controlled_single",
]


class RiskControl(NamedTuple):
    """The policy risk control certifies and its evidence."""

    policy: ExitPolicy  # the last candidate certified (full depth if none)
    disagreement: float  # its disagreement rate with the final exit on the calibration rows
    p_value: float  # of "disagreement > epsilon" (1.0 for full depth)
    passed: int  # candidates certified (a prefix of the sequence)
    examples: int  # calibration rows


def binomial_cdf(k: int, n: int, p: float) -> float:
    """``P(Binom(n, p) <= k)``, exact (log-space sum), for ``0 <= p <= 1``."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1)
        - math.lgamma(j + 1)
        - math.lgamma(n - j + 1)
        + j * log_p
        + (n - j) * log_q
        for j in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _disagreements(exit_logits: ExitLogits, policy: ExitPolicy) -> int:
    final = exit_logits[-1][1].argmax(dim=-1)
    _, preds = simulate_exits(exit_logits, policy)
    return int(preds.ne(final).sum())


def risk_controlled(
    exit_logits: ExitLogits, family: Sequence[ExitPolicy], epsilon: float, delta: float
) -> RiskControl:
    """The last policy of ``family`` (ordered conservative -> aggressive, fixed in advance)
    that fixed-sequence testing certifies: disagreement with the final exit ``<= epsilon``
    with probability ``>= 1 - delta``."""
    if not 0 < epsilon < 1 or not 0 < delta < 1:
        raise ValueError(f"epsilon and delta must be in (0, 1), got {epsilon}, {delta}")
    n = int(exit_logits[-1][1].size(0))
    chosen = RiskControl(EntropyPolicy(0.0), 0.0, 1.0, 0, n)  # full depth
    for i, policy in enumerate(family):
        d = _disagreements(exit_logits, policy)
        p_value = binomial_cdf(d, n, epsilon)
        if p_value > delta:
            break
        chosen = RiskControl(policy, d / n, p_value, i + 1, n)
    return chosen


def single_grid(kind: str, num_classes: int, steps: int = 200) -> list[ExitPolicy]:
    """A fixed grid of single thresholds, most conservative first: entropy ``0 .. ln K``,
    maxprob ``1 .. 1/K``, ``steps`` each."""
    if kind == "entropy":
        top = math.log(num_classes)
        return [EntropyPolicy(top * i / steps) for i in range(1, steps + 1)]
    if kind == "maxprob":
        low = 1.0 / num_classes
        return [MaxProbPolicy(1.0 - (1.0 - low) * i / steps) for i in range(1, steps + 1)]
    raise ValueError(f"kind must be entropy or maxprob, got {kind!r}")


def risk_controlled_single(
    exit_logits: ExitLogits, epsilon: float, delta: float, kind: str = "entropy", steps: int = 200
) -> RiskControl:
    """``risk_controlled`` over ``single_grid``: the whole split calibrates."""
    num_classes = int(exit_logits[-1][1].size(-1))
    return risk_controlled(exit_logits, single_grid(kind, num_classes, steps), epsilon, delta)


def _halves(exit_logits: ExitLogits, seed: int) -> tuple[ExitLogits, ExitLogits]:
    """A random half of the rows (the family's) and the other half (the certifying one)."""
    n = int(exit_logits[-1][1].size(0))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    fit, check = order[: n // 2], order[n // 2 :]
    return [(layer, x[fit]) for layer, x in exit_logits], [
        (layer, x[check]) for layer, x in exit_logits
    ]


def risk_controlled_per_exit(
    exit_logits: ExitLogits,
    epsilon: float,
    delta: float,
    kind: str = "entropy",
    drops: Sequence[float] = tuple(0.25 * i for i in range(41)),
    seed: int = 0,
) -> RiskControl:
    """Per-exit thresholds with the guarantee: a random half of the rows builds the family
    (``calibrate_per_exit`` with the agreement constraint at each target in ``drops``, sorted
    from the most to the least expensive there), the other half certifies it (``examples`` is
    that half). No labels are needed."""
    fit_logits, check_logits = _halves(exit_logits, seed)
    found = {}
    for drop in drops:
        cal = calibrate_per_exit(fit_logits, None, drop, kind, constraint="agreement")
        found.setdefault(cal.policy.spec, (-cal.cost, cal.policy))
    family = [policy for _, policy in sorted(found.values(), key=lambda v: v[0])]
    return risk_controlled(check_logits, family, epsilon, delta)


def risk_controlled_learned(
    exit_logits: ExitLogits,
    epsilon: float,
    delta: float,
    drops: Sequence[float] = tuple(0.25 * i for i in range(41)),
    seed: int = 0,
) -> RiskControl:
    """The learned decision with the guarantee: fitted on a random half of the rows, its
    thresholds at each target in ``drops`` (``learned_family``, highest first) certified on
    the other half (``examples`` is that half). No labels are needed."""
    fit_logits, check_logits = _halves(exit_logits, seed)
    return risk_controlled(check_logits, learned_family(fit_logits, drops), epsilon, delta)


def risk_controlled_kind(
    kind: str, exit_logits: ExitLogits, epsilon: float, delta: float, split: str = "the split"
) -> RiskControl:
    """Risk control for a registry ``kind``: single thresholds on the fixed grid, per-exit
    thresholds or the learned decision on dev halves, or every patience from the most
    patient down. A split too small for the kind raises ``evidence.TooLittleEvidence``."""
    check_split(exit_logits, None, kind, split)
    if kind == "learned":
        return risk_controlled_learned(exit_logits, epsilon, delta)
    if kind.startswith("per_exit_"):
        return risk_controlled_per_exit(exit_logits, epsilon, delta, kind[len("per_exit_") :])
    if kind == "patience":
        family = [PatiencePolicy(p) for p in range(len(exit_logits) - 2, -1, -1)]
        return risk_controlled(exit_logits, family, epsilon, delta)
    return risk_controlled_single(exit_logits, epsilon, delta, kind)
