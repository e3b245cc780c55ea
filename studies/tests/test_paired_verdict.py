"""The label of a paired.csv row follows the page's rule: a verdict only when the test over seeds
and McNemar's test over examples both survive Holm; one test alone, however small its p-value,
and a difference that does not survive are "no verdict", never "no difference"."""

from pathlib import Path

from scipy import stats

from studies.paired import PAIRED_COLUMNS, paired_rows

N = 200
RIGHT = {"ce": (120, 122, 118), "acl": (140, 143, 137)}  # examples right per seed 1-3


def _records(tmp_path: Path | None, right: dict[str, tuple[int, ...]]) -> list[dict]:
    """Runs of one family (pair-converged), seeds 1-3; with ``tmp_path`` each keeps its
    predictions (the first ``right`` of ``N`` test examples right), else none (first round)."""
    records = []
    for method, counts in right.items():
        for seed, n_right in enumerate(counts, 1):
            path = Path("/nonexistent")
            if tmp_path is not None:
                path = tmp_path / f"{method}-{seed}.tsv"
                lines = ["split\tindex\tlabel\texit6"]
                lines += [f"test\t{i}\t1\t{1 if i < n_right else 0}" for i in range(N)]
                path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            records.append({
                "folder": "pair-converged/main", "run": f"{method}-seed{seed}", "method": method,
                "lambda": None, "seed": seed, "dev_accuracy": 60.0,
                "test_accuracy": 100.0 * n_right / N, "predictions": path,
            })  # fmt: skip
    return records


def _row(records: list[dict]) -> dict:
    (row,) = [dict(zip(PAIRED_COLUMNS, r)) for r in paired_rows(records)]
    return row


def test_both_tests_surviving_is_a_verdict(tmp_path):
    row = _row(_records(tmp_path, RIGHT))
    acc = {m: [100.0 * n / N for n in counts] for m, counts in RIGHT.items()}
    t_p = stats.ttest_rel(acc["acl"], acc["ce"]).pvalue
    assert t_p < 0.05 and row["paired_t_p"] == float(f"{t_p:.4g}")
    # ACL right on every example CE gets right, and on 20 + 21 + 19 more
    assert (row["ours_only"], row["theirs_only"]) == (60, 0)
    assert row["mcnemar_p"] == float(f"{stats.binomtest(60, 60).pvalue:.4g}")
    assert row["verdict"] == "better"


def test_the_test_over_seeds_alone_is_no_verdict():
    """A first-round row (no predictions kept): the same t-test, no McNemar."""
    row = _row(_records(None, RIGHT))
    assert row["paired_t_holm"] < 0.05 and row["mcnemar_p"] == ""
    assert row["verdict"] == "no verdict"


def test_a_difference_that_does_not_survive_is_no_verdict(tmp_path):
    noisy = {"ce": (120, 122, 118), "acl": (124, 118, 121)}  # +2.0, -2.0, +1.5 points
    row = _row(_records(tmp_path, noisy))
    assert row["paired_t_holm"] > 0.05
    assert row["verdict"] == "no verdict"
