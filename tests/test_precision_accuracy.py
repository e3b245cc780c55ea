"""benchmarks/precision_accuracy.py: two compare folders side by side, numbers from the runs."""

import json

import pytest

from acl_fairseq.acl_grad import AngleRecord, append_angle_record
from acl_fairseq.experiment.paired_tests import mcnemar
from acl_fairseq.experiment.predictions import SplitPredictions, write_predictions
from benchmarks import precision_accuracy


def _run(out, name, method, labels, preds, angles):
    run = out / "runs" / name
    run.mkdir(parents=True)
    result = {"run": name, "method": method, "seed": 1, "lambda": 0.5}
    (run / "test.json").write_text(json.dumps(result))
    test = SplitPredictions("test", labels, {6: preds})
    write_predictions(run / "predictions.tsv", [SplitPredictions("valid", [0], {6: [0]}), test])
    for update, angle in enumerate(angles, 1):
        append_angle_record(run / "angles.tsv", AngleRecord(update, angle, angle <= 90, angle))


def test_table_compares_the_same_runs_example_by_example(tmp_path):
    labels = [0, 1, 1, 0, 1, 0, 0, 1]
    fp32 = [0, 1, 1, 0, 0, 0, 1, 1]  # 6 of 8 right
    bf16 = [0, 1, 0, 0, 1, 0, 1, 1]  # 6 of 8 right, 2 predictions differ
    _run(tmp_path / "a", "acl-seed1", "acl", labels, fp32, [50.0, 60.0, 70.0])
    _run(tmp_path / "b", "acl-seed1", "acl", labels, bf16, [50.5, 59.0])
    table = precision_accuracy.compare(tmp_path / "a", tmp_path / "b", ("fp32", "bf16"))
    assert "| acl-seed1 | 6 | 75.00 | 75.00 | 75.0% | 0.75° / 1.00° (2) |" in table
    expected = mcnemar([[p == y for p, y in zip(bf16, labels)]],
                       [[p == y for p, y in zip(fp32, labels)]])  # fmt: skip
    assert f"| acl | 6 | 1 | +0.00 | 1 | 1 | {expected.p_value:.3g} |" in table
    with pytest.raises(SystemExit, match="no run"):
        precision_accuracy.compare(tmp_path / "a", tmp_path / "nothing", ("fp32", "bf16"))
