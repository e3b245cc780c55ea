"""benchmarks/exit_cost_batch1.py end to end on a small run: every variant's row and column,
the ONNX Runtime segments beside the torch precisions (no timing is asserted)."""

from __future__ import annotations

import re

import pytest

from benchmarks import exit_cost_batch1


@pytest.mark.slow
def test_the_table_has_every_variant_and_precision(capsys):
    args = ["--rows", "2", "--rounds", "1", "--length", "8", "--threads", "1", "--dtypes",
            "fp32,int8,ort"]  # fmt: skip
    assert exit_cost_batch1.main(args) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip("| ").split("|")] for line in table]
    rows = {name: values for name, *values in cells}
    assert rows["variant"] == ["fp32", "int8", "ort"]
    for name in ("all 5 exits", "exits 2,4 only (skip list)", "exit 3 only (skip list)"):
        assert all(re.fullmatch(r"[+-]\d+\.\d%", c) for c in rows[name]), (name, rows[name])
    for name in (exit_cost_batch1.GENERAL, exit_cost_batch1.LAST_ONLY):  # torch only
        assert rows[name][2] == "-" and all(
            re.fullmatch(r"[+-]\d+\.\d%", c) for c in rows[name][:2]
        )
    costs = rows["head cost, layers (--head-cost)"]
    assert all(re.fullmatch(r"-?\d+\.\d{3}", c) for c in costs), costs


def test_an_unknown_precision_is_named(capsys):
    with pytest.raises(SystemExit) as stop:
        exit_cost_batch1.main(["--dtypes", "fp32,int4"])
    assert stop.value.code == 2 and "int4" in capsys.readouterr().err
