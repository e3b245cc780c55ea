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
    torch_only = (exit_cost_batch1.GENERAL, exit_cost_batch1.LAST_ONLY, exit_cost_batch1.FLOOR)
    for name in torch_only:
        assert rows[name][2] == "-" and all(
            re.fullmatch(r"[+-]\d+\.\d%", c) for c in rows[name][:2]
        )
    costs = rows["head cost, layers (--head-cost)"]
    assert len(rows) == len(table)  # one row per variant
    assert all(re.fullmatch(r"-?\d+\.\d{3}", c) for c in costs), costs


def test_an_unknown_precision_is_named(capsys):
    with pytest.raises(SystemExit) as stop:
        exit_cost_batch1.main(["--dtypes", "fp32,int4"])
    assert stop.value.code == 2 and "int4" in capsys.readouterr().err


def test_the_floor_loop_computes_the_final_exit():
    """The floor's loop reads a value per exit and still returns the model's full-depth
    logits (the same layers, the final head)."""
    import torch

    model, rows = exit_cost_batch1.random_model("mean", 8)
    with torch.no_grad():
        for r in rows[:3]:
            expected = model(r, classification_head_name=exit_cost_batch1.HEAD)[0]
            got = exit_cost_batch1.floor_row(model, r)
            torch.testing.assert_close(got, expected)
