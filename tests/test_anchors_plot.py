"""benchmarks/anchors_plot.py: the benchmark's tables read back (CSV and Markdown alike), each
row in its panel with its kind, and a figure written."""

from __future__ import annotations

import pytest

from benchmarks import anchors_plot
from benchmarks import inference_anchors as anchors


def table() -> list[dict]:
    rows = []
    for batch in (1, 32):
        base = 10.0 if batch == 1 else 4.0
        rows += [
            {"system": "HF fp32 (sdpa)", "policy": "full depth", "ms": base, "speedup": 1.0},
            {"system": "ORT int8", "policy": "full depth", "ms": base / 4, "speedup": 4.0},
            {"system": "ORT int8, without SkipLayerNormFusion", "policy": "full depth",
             "ms": base / 4.5, "speedup": 4.5},
            {"system": "int8", "policy": "full depth", "ms": base / 2, "speedup": 2.0},
            {"system": "int8", "policy": "per_exit_entropy chosen on valid: "
             "`per_exit_entropy:1=0.49,3=0.16`", "ms": base / 4, "speedup": 4.0},
            {"system": "int8", "policy": "learned chosen on valid: `learned:0.96;bias=2.8`",
             "ms": base / 3, "speedup": 3.0},
            {"system": "int8", "policy": "entropy:0.3", "ms": None, "speedup": None},
        ]  # fmt: skip
        for r in rows[-7:]:
            r.update(batch=batch, threads=1, accuracy=85.0, agreement=99.0, mean_exit_layer=6.0)
    return anchors_plot.with_oracle_rows(rows, {"int8": 1.5}, depth=6)


def test_tables_read_back_the_same_from_csv_and_markdown(tmp_path):
    rows = table()
    anchors.write_rows(rows, tmp_path / "a.csv", ["# preamble"])
    anchors.write_rows(rows, tmp_path / "a.md", ["# preamble", "", "- a note"])
    from_csv = anchors_plot.read_rows(tmp_path / "a.csv")
    from_md = anchors_plot.read_rows(tmp_path / "a.md")
    assert len(from_csv) == len(rows) == 16
    for a, b, r in zip(from_csv, from_md, rows):
        assert a["system"] == b["system"] == r["system"] and a["policy"] == b["policy"]
        assert (a["batch"], a["threads"]) == (b["batch"], b["threads"]) == (r["batch"], 1)
        for key in ("accuracy", "ms", "speedup", "mean_exit_layer"):
            if r[key] is None:
                assert a[key] is None and b[key] is None
            else:
                assert a[key] == pytest.approx(r[key]) and b[key] == pytest.approx(r[key], abs=0.01)
    (tmp_path / "bad.md").write_text("no table here\n")
    with pytest.raises(ValueError, match="no table"):
        anchors_plot.read_rows(tmp_path / "bad.md")


def test_kinds_references_and_panels(tmp_path):
    kind = anchors_plot.policy_kind
    assert kind("full depth") == "full depth"
    assert kind(anchors_plot.ORACLE_POLICY) == "oracle-final"
    assert kind("per_exit_entropy chosen on valid: `per_exit_entropy:1=0.4`") == "per_exit_entropy"
    assert kind("`entropy:0.3`") == kind("entropy:0.3") == "entropy"
    assert anchors_plot.is_reference("HF fp32 (sdpa)") and anchors_plot.is_reference("ORT int8")
    assert not anchors_plot.is_reference("ORT int8, without SkipLayerNormFusion")
    assert not anchors_plot.is_reference(anchors.ORT_PROJECT)
    out = tmp_path / "fig.png"
    panels = anchors_plot.plot(table(), out, "title")
    assert sorted(panels) == [(1, 1), (1, 32)]
    for (_, batch), shown in panels.items():
        assert len(shown) == 7  # the untimed row is not drawn; the oracle is
        oracle = next(p for p in shown if p["kind"] == "oracle-final")
        assert oracle["ms"] == pytest.approx((10.0 if batch == 1 else 4.0) / 2 * 1.5 / 6)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_oracle_rows_for_tables_written_before_them(tmp_path):
    """``--oracle SYSTEM=LAYER``: the rows the benchmark writes now, added to an older table."""
    rows = [r for r in table() if r["policy"] != anchors_plot.ORACLE_POLICY]
    anchors.write_rows(rows, tmp_path / "old.md", ["# preamble"])
    out = tmp_path / "fig.png"
    argv = [str(tmp_path / "old.md"), "--out", str(out), "--oracle", "int8=1.5"]
    assert anchors_plot.main(argv) == 0
    with pytest.raises(SystemExit):  # a table that has them already
        anchors.write_rows(table(), tmp_path / "new.md", ["# preamble"])
        anchors_plot.main([str(tmp_path / "new.md"), "--out", str(out), "--oracle", "int8=1.5"])
    with pytest.raises(SystemExit):
        anchors_plot.main([str(tmp_path / "missing.md"), "--out", str(out)])
    again = anchors_plot.with_oracle_rows(
        anchors_plot.read_rows(tmp_path / "old.md"), {"int8": 1.5}, 6
    )
    assert [r["policy"] for r in again] == [r["policy"] for r in table()]
