"""The study's paired verdicts (``paired.csv``): each method against its baseline on the same
seeds (or few-shot draws), over seeds and over examples, corrected per family of tests.

A row pairs seed s of a method with seed s of its baseline (same data, same examples):

* over seeds: the per-seed differences, their mean and std, the paired t-test;
* over examples (runs that kept ``predictions.tsv``): the exact McNemar test of the examples
  one gets right and the other wrong, pooled over the seeds, and a paired bootstrap of the
  seed-mean difference over examples (95% interval, p-value);
* Holm's correction within the row's family (one family per study; the few-shot sizes are one
  family; the lambda study has two: the methods at each λ, and within a method each λ against
  λ 0.5, ``lambda-within``), separately for the t-test and for McNemar. A difference is a verdict
  (``verdict``: better / worse) only when both tests survive their correction at 0.05
  (``paired_tests.verdict``, the rule of acl-fairseq-fewshot's table too); otherwise ``no
  verdict``, also for a row with one test only (the first round kept no predictions, so it has
  no McNemar).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from acl_fairseq.experiment import fewshot
from acl_fairseq.experiment.mean_std import summarize
from acl_fairseq.experiment.paired_tests import (
    holm,
    mcnemar,
    paired_bootstrap,
    seed_t_test,
    verdict,
)
from studies.records import predictions_of
from studies.round2 import MAIN_LAMBDA

PAIRED_COLUMNS = [
    "family", "study", "method", "baseline", "metric", "seeds", "per_seed_difference",
    "mean_difference", "std", "paired_t_p", "paired_t_holm", "example_seeds",
    "ours_only", "theirs_only", "mcnemar_p", "mcnemar_holm", "bootstrap_low",
    "bootstrap_high", "bootstrap_p", "verdict",
]  # fmt: skip


class Comparison(NamedTuple):
    family: str
    study: str
    method: str  # with its variant where one method has several (acl λ0.1)
    baseline: str
    metric: str  # accuracy or accuracy_exitL
    ours: dict[int, dict]  # seed -> run record
    theirs: dict[int, dict]


def _layer(metric: str) -> int | None:
    """The exit of ``accuracy_exitL`` (None: the final exit)."""
    return int(metric[len("accuracy_exit") :]) if metric.startswith("accuracy_exit") else None


def runs_by_seed(records: Iterable[dict], folder: str) -> dict[str, dict[int, dict]]:
    """``{run name without its seed: {seed: record}}`` of a folder; in a lambda study every
    contrastive run is named with its lambda (``acl-lam0.1``, and ``acl-lam0.5`` for the
    main runs at the lambda the sweep was run around)."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in records:
        if r["folder"] == folder:
            name = r["run"].rsplit("-seed", 1)[0]
            if folder.startswith("lambda/") and "-lam" not in name and r["lambda"] is not None:
                name = f"{name}-lam{float(r['lambda']):g}"
            out[name][r["seed"]] = r
    return out


def comparisons(records: list[dict]) -> list[Comparison]:
    """Every paired comparison the records allow, in a fixed order."""
    found: list[Comparison] = []

    def add(family, study, method, base, metric, ours, theirs):
        if ours and theirs:
            found.append(Comparison(family, study, method, base, metric, ours, theirs))

    for study, folder in (("full", "movie/main"), ("pair", "pair/main")):
        per = runs_by_seed(records, folder)
        pairs = [(m, "ce") for m in ("ce_scl", "acl", "multi_exit_joint", "acl_cl")]
        for method, base in [*pairs, ("acl", "ce_scl")]:
            add(study, study, method, base, "accuracy", per.get(method), per.get(base))
        _exit_pairs(add, study, study, per, "acl_cl", "multi_exit_joint")
    _fewshot_pairs(add, records, "fewshot")
    per = runs_by_seed(records, "pair-converged/main")
    gate = (("acl", "ce"), ("acl_embed", "ce"), ("acl", "acl_embed"), ("ce_scl", "ce"),
            ("ce_scl_grad", "ce_scl"), ("acl", "ce_scl"))  # fmt: skip
    for method, base in gate:
        add("pair-converged", "pair-converged", method, base, "accuracy",
            per.get(method), per.get(base))  # fmt: skip
    per = runs_by_seed(records, "lambda/main")
    for lam in lambdas(per):
        for method, base in ((f"acl{lam}", "ce"), (f"ce_scl{lam}", "ce"),
                             (f"acl{lam}", f"ce_scl{lam}")):  # fmt: skip
            add("lambda", "lambda", method, base, "accuracy", per.get(method), per.get(base))
    main = f"-lam{MAIN_LAMBDA:g}"
    for method in ("acl", "ce_scl"):  # does lambda matter within a method: each against 0.5
        for lam in (lam for lam in lambdas(per) if lam != main):
            add("lambda-within", "lambda", f"{method}{lam}", f"{method}{main}", "accuracy",
                per.get(f"{method}{lam}"), per.get(f"{method}{main}"))  # fmt: skip
    _fewshot_pairs(add, records, "fewshot-dev")
    per = runs_by_seed(records, "acl-cl-same-start/main")
    joint = "joint_from_acl"  # the phase's joint CE run: stage 2 from the ACL run
    add("acl-cl-same-start", "acl-cl-same-start", "acl_cl", joint, "accuracy",
        per.get("acl_cl"), per.get(joint))  # fmt: skip
    _exit_pairs(add, "acl-cl-same-start", "acl-cl-same-start", per, "acl_cl", joint)
    if "acl_cl_plain" in per:
        _exit_pairs(add, "acl-cl-same-start", "acl-cl-same-start", per, "acl_cl_plain", joint)
    return found


def _fewshot_pairs(add, records: list[dict], study: str) -> None:
    """CE+SCL and ACL against CE, and ACL against CE+SCL, paired by draw at every size of a
    few-shot study (one family: the study)."""
    few = fewshot_draws(records, study)
    for k in sorted({k for k, _ in few}):
        for method, base in (("ce_scl", "ce"), ("acl", "ce"), ("acl", "ce_scl")):
            add(study, f"{study} k{k}", method, base, "accuracy",
                few.get((k, method)), few.get((k, base)))  # fmt: skip


def _exit_pairs(add, family, study, per, method, base) -> None:
    """Every shallow exit of ``method`` against ``base``'s, paired by seed."""
    ours, theirs = per.get(method, {}), per.get(base, {})
    keys = sorted(
        {k for r in ours.values() for k in r if k.startswith("test_accuracy_exit")},
        key=lambda k: int(k[len("test_accuracy_exit") :]),
    )
    for key in keys:
        add(family, study, method, base, key[len("test_") :], ours, theirs)


def lambdas(per: dict[str, dict[int, dict]]) -> list[str]:
    """The ``-lam<l>`` suffixes of a lambda study's runs, by value (the main runs' lambda is
    written out too: ``acl-lam0.5``)."""
    found = {name.split("-lam", 1)[1] for name in per if "-lam" in name}
    return [f"-lam{v}" for v in sorted(found, key=float)]


def fewshot_draws(records: list[dict], task: str) -> dict[tuple[int, str], dict[int, dict]]:
    """``(sentences per class, method) -> {draw: record}`` of a few-shot study (folders
    ``TASK/kK/sS`` or, with the learning rate chosen per draw on its small dev,
    ``TASK/kK/dD/lrX``: the run the protocol chooses, ``fewshot.best_on_dev`` over the grid
    ``fewshot.LEARNING_RATES``; a draw is left out until every learning rate of the grid has
    its run, since its choice is not made before)."""
    out: dict[tuple[int, str], dict[int, dict]] = defaultdict(dict)
    by_lr: dict[tuple[int, str, int], dict[float, dict]] = defaultdict(dict)
    for r in sorted(records, key=lambda r: (r["folder"], r["run"])):
        parts = r["folder"].split("/")
        if parts[0] != task:
            continue
        k = int(parts[1][1:])
        if len(parts) == 3:  # TASK/kK/sS: one run per draw
            out[(k, r["method"])][r["seed"]] = r
            continue
        by_lr[(k, r["method"], int(parts[2][1:]))][float(parts[3][len("lr") :])] = r
    for (k, method, draw), runs in sorted(by_lr.items(), key=lambda kv: kv[0]):
        if set(runs) == set(fewshot.LEARNING_RATES):
            dev = {lr: runs[lr]["dev_accuracy"] for lr in fewshot.LEARNING_RATES}
            out[(k, method)][draw] = runs[fewshot.best_on_dev(dev)]
    return out


def _value(record: dict, metric: str) -> float | None:
    value = record.get(f"test_{metric}")
    return None if value is None else float(value)


def _row(c: Comparison) -> dict[str, Any]:
    seeds = sorted(s for s in set(c.ours) & set(c.theirs)
                   if _value(c.ours[s], c.metric) is not None
                   and _value(c.theirs[s], c.metric) is not None)  # fmt: skip
    diffs = [_value(c.ours[s], c.metric) - _value(c.theirs[s], c.metric) for s in seeds]
    row: dict[str, Any] = {
        "family": c.family, "study": c.study, "method": c.method, "baseline": c.baseline,
        "metric": c.metric, "seeds": len(diffs),
        "per_seed_difference": " ".join(f"{d:+.2f}" for d in diffs),
    }  # fmt: skip
    mean, std, _ = summarize(diffs)
    row.update(mean_difference=round(mean, 3), std=std, paired_t_p=seed_t_test(diffs))
    layer = _layer(c.metric)
    ours, theirs = [], []
    for s in seeds:
        a, b = predictions_of(c.ours[s]), predictions_of(c.theirs[s])
        if a is not None and b is not None and len(a.labels) == len(b.labels):
            ours.append(a.correct(layer))
            theirs.append(b.correct(layer))
    row["example_seeds"] = len(ours)
    row.update(ours_only="", theirs_only="", mcnemar_p=math.nan)
    row.update(bootstrap_low="", bootstrap_high="", bootstrap_p=math.nan)
    if ours:
        test = mcnemar(ours, theirs)
        boot = paired_bootstrap(ours, theirs)
        row.update(ours_only=test.ours_only, theirs_only=test.theirs_only, mcnemar_p=test.p_value)
        row.update(bootstrap_low=round(boot.low, 2), bootstrap_high=round(boot.high, 2))
        row["bootstrap_p"] = boot.p_value
    return row


def paired_rows(records: list[dict], corrected: Sequence[dict] = ()) -> list[list[Any]]:
    """The rows of ``paired.csv`` (columns ``PAIRED_COLUMNS``), then ``corrected``: rows whose
    Holm values and verdicts were computed elsewhere (the few-shot command's)."""
    rows = [_row(c) for c in comparisons(records)]
    rows = [r for r in rows if r["seeds"]]
    for family in dict.fromkeys(r["family"] for r in rows):
        members = [r for r in rows if r["family"] == family]
        for test in ("paired_t", "mcnemar"):
            adjusted = holm([r[f"{test}_p"] for r in members])
            for r, p in zip(members, adjusted):
                r[f"{test}_holm"] = p
    for r in rows:  # both tests: a missing one (NaN, a first-round row's McNemar) is no verdict
        r["verdict"] = verdict(r["mean_difference"], [r["paired_t_holm"], r["mcnemar_holm"]])
    return [[_cell(r[c]) for c in PAIRED_COLUMNS] for r in [*rows, *corrected]]


def _cell(value: Any) -> Any:
    """CSV form: NaN as empty, p-values and stds to 4 significant places."""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return float(f"{value:.4g}")
    return value
