"""benchmarks/acl_grad_agreement.py: the agreement table of the heads-only and top-K vs the
exact decision (run as a command, on hand-written angle logs)."""

import subprocess
import sys

import numpy
import pytest
from fork_server import ForkServer

from fairseq_helpers import REPO

SCRIPT = ["-m", "benchmarks.acl_grad_agreement"]  # run from the checkout (cwd=REPO)


def logs_only(out_dir):
    cmd = [sys.executable, *SCRIPT, "--logs-only", "--out", str(out_dir)]
    return subprocess.run(ForkServer.served(cmd), capture_output=True, text=True, cwd=REPO)


def table_cells(stdout: str, run: str) -> list[list[str]]:
    rows = [line for line in stdout.splitlines() if line.startswith(f"| {run} |")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_agreement_counts_decisions_at_each_threshold(tmp_path):
    pairs = [(50.0, 55.0), (70.0, 80.0), (95.0, 85.0), (100.0, 120.0)]
    run = tmp_path / "runs" / "acl-seed1"
    run.mkdir(parents=True)
    lines = [f"{i}\t{e}\t1\t{h}\n" for i, (e, h) in enumerate(pairs)]
    (run / "angles.tsv").write_text("".join(lines))
    res = logs_only(tmp_path)
    assert res.returncode == 0, res.stderr
    cells = table_cells(res.stdout, "acl-seed1")
    assert [c[1] for c in cells] == ["head"] * 3  # no top-K columns in this log
    cells = [[c[0], *c[2:]] for c in cells]
    assert [c[5] for c in cells] == ["60°", "75°", "90°"]
    # 60: exact drops 3, head 3, all agree; 75: exact 2 (95,100), head 3 (80,85,120), 3 of 4
    # agree; 90: exact 2, head 1 (120): 3 of 4 agree
    assert [(c[6], c[7], c[8]) for c in cells] == [
        ("3", "3", "100.0%"),
        ("2", "3", "75.0%"),
        ("2", "1", "75.0%"),
    ]
    assert cells[0][:4] == ["acl-seed1", "4", "78.8", "85.0"]
    expected_r = numpy.corrcoef([e for e, _ in pairs], [h for _, h in pairs])[0, 1]
    assert float(cells[0][4]) == pytest.approx(expected_r, abs=0.005)


def test_logs_only_prints_one_block_per_run_and_skips_three_column_logs(tmp_path):
    run = tmp_path / "runs" / "ce_scl-seed1"
    run.mkdir(parents=True)
    (run / "angles.tsv").write_text("0\t80.0\t1\t70.0\n1\t100.0\t1\t95.0\n")
    old = tmp_path / "runs" / "acl-seed1"
    old.mkdir()
    (old / "angles.tsv").write_text("0\t80.0\t1\n")
    res = logs_only(tmp_path)
    assert res.returncode == 0, res.stderr
    assert (
        sum(line.startswith("| ce_scl-seed1 | head | 2 |") for line in res.stdout.splitlines()) == 3
    )
    assert "skipped (no heads-only angle column; re-run with --force): acl-seed1" in res.stdout
    (run / "angles.tsv").unlink()
    res = logs_only(tmp_path)
    assert res.returncode != 0 and "no log with both angles" in res.stderr


def test_top_k_columns_give_one_block_per_k(tmp_path):
    # (exact, head, top:1, top:2) per update
    rows = [(50.0, 95.0, 70.0, 52.0), (80.0, 40.0, 70.0, 78.0), (100.0, 60.0, 95.0, 99.0)]
    run = tmp_path / "runs" / "acl-seed1"
    run.mkdir(parents=True)
    lines = [f"{i}\t{e}\t1\t{h}\t1:{t1}\t2:{t2}\n" for i, (e, h, t1, t2) in enumerate(rows)]
    (run / "angles.tsv").write_text("".join(lines))
    res = logs_only(tmp_path)
    assert res.returncode == 0, res.stderr
    cells = table_cells(res.stdout, "acl-seed1")
    assert [(c[1], c[6]) for c in cells] == [
        (scope, t) for scope in ("head", "top:1", "top:2") for t in ("60°", "75°", "90°")
    ]
    agree = {(c[1], c[6]): c[9] for c in cells}
    # 60: exact drops 80,100; top:1 drops 70,70,95 (2 of 3 agree); top:2 drops 78,99 (all)
    assert agree["top:1", "60°"] == "66.7%" and agree["top:2", "60°"] == "100.0%"
    # 90: exact drops 100 only; head drops 95 (update 0): only update 1 agrees
    assert agree["head", "90°"] == "33.3%" and agree["top:1", "90°"] == "100.0%"
    r2 = numpy.corrcoef([e for e, *_ in rows], [t2 for *_, t2 in rows])[0, 1]
    top2 = [c for c in cells if c[1] == "top:2"][0]
    assert float(top2[5]) == pytest.approx(r2, abs=0.005)
    assert top2[3:5] == ["76.7", "76.3"]


def test_scope_agreement_per_scope_and_threshold():
    from acl_fairseq.acl_grad import AngleRecord, scope_agreement

    # exact, head, top:1 angles of four updates
    rows = [(50.0, 55.0, 52.0), (70.0, 80.0, 74.0), (95.0, 85.0, 96.0), (100.0, 120.0, 99.0)]
    records = [AngleRecord(i, e, True, h, ((1, t),)) for i, (e, h, t) in enumerate(rows)]
    result = {(a.scope, a.threshold): a for a in scope_agreement(records, (75.0, 90.0))}
    assert set(result) == {(s, t) for s in ("head", "top:1") for t in (75.0, 90.0)}
    head75, top75 = result["head", 75.0], result["top:1", 75.0]
    assert (head75.exact_drops, head75.scope_drops, head75.agree) == (2, 3, 0.75)
    assert (top75.exact_drops, top75.scope_drops, top75.agree) == (2, 2, 1.0)
    exact = [r[0] for r in rows]
    assert top75.pearson_r == pytest.approx(numpy.corrcoef(exact, [r[2] for r in rows])[0, 1])
    assert top75.mean_scope == pytest.approx(numpy.mean([r[2] for r in rows]))
    # an older log without the heads-only angle gives no rows
    assert scope_agreement([AngleRecord(0, 50.0, True, float("nan"))]) == []
