"""The judge of the exit-training study (docs/study/exit-training.md), fixed before its runs.

Per trained model, from every exit's logits on dev and test (``[(layer, N x K)]``, the last
the final exit): the rule, per-exit entropy thresholds calibrated on dev so that at most
``RULE_DROP`` percent of dev predictions differ from the same model's full depth (the
agreement constraint), run unchanged on test. Over the study: the reference is the best
full-depth model, the highest mean test accuracy of a recipe's final exit over its seeds; a
recipe meets the goal when, on the mean over its seeds, the rule leaves at least ``GOAL``
times fewer layers at a test accuracy at most ``MARGIN`` points below that reference.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from acl_fairseq.early_exit.calibrate import calibrate_per_exit, evaluate
from acl_fairseq.early_exit.thresholds import ExitLogits, exit_accuracies, oracle_exits

RULE = "per-exit entropy, agreement, D 1"
RULE_DROP = 1.0  # D: percent of dev predictions that may differ from full depth
OTHER_DROPS = (0.5, 2.0)  # the same family at other targets: described, never the judge
GOAL = 3.0  # layer-count speed-up
MARGIN = 0.5  # points below the study's best full-depth test accuracy


def _percent(x: Tensor) -> float:
    return 100.0 * float(x.double().mean())


def rule_on(dev: ExitLogits, dev_targets: Tensor, test: ExitLogits, test_targets: Tensor,
            drop: float) -> dict[str, Any]:  # fmt: skip
    """The per-exit entropy policy chosen on dev at agreement target ``drop``, run on test."""
    chosen = calibrate_per_exit(
        dev, dev_targets, drop, kind="entropy", patience=None, head_cost=0.0, constraint="agreement"
    )
    on_test = evaluate(test, test_targets, chosen.policy)
    return {
        "policy": chosen.policy.spec,
        "dev": _calibration(chosen),
        "test": _calibration(on_test),
    }


def _calibration(c: Any) -> dict[str, float]:
    return {
        "accuracy": round(c.accuracy, 4),
        "full_accuracy": round(c.full_accuracy, 4),
        "agreement": round(c.agreement, 4),
        "mean_exit_layer": round(c.mean_exit_layer, 4),
        "layer_speedup": round(c.layer_speedup, 4),
    }


def judge(dev: ExitLogits, dev_targets: Tensor, test: ExitLogits, test_targets: Tensor
          ) -> dict[str, Any]:  # fmt: skip
    """What the study records of one model: its exits, the oracle, the rule (and the same
    family at ``OTHER_DROPS``, described only)."""
    final_test = test[-1][1].argmax(-1)
    oracle_layers, _ = oracle_exits(test)
    num_layers = test[-1][0]
    return {
        "rule": RULE,
        "exits": {
            "valid": {str(k): round(v, 4) for k, v in exit_accuracies(dev, dev_targets).items()},
            "test": {str(k): round(v, 4) for k, v in exit_accuracies(test, test_targets).items()},
        },
        "agreement_with_final_test": {
            str(layer): round(_percent(logits.argmax(-1).eq(final_test)), 4)
            for layer, logits in test[:-1]
        },
        "oracle_test": {
            "mean_exit_layer": round(float(oracle_layers.double().mean()), 4),
            "layer_speedup": round(num_layers / float(oracle_layers.double().mean()), 4),
        },
        "judge": rule_on(dev, dev_targets, test, test_targets, RULE_DROP),
        "other_targets": {
            f"{d:g}": rule_on(dev, dev_targets, test, test_targets, d) for d in OTHER_DROPS
        },
    }


def verdicts(
    per_recipe: Mapping[str, Sequence[Mapping[str, Any]]], seeds: int = 3, num_recipes: int = 1
) -> dict[str, Any]:
    """The study's verdict from ``{recipe: [judge() of each seed]}``: the reference (best
    recipe's mean full-depth test accuracy), and per recipe the means and spreads of the
    rule's test accuracy and speed-up, the seeds within the margin, and its outcome: met or
    missed once it has all ``seeds``, else no verdict. The study's outcome: met if a complete
    recipe met the goal, missed once all ``num_recipes`` are complete, else no verdict."""
    full = {
        name: statistics.fmean(j["judge"]["test"]["full_accuracy"] for j in runs)
        for name, runs in per_recipe.items()
        if runs
    }
    if not full:
        raise ValueError("no judged run")
    best = max(full, key=lambda name: full[name])
    reference = full[best]
    floor = reference - MARGIN
    recipes = {}
    for name, runs in per_recipe.items():
        if not runs:
            continue
        accuracy = [j["judge"]["test"]["accuracy"] for j in runs]
        speedup = [j["judge"]["test"]["layer_speedup"] for j in runs]
        mean_acc, mean_speed = statistics.fmean(accuracy), statistics.fmean(speedup)
        recipes[name] = {
            "seeds": len(runs),
            "full_accuracy": full[name],
            "accuracy": mean_acc,
            "accuracy_std": statistics.stdev(accuracy) if len(runs) > 1 else None,
            "layer_speedup": mean_speed,
            "layer_speedup_std": statistics.stdev(speedup) if len(runs) > 1 else None,
            "layer_speedup_range": (min(speedup), max(speedup)),
            "seeds_within_margin": sum(a >= floor - 1e-9 for a in accuracy),
            "within_margin": mean_acc >= floor - 1e-9,
            "met": mean_acc >= floor - 1e-9 and mean_speed >= GOAL and len(runs) >= seeds,
            "outcome": _outcome(
                mean_acc >= floor - 1e-9 and mean_speed >= GOAL, len(runs) >= seeds
            ),
        }
    complete = len(recipes) >= num_recipes and all(r["seeds"] >= seeds for r in recipes.values())
    met = any(r["met"] for r in recipes.values())
    return {
        "reference_recipe": best,
        "reference_accuracy": reference,
        "floor": floor,
        "goal": GOAL,
        "recipes": recipes,
        "met": met,
        "complete": complete,
        "outcome": "met" if met else _outcome(False, complete),
        "runs": sum(r["seeds"] for r in recipes.values()),
        "runs_expected": num_recipes * seeds,
    }


def _outcome(met: bool, complete: bool) -> str:
    return "met" if met and complete else "missed" if complete else "no verdict (incomplete)"
