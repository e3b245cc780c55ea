"""How much a contrastive method's test accuracy moves with λ: the lambda study's
``lambda_sensitivity.csv`` (the paper claims ACL is less λ-sensitive than CE+SCL), and its
dev - test gaps (``dev_test_gap.csv``: the first round's ACL was below its dev on test in every
seed, CE+SCL above).

Per method, over the seeds that ran every λ: the test accuracy per λ (mean and sample std over
seeds), the range of those means, the per-seed range (max - min over λ within one seed: what
λ costs a user who picks it blind), and the λ a user would pick per seed on dev with its test
accuracy. On the ACL row, ACL's per-seed range minus CE+SCL's on the same seeds, with the
paired t-test over seeds: is ACL less λ-sensitive?
"""

from __future__ import annotations

import math
from typing import Any

from acl_fairseq.experiment.mean_std import fmt, summarize
from acl_fairseq.experiment.paired_tests import seed_t_test
from studies.paired import lambdas, runs_by_seed
from studies.records import csv_number

LAMBDA_FOLDER = "lambda/main"
METHODS = ("acl", "ce_scl")
SENSITIVITY_COLUMNS = [
    "method", "seeds", "lambdas", "test_mean_by_lambda", "test_std_by_lambda", "range_of_means",
    "per_seed_range_mean", "per_seed_range_std", "dev_chosen_lambda_per_seed",
    "dev_chosen_test_mean", "dev_chosen_test_std", "range_minus_ce_scl", "range_paired_t_p",
]  # fmt: skip


def lambda_sensitivity_rows(records: list[dict]) -> list[list[Any]]:
    """The rows of ``lambda_sensitivity.csv`` (columns ``SENSITIVITY_COLUMNS``); none when the
    lambda study has no method with every λ on a common seed."""
    per = runs_by_seed(records, LAMBDA_FOLDER)
    suffixes = lambdas(per)  # ["-lam0.1", "-lam0.5", "-lam1"]
    ranges: dict[str, dict[int, float]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        runs = [per.get(f"{method}{suffix}", {}) for suffix in suffixes]
        seeds = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
        if len(suffixes) < 2 or not seeds:
            continue
        test = [[float(r[s]["test_accuracy"]) for s in seeds] for r in runs]  # λ x seed
        by_seed = list(zip(*test))  # seed x λ
        spread = [max(v) - min(v) for v in by_seed]
        ranges[method] = dict(zip(seeds, spread))
        # the user's pick: the best dev accuracy per seed, the smaller λ on ties
        picks = [max(range(len(runs)), key=lambda i: (runs[i][s]["dev_accuracy"], -i))
                 for s in seeds]  # fmt: skip
        chosen = [by_seed[j][i] for j, i in enumerate(picks)]
        means = [summarize(v)[:2] for v in test]
        stds = " / ".join(fmt(d) for _, d in means)
        spread_mean, spread_std, _ = summarize(spread)
        chosen_mean, chosen_std, _ = summarize(chosen)
        rows[method] = {
            "method": method, "seeds": len(seeds),
            "lambdas": " / ".join(s[len("-lam"):] for s in suffixes),
            "test_mean_by_lambda": " / ".join(f"{m:.2f}" for m, _ in means),
            "test_std_by_lambda": stds,
            "range_of_means": csv_number(max(m for m, _ in means) - min(m for m, _ in means)),
            "per_seed_range_mean": csv_number(spread_mean),
            "per_seed_range_std": csv_number(spread_std),
            "dev_chosen_lambda_per_seed": " ".join(suffixes[i][len("-lam"):] for i in picks),
            "dev_chosen_test_mean": csv_number(chosen_mean),
            "dev_chosen_test_std": csv_number(chosen_std),
            "range_minus_ce_scl": "", "range_paired_t_p": "",
        }  # fmt: skip
    if "acl" in rows and "ce_scl" in rows:
        common = sorted(set(ranges["acl"]) & set(ranges["ce_scl"]))
        diffs = [ranges["acl"][s] - ranges["ce_scl"][s] for s in common]
        if diffs:
            rows["acl"]["range_minus_ce_scl"] = csv_number(summarize(diffs)[0])
            p = seed_t_test(diffs)
            rows["acl"]["range_paired_t_p"] = "" if math.isnan(p) else float(f"{p:.4g}")
    return [[row[c] for c in SENSITIVITY_COLUMNS] for row in rows.values()]


GAP_COLUMNS = [
    "run", "seeds", "dev_mean", "test_mean", "gap_per_seed", "gap_mean", "gap_std",
    "selection_optimism_mean", "gap_minus_ce", "gap_minus_ce_paired_t_p",
]  # fmt: skip
LAST_VALIDATIONS = 3  # selection optimism: the best dev record minus the mean of the last three


def dev_test_gap_rows(records: list[dict]) -> list[list[Any]]:
    """The lambda study's dev - test gap per configuration (``dev_test_gap.csv``, columns
    ``GAP_COLUMNS``): per seed, its mean and std, how much choosing the checkpoint on dev
    inflates dev (best dev record minus the mean of the last ``LAST_VALIDATIONS``; needs the
    run's ``valid`` records), and the gap minus CE's on the same seeds with the paired t-test."""
    per = runs_by_seed(records, LAMBDA_FOLDER)
    gaps = {
        name: {s: float(r["dev_accuracy"]) - float(r["test_accuracy"]) for s, r in runs.items()}
        for name, runs in per.items()
    }
    rows = []
    for name in sorted(per, key=lambda n: (n != "ce", n)):
        runs = per[name]
        seeds = sorted(runs)
        gap = [gaps[name][s] for s in seeds]
        optimism = [o for o in (_optimism(runs[s].get("valid_curve")) for s in seeds) if o == o]
        mean, std, _ = summarize(gap)
        dev = [float(runs[s]["dev_accuracy"]) for s in seeds]
        test = [float(runs[s]["test_accuracy"]) for s in seeds]
        row = [name, len(seeds), csv_number(summarize(dev)[0]), csv_number(summarize(test)[0]),
               " ".join(f"{g:+.1f}" for g in gap), csv_number(mean), csv_number(std),
               csv_number(summarize(optimism)[0]) if optimism else ""]  # fmt: skip
        common = sorted(set(seeds) & set(gaps.get("ce", {})))
        if name != "ce" and common:
            diffs = [gaps[name][s] - gaps["ce"][s] for s in common]
            p = seed_t_test(diffs)
            row += [csv_number(summarize(diffs)[0]), "" if math.isnan(p) else float(f"{p:.4g}")]
        else:
            row += ["", ""]
        rows.append(row)
    return rows


def _optimism(curve: list[float] | None) -> float:
    """Best dev record minus the mean of the last ``LAST_VALIDATIONS`` (NaN without a curve)."""
    if not curve:
        return math.nan
    last = curve[-LAST_VALIDATIONS:]
    return max(curve) - sum(last) / len(last)
