"""The speed/accuracy curve of early exit from one pass over every exit, and the choice of a
deployable threshold.

Everything here works on the logits of every exit for N examples, ``[(layer, N x K)]`` ordered
by layer, the last one the final exit (``collect_exits``, from ``exit_outputs``):

* ``simulate_exits``: the exits and predictions ``early_exit`` would give for a policy (the
  policy's own ``decide``, on all rows at once);
* ``quantile_thresholds``: thresholds that spread the curve evenly over the mean exit layer;
* ``oracle_exits`` / ``oracle_rows``: the best any policy could do (earliest exit that agrees
  with the final exit, or with the gold label);
* ``choose_row``: the sweep row to deploy for a speed-up target (or an accuracy-drop target
  among the rows swept; ``deploy`` calibrates exactly for that one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..errors import AclValueError
from .policies import POLICIES, ConfidencePolicy, ExitPolicy, policy_kind

__all__ = [
    "ExitLogits",
    "Quantiles",
    "TargetError",
    "choose_row",
    "collect_exits",
    "exit_accuracies",
    "oracle_exits",
    "oracle_rows",
    "quantile_thresholds",
    "simulate_exits",
    "sweep_thresholds",
]

ExitLogits = Sequence[tuple[int, Tensor]]
"""``[(layer, N x K logits)]`` by layer, the last entry the final exit."""


def collect_exits(
    model: Any, batches: Sequence[tuple[Tensor, Tensor]], head: str
) -> tuple[list[tuple[int, Tensor]], Tensor]:
    """``([(layer, N x K float logits)], target N)`` over all batches, one ``exit_outputs``
    pass, on the CPU."""
    per_layer: dict[int, list[Tensor]] = {}
    with torch.no_grad():
        for tokens, _ in batches:
            for out in model.exit_outputs(tokens, classification_head_name=head):
                per_layer.setdefault(out.layer, []).append(out.logits.float().cpu())
    targets = torch.cat([t.view(-1).cpu() for _, t in batches])
    return [(layer, torch.cat(chunks)) for layer, chunks in sorted(per_layer.items())], targets


def exit_accuracies(exit_logits: ExitLogits, targets: Tensor) -> dict[int, float]:
    """Accuracy (%) of every exit, ``{layer: accuracy}`` (the layer-score curve)."""
    return {
        layer: 100.0 * float(logits.argmax(dim=-1).eq(targets).double().mean())
        for layer, logits in exit_logits
    }


def simulate_exits(exit_logits: ExitLogits, policy: ExitPolicy) -> tuple[Tensor, Tensor]:
    """Exit layers and predictions that ``early_exit`` gives, from every exit's logits.

    Policies decide row by row, so running them on all rows of a full ``exit_outputs`` pass
    (no row removal) gives the same exits as the batched ``early_exit``; this makes threshold
    searches cheap (one encoder pass for any number of thresholds). Only the exits the policy
    decides at (``ExitPolicy.exits``) are used, as in the loop.

    Returns:
        ``(exit_layers N, predictions N)``.
    """
    *shallow, (last_layer, last_logits) = exit_logits
    used = set(policy.exits([layer for layer, _ in shallow]))  # a per-exit policy's own
    shallow = [(layer, logits) for layer, logits in shallow if layer in used]
    exit_layers = torch.full_like(last_logits[:, 0], last_layer, dtype=torch.long)
    predictions = last_logits.argmax(dim=-1)
    done = torch.zeros_like(exit_layers, dtype=torch.bool)
    state = policy.init_state(last_logits.size(0), last_logits.device)
    for layer, logits in shallow:
        exit_mask, state = policy.decide(logits, state)
        new = exit_mask & ~done
        exit_layers[new] = layer
        predictions[new] = logits[new].argmax(dim=-1)
        done |= exit_mask
    return exit_layers, predictions


def _short(value: float, low: float, high: float) -> float:
    """``value`` rounded to 6 significant digits if it stays in ``(low, high)``."""
    rounded = float(f"{value:.6g}")
    return rounded if low < rounded < high else value


def quantile_thresholds(exit_logits: ExitLogits, kind: str, count: int) -> list[float]:
    """``count`` entropy or maxprob thresholds whose mean exit layers are evenly spaced.

    A row leaves at or before shallow exit ``e`` iff its most confident score (the policy's
    ``score``: the running minimum of its entropies, maximum of its top probabilities) over
    exits ``<= e`` passes the threshold, and the mean exit layer is ``L - sum_e gap_e *
    share_e(t)`` where ``gap_e`` is the number of layers between exit ``e`` and the next one and
    ``share_e(t)`` the share of rows whose running value at ``e`` passes ``t``. The quantile
    ``q`` of the running values of all (row, shallow exit) pairs, weighted by ``gap_e``,
    therefore has a mean exit layer of ``L - q (L - l_1)`` (up to ties): ``q = 1/count, 2/count,
    ..., 1`` give evenly spaced mean exit layers from just below full depth down to the first
    exit ``l_1`` (evenly spaced layers saved, so the curve has no gaps; ``q = 0`` is the full
    model's row). The last threshold is the kind's ``always_exits`` (entropy ``inf``, maxprob
    ``0``): every row at the first exit. A threshold is the midpoint between two neighbouring
    running values, rounded to 6 significant digits when that keeps it between them.

    Args:
        exit_logits: ``[(layer, N x K)]``, the last the final exit (at least one shallow).
        kind: a threshold policy (``ConfidencePolicy``): ``entropy`` or ``maxprob``.
        count: number of thresholds, ``>= 1``.
    Returns:
        distinct thresholds, from the most to the least demanding.
    """
    if count < 1:
        raise ValueError(f"--thresholds quantiles:N: N must be >= 1, got {count}")
    policy = policy_kind(kind)
    if not issubclass(policy, ConfidencePolicy):
        kinds = [k for k, c in POLICIES.items() if issubclass(c, ConfidencePolicy)]
        raise ValueError(f"quantile thresholds need a threshold policy ({kinds}), not {kind!r}")
    *shallow, (last_layer, _) = exit_logits
    if not shallow:
        raise ValueError("quantile thresholds need at least one shallow exit")
    layers = [layer for layer, _ in shallow] + [last_layer]
    values, weights = [], []
    running: Tensor | None = None
    for e, (_, logits) in enumerate(shallow):
        score = policy.score(logits).double()
        if policy.exits_above:  # negated, so that smaller = more confident
            score = -score
        running = score if running is None else torch.minimum(running, score)
        values.append(running)
        weights.append(torch.full_like(running, float(layers[e + 1] - layers[e])))
    order = torch.cat(values).argsort()
    v = torch.cat(values)[order]
    cum = torch.cat(weights)[order].cumsum(0)
    cum = cum / cum[-1]
    out: list[float] = []
    for i in range(1, count + 1):
        q = i / count
        if i == count:
            t = policy.always_exits()
        else:
            k = int(torch.searchsorted(cum, torch.tensor(q - 1e-12, dtype=cum.dtype)))
            k = min(k, v.numel() - 1)
            low = float(v[k])
            high = float(v[k + 1]) if k + 1 < v.numel() else low + 1.0
            if high == low:  # a tie: the next distinct value
                later = v[k + 1 :][v[k + 1 :] > low]
                high = float(later[0]) if later.numel() else low + 1.0
            mid = _short((low + high) / 2, low, high)
            # entropy exits when H < t; maxprob when p >= t, i.e. -p <= -t
            t = policy.clip(-mid if policy.exits_above else mid)
        if t not in out:
            out.append(t)
    return out


def oracle_exits(exit_logits: ExitLogits, target: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Earliest exit whose prediction equals the final exit's (``target=None``) or the gold
    label (``target`` N; rows no exit gets right leave at the final exit).

    Returns:
        ``(exit_layers N, predictions N)``.
    """
    final_pred = exit_logits[-1][1].argmax(dim=-1)
    goal = final_pred if target is None else target.to(final_pred.device).view(-1)
    exit_layers = torch.full_like(final_pred, exit_logits[-1][0])
    predictions = final_pred.clone()
    done = torch.zeros_like(final_pred, dtype=torch.bool)
    for layer, logits in exit_logits:
        pred = logits.argmax(dim=-1)
        new = pred.eq(goal) & ~done
        exit_layers[new] = layer
        predictions[new] = pred[new]
        done |= new
    return exit_layers, predictions


class TargetError(AclValueError):
    """No swept threshold reaches the target; the message names the flag and the best value."""


def choose_row(
    rows: Sequence[dict[str, Any]],
    max_accuracy_drop: float | None = None,
    target_speedup: float | None = None,
    constraint: str = "accuracy",
) -> dict[str, Any]:
    """The sweep row to deploy.

    Args:
        rows: sweep rows of one batch size and precision: the full model (``policy ==
            "none"``) and the policies (``oracle-*`` rows are ignored).
        max_accuracy_drop: points below the full model's accuracy allowed (``constraint
            "agreement"``: percent of rows whose prediction may differ from the full model's):
            the row with the largest layer-count speed-up within it (ties: the more accurate).
        target_speedup: the most accurate (most agreeing) row whose layer-count speed-up is at
            least this (ties: the faster).
    Raises:
        ValueError: neither or both targets; ``TargetError``: no row reaches it.
    """
    if (max_accuracy_drop is None) == (target_speedup is None):
        raise ValueError("give exactly one of --max-accuracy-drop and --target-speedup")
    full = next((r for r in rows if r["policy"] == "none"), None)
    if full is None:
        raise ValueError("the sweep rows have no full-model row (policy 'none')")
    candidates = [
        r for r in rows if r["policy"] not in ("none",) and not r["policy"].startswith("oracle")
    ]
    if not candidates:
        raise ValueError("the sweep rows have no threshold to choose from")
    key = "agreement" if constraint == "agreement" else "accuracy"
    if max_accuracy_drop is not None:
        if not max_accuracy_drop >= 0:
            raise ValueError(f"--max-accuracy-drop must be >= 0 points, got {max_accuracy_drop}")
        floor = full[key] - max_accuracy_drop - 1e-9
        within = [r for r in candidates if r[key] >= floor]
        if not within:
            least = min(full[key] - r[key] for r in candidates)
            raise TargetError(
                f"--max-accuracy-drop {max_accuracy_drop:g} (--constraint {constraint}): no "
                f"policy is within {max_accuracy_drop:g} points of the full model "
                f"({full[key]:.2f}%); the smallest drop swept is {least:.2f} points: allow at "
                "least that, or sweep more demanding thresholds"
            )
        return max(within, key=lambda r: (r["layer_speedup"], r[key]))
    assert target_speedup is not None
    if not target_speedup >= 1:
        raise ValueError(f"--target-speedup must be >= 1 (layer-count), got {target_speedup}")
    fast = [r for r in candidates if r["layer_speedup"] >= target_speedup - 1e-9]
    if not fast:
        best = max(r["layer_speedup"] for r in candidates)
        raise TargetError(
            f"--target-speedup {target_speedup:g}: no policy reaches it; the largest "
            f"layer-count speed-up swept is {best:.2f}: ask for at most that"
        )
    return max(fast, key=lambda r: (r[key], r["layer_speedup"]))


def oracle_rows(
    exit_logits: ExitLogits, targets: Tensor, batch_size: int, dtype: str = "fp32"
) -> list[dict[str, Any]]:
    """Sweep-table rows ``oracle-final`` (earliest exit that agrees with the final exit: the
    full model's accuracy) and ``oracle-gold`` (earliest exit that is right: an upper bound on
    the accuracy at that depth); layer-count speed-up only, no timing."""
    num_layers = exit_logits[-1][0]
    final = exit_logits[-1][1].argmax(dim=-1)
    rows = []
    for name, gold in (("oracle-final", None), ("oracle-gold", targets)):
        layers, preds = oracle_exits(exit_logits, gold)
        mean_layer = float(layers.double().mean())
        counts = torch.unique(layers, return_counts=True)
        rows.append(
            {
                "dtype": dtype,
                "batch_size": batch_size,
                "policy": name,
                "threshold": None,
                "examples": int(targets.numel()),
                "accuracy": 100.0 * float(preds.eq(targets).double().mean()),
                "agreement": 100.0 * float(preds.eq(final).double().mean()),
                "mean_exit_layer": mean_layer,
                "layer_speedup": num_layers / mean_layer,
                "full_ms": None,
                "early_ms": None,
                "wall_speedup": None,
                "fraction_of_ideal": None,
                "exit_share": {int(k): float(n) / targets.numel() for k, n in zip(*counts)},
            }
        )
    return rows


class Quantiles(NamedTuple):
    """``count`` thresholds from the exits' confidences (``quantile_thresholds``)."""

    count: int


def sweep_thresholds(
    spec: Sequence[float] | Quantiles | None,
    kind: str,
    exit_logits: ExitLogits,
    num_classes: int,
) -> list[float]:
    """The thresholds to sweep: the ones given, the quantile grid, or the kind's default grid.

    Patience values are integers: ``Quantiles`` gives every patience (the default grid).
    """
    policy = policy_kind(kind)
    default = policy.default_grid(num_classes, len(exit_logits) - 1)
    if spec is None:
        return default
    if isinstance(spec, Quantiles):
        if not issubclass(policy, ConfidencePolicy):
            return default
        return quantile_thresholds(exit_logits, kind, spec.count)
    return list(spec)
