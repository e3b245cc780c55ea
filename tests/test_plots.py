"""acl-fairseq-plots (the pictures of a compare results folder): the plots that need no
model, from hand-written results; and acl-fairseq-compare then acl-fairseq-plots end to end on
a tiny generated dataset (every method, one seed, a few updates each, plus a 2-value lambda
sweep of acl): the report's numbers are the runs' own, a repeated invocation trains nothing,
and every plot is drawn."""

import csv
import json
import re
from pathlib import Path

import pytest

from acl_fairseq.acl_grad import read_angle_log
from acl_fairseq.cli.plots import cli as plots
from acl_fairseq.experiment.predictions import read_predictions

from compare_fakes import fake_results, md_table
from fairseq_helpers import BIN, TINY_ROBERTA, make_dataset_with_test, run

# ----------------------------------------------------------------------------- plots, no model


def test_plots_from_results_without_models(tmp_path, capsys):
    out = tmp_path / "R"
    fake_results(out)
    sweep = tmp_path / "sweep.csv"
    sweep.write_text(
        "policy,threshold,batch_size,accuracy,mean_exit_layer,layer_speedup,wallclock_speedup\n"
        "none,,1,85.0,6,1.0,1.0\nentropy,0.1,1,84.5,4.0,1.5,1.3\nentropy,0.3,1,80.0,2.0,3.0,2.4\n"
        "none,,32,85.0,6,1.0,1.0\nentropy,0.1,32,84.5,4.0,1.5,1.1\n"
    )
    assert plots.main([str(out), "--sweep-tsv", f"acl_cl={sweep}"]) == 0
    printed = capsys.readouterr().out
    assert "skipped (d) t-SNE of pooled features: needs --data" in printed
    for name in ("angles", "layer_scores", "early_exit", "lambda"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 0
        assert (out / "plots" / f"{name}.csv").exists()
    with open(out / "plots" / "layer_scores.csv") as f:
        rows = {(r["method"], r["layer"]): r for r in csv.DictReader(f)}
    assert float(rows[("acl_cl", "1")]["mean"]) == 72.0
    assert float(rows[("acl_cl", "1")]["std"]) == 1.0
    with open(out / "plots" / "angles_summary.csv") as f:
        (acl,) = list(csv.DictReader(f))
    assert acl["method"] == "acl" and acl["updates"] == "9"
    assert float(acl["frac_over_90"]) == pytest.approx(2 / 3)
    with open(out / "plots" / "lambda.csv") as f:
        rows = list(csv.DictReader(f))
    assert [
        (r["method"], r["lambda"], r["chosen_on_dev"]) for r in rows if r["method"] == "acl"
    ] == [
        ("acl", "0.1", "0"),
        ("acl", "0.5", "0"),
        ("acl", "1", "1"),
    ]
    # nothing to draw from: every plot says why it was skipped
    empty = tmp_path / "empty"
    (empty / "runs").mkdir(parents=True)
    assert plots.main([str(empty)]) == 0
    assert capsys.readouterr().out.count("skipped") == 5


# ----------------------------------------------------------------------------- end to end


def make_data_with_test(root: Path) -> Path:
    """train 64 / valid (dev) 32 / test 32, binarized in the sentence_prediction layout."""
    return make_dataset_with_test(root)


def _cells(md: str, title: str) -> dict[str, list[str]]:
    return {r[0]: r for r in md_table(md, title)}


@pytest.mark.slow
def test_compare_then_plots_end_to_end(tmp_path):
    data = make_data_with_test(tmp_path)
    out = tmp_path / "RESULTS"
    base = [
        str(BIN / "acl-fairseq-compare"), str(data),
        "--arch-args", " ".join(TINY_ROBERTA), "--restore-file", "none",
        "--seeds", "1", "--lr", "1e-3", "--log-interval", "1", "--out", str(out), "--cpu",
    ]  # fmt: skip
    first = run(base, timeout=1800)
    assert "5 trained, 0 only evaluated, 0 done before, 0 failed" in first
    # the lambda sweep of acl adds one run; lambda 0.5 is the main acl run, not trained again
    sweep = run([*base, "--methods", "acl", "--lambdas", "0.1,0.5"], timeout=1800)
    assert "1 trained, 0 only evaluated, 1 done before, 0 failed" in sweep
    assert not (out / "runs" / "acl-lam0.1-seed1" / "checkpoint_best.pt").exists()
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/test.json")}
    assert len(stamps) == 6
    again = run(base, timeout=600)
    assert "0 trained, 0 only evaluated, 5 done before, 0 failed" in again
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/test.json")} == stamps

    results = {p.parent.name: json.loads(p.read_text()) for p in out.glob("runs/*/test.json")}
    for name, r in results.items():
        run_dir = out / "runs" / name
        assert (run_dir / "train.log").exists() and (run_dir / "test.log").exists()
        if r["method"] in ("ce_scl", "acl", "acl_cl"):
            angles = read_angle_log(run_dir / "angles.tsv")
            assert len(angles) == r["angles"]["updates"] == 4  # 64 examples / batch 16
            if r["method"] == "ce_scl":  # threshold 180: measured, never dropped
                assert r["acl_grad_threshold"] == 180.0 and all(a.kept for a in angles)
        else:
            assert r["angles"] is None
    assert set(results["acl_cl-seed1"]["test"]) >= {"accuracy_exit1", "accuracy_exit2"}
    # every run keeps its per-example predictions: every exit's, on dev and test, as fairseq
    # scored them
    for name, r in results.items():
        splits = read_predictions(out / "runs" / name / "predictions.tsv")
        assert set(splits) == {"valid", "test"} and len(splits["test"].labels) == 32
        for metric, value in r["test"].items():
            if metric.startswith("accuracy"):
                layer = int(metric[len("accuracy_exit") :]) if "exit" in metric else None
                assert splits["test"].accuracy(layer) == pytest.approx(value, abs=0.05), name
        multi_exit = name.startswith(("acl_cl", "multi_exit_joint"))
        assert sorted(splits["test"].exits) == ([1, 2] if multi_exit else [2])

    # the report's numbers are the runs' own
    md = (out / "results.md").read_text()
    labels = {
        "ce-seed1": "ce",
        "ce_scl-seed1": "ce_scl (λ 0.5)",
        "acl-seed1": "acl (λ 0.5)",
        "multi_exit_joint-seed1": "multi_exit_joint",
        "acl_cl-seed1": "acl_cl (λ 0.5)",
    }
    for title, split in (("## Test accuracy", "test"), ("## Dev accuracy", "dev")):
        cells = _cells(md, title)
        assert set(cells) == set(labels.values())
        for name, label in labels.items():
            mean, std, n, seed1 = cells[label][1:]
            value = results[name][split]["accuracy"]
            assert float(mean) == float(seed1) == pytest.approx(value, abs=0.005)
            assert (std, n) == ("-", "1")
    exits = md_table(md, "## Test accuracy per exit (multi-exit methods)")
    run_of = {label: name for name, label in labels.items()}
    for label, layer, mean, *_ in exits:
        layer = re.match(r"\d+", layer).group(0)
        value = results[run_of[label]]["test"][f"accuracy_exit{layer}"]
        assert float(mean) == pytest.approx(value, abs=0.005)
    assert len(exits) == 4
    sweep_rows = {(r[0], r[1]): r for r in md_table(md, "### Test accuracy")}
    assert float(sweep_rows[("acl", "0.1")][2]) == pytest.approx(
        results["acl-lam0.1-seed1"]["test"]["accuracy"]
    )
    with open(out / "results.csv") as f:
        per_run = list(csv.DictReader(f))
    for row in per_run:
        r = results[row["run"]]
        if row["split"] in ("dev", "test"):
            assert float(row["value"]) == pytest.approx(r[row["split"]][row["metric"]])
    assert {r["run"] for r in per_run} == set(results)

    # pictures: a synthetic early-exit table for (c); everything else from the runs
    sweep_csv = tmp_path / "sweep.csv"
    sweep_csv.write_text(
        "policy,threshold,batch_size,accuracy,mean_exit_layer,layer_speedup,wall_speedup\n"
        "none,,1,60.0,2,1.0,1.0\nentropy,0.5,1,58.0,1.5,1.33,1.2\n"
    )
    printed = run(
        [str(BIN / "acl-fairseq-plots"), str(out), "--data", str(data),
         "--sweep-tsv", f"acl_cl={sweep_csv}"],
        timeout=900,
    )  # fmt: skip
    assert "skipped" not in printed and "FAILED" not in printed
    for name in ("angles", "layer_scores", "early_exit", "tsne", "lambda"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 0, name
        assert (out / "plots" / f"{name}.csv").exists(), name
    with open(out / "plots" / "tsne.csv") as f:
        tsne = list(csv.DictReader(f))
    assert sum(r["kind"] == "sample" for r in tsne) == 2 * 32
    assert sum(r["kind"] == "label_embedding" for r in tsne) == 2 * 2
