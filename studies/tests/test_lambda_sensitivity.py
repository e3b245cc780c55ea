"""The lambda study's sensitivity table and its within-method paired tests, on made-up runs
whose ranges, picks and t-test are worked out by hand below."""

import math
from pathlib import Path

import pytest

from studies.paired import PAIRED_COLUMNS, paired_rows
from studies.sensitivity import (
    GAP_COLUMNS,
    SENSITIVITY_COLUMNS,
    dev_test_gap_rows,
    lambda_sensitivity_rows,
)


def run(method: str, lam: float | None, seed: int, dev: float, test: float) -> dict:
    main = lam is None or lam == 0.5  # CE has no lambda; the main runs are named without it
    name = f"{method}-seed{seed}" if main else f"{method}-lam{lam:g}-seed{seed}"
    return {
        "folder": "lambda/main", "run": name, "method": method, "lambda": lam, "seed": seed,
        "dev_accuracy": dev, "test_accuracy": test, "predictions": Path("/nonexistent"),
    }  # fmt: skip


LAMBDAS = (0.1, 0.5, 1.0)
ACL = {  # seed -> (dev, test) per lambda 0.1 / 0.5 / 1.0
    1: [(85.2, 85.3), (85.8, 84.6), (86.2, 85.4)],  # range 0.8; dev picks 1.0
    2: [(85.0, 84.0), (85.0, 85.0), (84.0, 84.5)],  # range 1.0; dev tie: the smaller, 0.1
    3: [(84.0, 86.0), (86.0, 85.5), (85.0, 85.0)],  # range 1.0; dev picks 0.5
}
SCL = {
    1: [(85.0, 85.8), (85.1, 85.6), (85.0, 84.0)],  # range 1.8
    2: [(85.0, 86.2), (85.1, 84.0), (85.0, 85.0)],  # range 2.2
    3: [(85.0, 86.0), (85.1, 85.0)],  # no lambda 1.0: left out of the ranges
}


def records() -> list[dict]:
    out = [run("ce", None, s, 85.0, 85.0) for s in (1, 2, 3)]
    for method, table in (("acl", ACL), ("ce_scl", SCL)):
        for seed, cells in table.items():
            out += [run(method, lam, seed, d, t) for lam, (d, t) in zip(LAMBDAS, cells)]
    return out


def test_lambda_sensitivity_by_hand():
    rows = {r[0]: dict(zip(SENSITIVITY_COLUMNS, r)) for r in lambda_sensitivity_rows(records())}
    acl, scl = rows["acl"], rows["ce_scl"]
    assert acl["seeds"] == 3 and scl["seeds"] == 2
    assert acl["lambdas"] == "0.1 / 0.5 / 1"
    assert acl["test_mean_by_lambda"] == "85.10 / 85.03 / 84.97"
    assert acl["range_of_means"] == pytest.approx(0.133, abs=1e-3)
    assert acl["per_seed_range_mean"] == pytest.approx((0.8 + 1.0 + 1.0) / 3, abs=1e-3)
    assert scl["per_seed_range_mean"] == pytest.approx(2.0, abs=1e-3)
    assert acl["dev_chosen_lambda_per_seed"] == "1 0.1 0.5"
    assert acl["dev_chosen_test_mean"] == pytest.approx((85.4 + 84.0 + 85.5) / 3, abs=1e-3)
    # ACL's range minus CE+SCL's on seeds 1-2: -1.0, -1.2; t = -1.1 / (0.1414 / sqrt 2) = -11,
    # one degree of freedom: p = 1 - (2 / pi) * atan(11)
    assert acl["range_minus_ce_scl"] == pytest.approx(-1.1, abs=1e-3)
    assert acl["range_paired_t_p"] == pytest.approx(1 - 2 / math.pi * math.atan(11), rel=1e-3)
    assert scl["range_minus_ce_scl"] == "" and scl["range_paired_t_p"] == ""


def test_lambda_sensitivity_needs_every_lambda_on_a_seed():
    only_main = [r for r in records() if r["lambda"] in (None, 0.5)]
    assert lambda_sensitivity_rows(only_main) == []


def test_within_method_lambda_tests_are_their_own_family():
    rows = [dict(zip(PAIRED_COLUMNS, r)) for r in paired_rows(records())]
    within = {(r["method"], r["baseline"]): r for r in rows if r["family"] == "lambda-within"}
    assert set(within) == {
        (f"{m}-lam{lam}", f"{m}-lam0.5") for m in ("acl", "ce_scl") for lam in ("0.1", "1")
    }
    assert within[("acl-lam0.1", "acl-lam0.5")]["per_seed_difference"] == "+0.70 -1.00 +0.50"
    assert within[("ce_scl-lam1", "ce_scl-lam0.5")]["seeds"] == 2
    # Holm within the family of 4 only (the methods-at-each-lambda family is separate)
    p = [r["paired_t_p"] for r in within.values() if r["paired_t_p"] != ""]
    holm = [r["paired_t_holm"] for r in within.values() if r["paired_t_p"] != ""]
    assert min(holm) == pytest.approx(min(1.0, len(p) * min(p)), rel=1e-3)


def test_dev_test_gap_by_hand():
    recs = records()
    for r in recs:
        if r["run"] == "acl-seed1":
            r["valid_curve"] = [80.0, 84.0, 86.0, 85.0, 85.5]  # best 86 - mean(86, 85, 85.5)
    rows = {r[0]: dict(zip(GAP_COLUMNS, r)) for r in dev_test_gap_rows(recs)}
    assert list(rows)[0] == "ce" and rows["ce"]["gap_mean"] == 0.0
    acl = rows["acl-lam0.5"]  # gaps +1.2, 0.0, +0.5; CE's are 0
    assert acl["gap_per_seed"] == "+1.2 +0.0 +0.5"
    assert acl["gap_mean"] == pytest.approx(0.567, abs=1e-3)
    assert acl["gap_std"] == pytest.approx(0.603, abs=1e-3)
    assert acl["selection_optimism_mean"] == pytest.approx(0.5)  # the one run with a curve
    assert acl["gap_minus_ce"] == pytest.approx(0.567, abs=1e-3)
    t = 0.5667 / (0.6028 / math.sqrt(3))  # two degrees of freedom: p = 1 - t / sqrt(t^2 + 2)
    assert acl["gap_minus_ce_paired_t_p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-3)
    assert rows["acl-lam0.1"]["selection_optimism_mean"] == ""


def test_acl_cl_same_start_pairs_acl_cl_with_the_joint_run_of_the_same_start():
    recs = []
    for seed, (ours, theirs) in {1: (85.8, 85.3), 2: (84.8, 85.1)}.items():
        for method, name, acc in (("acl_cl", "acl_cl", ours),
                                  ("multi_exit_joint", "joint_from_acl", theirs)):  # fmt: skip
            recs.append({
                "folder": "acl-cl-same-start/main", "run": f"{name}-seed{seed}", "method": method,
                "lambda": None, "seed": seed, "dev_accuracy": 85.0, "test_accuracy": acc,
                "test_accuracy_exit1": acc - 8, "predictions": Path("/nonexistent"),
            })  # fmt: skip
    rows = [dict(zip(PAIRED_COLUMNS, r)) for r in paired_rows(recs)]
    final = [r for r in rows if r["family"] == "acl-cl-same-start" and r["metric"] == "accuracy"]
    assert len(final) == 1 and final[0]["baseline"] == "joint_from_acl"
    assert final[0]["per_seed_difference"] == "+0.50 -0.30"
    assert {r["metric"] for r in rows} == {"accuracy", "accuracy_exit1"}
