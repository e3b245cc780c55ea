"""The converged study's tools: its data splits, its choices on dev, and its report (tables
recomputed here from hand-written runs: means, sample stds, paired differences, angle thirds)."""

import csv
import json
import math
import multiprocessing
import re
import shutil
import statistics
from pathlib import Path

import pytest
from scipy import stats

from acl_fairseq.data import splits
from acl_fairseq.experiment import fewshot
from studies import data as study_data
from studies import paired as study_paired
from studies import phases as study
from studies import records as study_records
from studies import report as study_report
from studies import round2
from studies import runs as study_runs

from fairseq_helpers import (
    TINY_ROBERTA,
    fairseq_train,
    make_dataset_with_test,
    train_args,
)


def _choose_many(work: str, prefix: str, n: int) -> None:
    chain = study.Study(Path(work), "fewshot-dev")
    for i in range(n):
        chain.choose(f"{prefix}{i}", {"0.0001": float(i)}, 1e-4)


def test_two_chains_of_one_phase_lose_no_choice(tmp_path):
    """Two processes choosing into one choices.json at once (two ``--methods`` chains of a
    phase): every choice of both is in the file afterwards."""
    context = multiprocessing.get_context("fork")
    chains = [context.Process(target=_choose_many, args=(str(tmp_path), p, 150)) for p in "ab"]
    for chain in chains:
        chain.start()
    for chain in chains:
        chain.join(timeout=120)
        assert chain.exitcode == 0
    chosen = json.loads((tmp_path / "runs" / "fewshot-dev" / "choices.json").read_text())
    assert set(chosen) == {f"{p}{i}" for p in "ab" for i in range(150)}
    assert chosen["b7"] == {"chosen": 1e-4, "dev_accuracy": {"0.0001": 7.0}}


def test_fewshot_dev_reports_a_draw_once_every_learning_rate_ran():
    """fewshot-dev: per draw, the run of the best dev accuracy over the learning rates (the
    first on a tie); a draw whose learning rates have not all run yet is not reported."""

    def run(draw: int, lr: float, dev: float, task: str = "fewshot-dev") -> dict:
        folder = f"{task}/k16/d{draw}/{study.lr_name(lr)}"
        return {"folder": folder, "run": f"ce-seed{draw}", "method": "ce", "seed": draw,
                "dev_accuracy": dev}  # fmt: skip

    lrs = fewshot.LEARNING_RATES
    done = [run(1, lr, dev) for lr, dev in zip(lrs, (60.0, 65.0, 65.0))]
    unfinished = [run(2, lr, dev) for lr, dev in zip(lrs[:-1], (50.0, 70.0))]
    other = [run(1, lr, 90.0, task="fewshot-other") for lr in lrs]
    draws = study_paired.fewshot_draws([*other, *unfinished, *done[::-1]], "fewshot-dev")
    assert dict(draws) == {(16, "ce"): {1: done[1]}}


def test_movie_splits_keep_the_demos_dev_and_test():
    rows = [(f"s{i}", "positive" if i % 3 else "negative") for i in range(5000)]
    splits = study_data.movie_splits(rows)
    assert splits["dev"] == rows[1600:2200] and splits["test"] == rows[2200:4200]
    assert splits["train"] == rows[:1600] + rows[4200:]
    assert sum(map(len, splits.values())) == len(rows)


def test_fewshot_draws_k_per_class_from_train_only():
    """The study draws with the library's few-shot draws (acl-fairseq-fewshot's)."""
    assert study_data.fewshot_train is splits.fewshot_train
    assert study_data.fewshot_train_dev is splits.fewshot_train_dev
    train = [(f"s{i}", "positive" if i % 3 else "negative") for i in range(300)]
    one = study_data.fewshot_train(train, 16, seed=1)
    assert sorted(label for _, label in one).count("negative") == 16 and len(one) == 32
    assert set(one) <= set(train) and len(set(one)) == 32
    assert one == study_data.fewshot_train(train, 16, seed=1)
    assert set(one) != set(study_data.fewshot_train(train, 16, seed=2))
    with pytest.raises(ValueError, match="negative has 100"):
        study_data.fewshot_train(train, 101, seed=1)


def test_choice_is_the_best_dev_score_first_in_grid_order_on_ties():
    """Every choice of the study is the protocol's (acl_fairseq.experiment.fewshot)."""
    assert study.best_on_dev is fewshot.best_on_dev and round2.fewshot is fewshot
    assert study.best_on_dev({"a": 80.0, "b": 81.5, "c": 81.5}) == "b"
    assert study.best_on_dev({"0.1,0.3": 79.0}) == "0.1,0.3"


def _write_run(out, method, seed, dev, test, angles=None, stage1=None, updates=100):
    run_dir = out / "runs" / f"{method}-seed{seed}"
    run_dir.mkdir(parents=True)
    checkout = Path("/srv/study-worktree")  # the study's own checkout (a git worktree)
    command = [str(checkout / ".venv/bin/fairseq-train"), str(out / "no-data"), "--lr", "5e-05"]
    if method in ("ce_scl", "acl", "acl_cl"):
        command += ["--contrastive-lambda", "0.5", "--temperature", "0.3"]
    meta = {"method": method, "seed": seed, "stage1": stage1, "train_command": command}
    (run_dir / "run.json").write_text(json.dumps(meta))
    result = {**meta, "dev": {"accuracy": dev, "num_updates": updates - 10}, "test": test}
    del result["train_command"]
    (run_dir / "test.json").write_text(json.dumps(result))
    log = [
        f'x | valid | {{"valid_accuracy": "{dev - 1}", "valid_num_updates": "{updates // 2}"}}',
        f'x | valid | {{"valid_accuracy": "{dev}", "valid_num_updates": "{updates - 10}"}}',
        f'x | train | {{"train_num_updates": "{updates}", "train_loss": "0.1"}}',
    ]
    (run_dir / "train.log").write_text(
        "\n".join(log) + f"\n{out}/private/path\n--user-dir {checkout}/acl_fairseq\n"
    )
    if angles:
        (run_dir / "angles.tsv").write_text(
            "".join(f"{u}\t{a}\t{int(a <= 90)}\t0\n" for u, a in enumerate(angles, 1))
        )


def test_report_tables_are_the_runs_own_numbers(tmp_path):
    work = tmp_path / "work"
    main = work / "runs" / "movie" / "main"
    ce = {1: 80.0, 2: 81.0, 3: 79.5}
    acl = {1: 81.0, 2: 80.5, 3: 80.5}
    for seed in (1, 2, 3):
        _write_run(main, "ce", seed, 82.0, {"accuracy": ce[seed]}, updates=300)
        angles = [50.0, 70.0, 95.0, 100.0, 40.0, 80.0] if seed == 1 else None
        _write_run(main, "acl", seed, 83.0, {"accuracy": acl[seed]}, angles=angles)
        joint = {"accuracy": 81.0, "accuracy_exit1": 60.0 + seed}
        _write_run(main, "multi_exit_joint", seed, 82.0, joint, stage1=f"ce-seed{seed}")
        acl_cl = {"accuracy": 81.0, "accuracy_exit1": 61.0 + 2 * seed}
        _write_run(main, "acl_cl", seed, 82.0, acl_cl, stage1=f"acl-seed{seed}")
    for k in (16, 64):
        for seed in (1, 2):
            out = work / "runs" / "fewshot" / f"k{k}" / f"s{seed}"
            _write_run(out, "ce", seed, 60.0, {"accuracy": 55.0 + k / 16 + seed})
            _write_run(out, "acl", seed, 60.0, {"accuracy": 56.0 + k / 16})
            if k == 16:
                _write_run(out, "ce_scl", seed, 60.0, {"accuracy": 58.0})
    grid = work / "runs" / "movie" / "grid"
    _write_run(grid / "acl-lam0.1-tau0.3", "acl", 1, 81.0, {"accuracy": 79.0})
    _write_run(grid / "acl-lam0.5-tau0.3", "acl", 1, 82.5, {"accuracy": 79.5})
    variant = work / "runs" / "movie" / "variants" / "live-exit-0.5"  # restores main's ACL run
    (variant / "runs").mkdir(parents=True)
    (variant / "runs" / "acl-seed1").symlink_to(main / "runs" / "acl-seed1")
    _write_run(variant, "acl_cl", 1, 82.5, {"accuracy": 81.0}, stage1="acl-seed1")
    exits = work / "runs" / "movie" / "earlyexit"
    exits.mkdir(parents=True)
    (exits / "acl_cl-seed1.tsv").write_text(
        "policy\tthreshold\tbatch_size\taccuracy\tmean_exit_layer\tlayer_speedup\twall_speedup\n"
        "entropy\t0.1\t32\t82.0\t5.0\t1.2\t1.1\nentropy\t0.5\t32\t78.0\t2.0\t3.0\t2.5\n"
    )
    docs = tmp_path / "docs"
    assert study_report.main(["--work-dir", str(work), "--out", str(docs)]) == 0
    with open(docs / "figures" / "lambda.csv") as f:
        assert [r["lambda_tau"] + " " + r["dev"] for r in csv.DictReader(f)] == [
            "0.1-tau0.3 81.0",
            "0.5-tau0.3 82.5",
        ]
    assert (docs / "figures" / "early_exit.png").stat().st_size > 0
    assert (docs / "earlyexit" / "movie" / "acl_cl-seed1.tsv").exists()
    readme = (docs / "README.md").read_text()
    assert "## Paired differences" in readme and "| full | acl | ce | accuracy | 3 |" in readme

    with open(docs / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert list(summary[0]) == study_report.SUMMARY_COLUMNS

    def row(study_, method, split, metric, variant_start=""):
        (found,) = [
            r for r in summary
            if (r["study"], r["method"], r["split"], r["metric"]) == (study_, method, split, metric)
            and r["variant"].startswith(variant_start)
        ]  # fmt: skip
        return found

    r = row("full", "acl", "test", "accuracy", "lr=")
    assert float(r["mean"]) == pytest.approx(statistics.fmean(acl.values()), abs=1e-3)
    assert float(r["std"]) == pytest.approx(statistics.stdev(acl.values()), abs=1e-3)
    assert r["seeds"] == "3" and r["updates_per_stage"] == "100"
    assert "lambda=0.5" in r["variant"] and "tau=0.3" in r["variant"]
    assert (
        row("full", "multi_exit_joint", "test", "accuracy_exit1")["updates_per_stage"] == "300+100"
    )
    assert float(row("full", "ce", "dev", "accuracy")["mean"]) == 82.0
    # a stage-1 run linked into a variant's folder is reported once, in its own folder
    assert row("full", "acl_cl", "dev", "accuracy", "variants/")["updates_per_stage"] == "100+100"
    assert not [r for r in summary if r["method"] == "acl" and r["variant"].startswith("var")]
    few = row("fewshot", "ce", "test", "accuracy", "k=64")
    assert float(few["mean"]) == pytest.approx(60.5) and few["seeds"] == "2"

    with open(docs / "paired.csv") as f:
        paired = {
            (r["study"], r["method"], r["baseline"], r["metric"]): r for r in csv.DictReader(f)
        }
    p = paired[("full", "acl", "ce", "accuracy")]
    diffs = [acl[s] - ce[s] for s in (1, 2, 3)]
    assert p["per_seed_difference"] == "+1.00 -0.50 +1.00"
    assert float(p["mean_difference"]) == pytest.approx(statistics.fmean(diffs), abs=1e-3)
    expected_p = stats.ttest_rel(list(acl.values()), list(ce.values())).pvalue
    assert float(p["paired_t_p"]) == pytest.approx(expected_p, abs=1e-4)
    exit1 = paired[("full", "acl_cl", "multi_exit_joint", "accuracy_exit1")]
    assert exit1["per_seed_difference"] == "+2.00 +3.00 +4.00"
    # the final exit of both multi-exit models against CE (single exit): 81.0 - ce
    final = paired[("full", "acl_cl", "ce", "accuracy")]["per_seed_difference"]
    assert final == " ".join(f"{81.0 - ce[s]:+.2f}" for s in (1, 2, 3))
    assert ("full", "multi_exit_joint", "ce", "accuracy") in paired
    assert paired[("fewshot k16", "acl", "ce", "accuracy")]["per_seed_difference"] == "+0.00 -1.00"
    # ACL against CE+SCL too; the same difference in every draw has no t-test p-value
    vs_scl = paired[("fewshot k16", "acl", "ce_scl", "accuracy")]
    assert vs_scl["per_seed_difference"] == "-1.00 -1.00" and vs_scl["paired_t_p"] == ""
    assert ("fewshot k64", "acl", "ce_scl", "accuracy") not in paired  # no CE+SCL run at k=64
    with open(docs / "figures" / "fewshot.csv") as f:
        curve = [(r["per_class"], r["method"], r["n"], float(r["mean"])) for r in csv.DictReader(f)]
    assert curve == [("16", "ce", "2", 57.5), ("64", "ce", "2", 60.5), ("16", "ce_scl", "2", 58.0),
                     ("16", "acl", "2", 57.0), ("64", "acl", "2", 60.0)]  # fmt: skip
    assert (docs / "figures" / "fewshot.png").stat().st_size > 0

    with open(docs / "angles.csv") as f:
        angles = {r["part"]: r for r in csv.DictReader(f)}
    assert angles["early"]["mean_angle"] == "60.0" and angles["late"]["updates"] == "2"
    assert float(angles["all"]["pct_over_90"]) == pytest.approx(100 * 2 / 6, abs=0.1)
    assert angles["middle"]["dropped"] == "2" and angles["all"]["dropped"] == "2"
    with open(docs / "runs.csv") as f:
        dropped = {(r["folder"], r["run"]): r["updates_dropped"] for r in csv.DictReader(f)}
    assert dropped[("movie/main", "acl-seed1")] == "2"  # next to its accuracy, per run
    assert dropped[("movie/main", "acl-seed2")] == dropped[("movie/main", "ce-seed1")] == ""
    with open(docs / "agreement.csv") as f:
        agreement = {(r["scope"], r["threshold"]): r for r in csv.DictReader(f)}
    # the log's heads-only angle is 0: the head scope never drops, the exact one 2 of 6 at 90
    head90 = agreement[("head", "90")]
    assert (head90["exact_drops"], head90["scope_drops"]) == ("2", "0")
    assert float(head90["pct_agree"]) == pytest.approx(100 * 4 / 6, abs=0.1)

    log = (docs / "runs" / "movie" / "main" / "ce-seed1" / "train.log").read_text()
    assert "<work>/runs/movie/main/private/path" in log and str(work) not in log
    assert "--user-dir <repo>/acl_fairseq" in log
    assert (docs / "figures" / "dev_curves.png").stat().st_size > 0
    with open(docs / "figures" / "fewshot.csv") as f:
        curve = {(r["per_class"], r["method"]): r for r in csv.DictReader(f)}
    assert float(curve[("16", "ce")]["mean"]) == pytest.approx(57.5)
    assert not math.isnan(float(curve[("16", "ce")]["std"]))


def test_restore_puts_committed_results_back_for_resuming(tmp_path):
    work = tmp_path / "work"
    out = work / "runs" / "movie" / "lr" / "lr5e-05"
    _write_run(out, "ce", 1, 82.0, {"accuracy": 80.0})
    docs = tmp_path / "docs"
    study_report.main(["--work-dir", str(work), "--out", str(docs)])
    elsewhere = tmp_path / "elsewhere"
    assert study_runs.restore(elsewhere, docs) == 1
    run_dir = elsewhere / "runs" / "movie" / "lr" / "lr5e-05" / "runs" / "ce-seed1"
    assert json.loads((run_dir / "test.json").read_text())["test"]["accuracy"] == 80.0
    assert (run_dir / "train.done").exists() and "<work>" not in (run_dir / "train.log").read_text()
    assert (
        f"{elsewhere.resolve()}/runs/movie/lr/lr5e-05/private/path"
        in (run_dir / "train.log").read_text()
    )
    assert study.dev_accuracy(run_dir.parent.parent, "ce-seed1") == 82.0
    assert study_runs.restore(elsewhere, docs) == 0  # nothing twice
    # a stage-1 run without its checkpoint is trained again only for an unfinished stage 2
    finished_stage2 = elsewhere / "runs" / "movie" / "lr" / "lr5e-05" / "runs" / "ce-seed1"
    assert study_runs.need_checkpoints(run_dir.parent.parent, ["ce-seed1"], [finished_stage2]) == []
    assert (run_dir / "test.json").exists()
    unfinished = tmp_path / "nowhere" / "runs" / "multi_exit_joint-seed1"
    moved = study_runs.need_checkpoints(run_dir.parent.parent, ["ce-seed1"], [unfinished])
    assert moved == ["ce-seed1"] and not (run_dir / "test.json").exists()
    assert (run_dir.parent / "ce-seed1.restored.json").exists()


def test_report_refuses_to_lose_committed_seeds(tmp_path):
    work = tmp_path / "work"
    main = work / "runs" / "movie" / "main"
    for seed in (1, 2, 3):
        _write_run(main, "ce", seed, 82.0, {"accuracy": 80.0 + seed})
    docs = tmp_path / "docs"
    assert study_report.main(["--work-dir", str(work), "--out", str(docs)]) == 0
    committed = (docs / "summary.csv").read_text()
    for name in ("test.json", "run.json"):
        (main / "runs" / "ce-seed3" / name).unlink()
    with pytest.raises(SystemExit, match="full / ce / lr=5e-05 / test / accuracy: 3 -> 2 seeds"):
        study_report.main(["--work-dir", str(work), "--out", str(docs)])
    assert (docs / "summary.csv").read_text() == committed
    assert study_report.main(["--work-dir", str(work), "--out", str(docs), "--allow-fewer"]) == 0
    assert (docs / "summary.csv").read_text() != committed


TINY_STUDY_PHASES = [
    "movie-lr", "movie-grid", "movie-seeds", "movie-variants", "movie-exits", "movie-earlyexit",
]  # fmt: skip


def _tiny_study(monkeypatch, root: Path) -> Path:
    """A study work folder with a tiny generated task and a tiny pretrained RoBERTa, and the
    study's protocol shrunk to it (one learning rate, one lambda, 2 seeds, 2 variants)."""
    monkeypatch.setattr(study, "GRID", ((0.5, 0.3),))
    monkeypatch.setattr(study, "SEEDS", (1, 2))
    monkeypatch.setattr(study, "BATCH", 16)
    monkeypatch.setattr(study, "ACL_EXTRA", "--acl-grad-log-top-k 1")
    monkeypatch.setattr(study, "EXIT_THRESHOLDS", "0.3,0.6")
    movie = {"data": "movie-bin", "lrs": (1e-3,), "epochs": 1, "stage2_epochs": 1}
    monkeypatch.setattr(study, "TASKS", {"movie": movie})
    variants = {"live-exit-0.5": ("live", "exit", 0.5), "frozen-exit-0.5": ("frozen", "exit", 0.5)}
    monkeypatch.setattr(study, "VARIANTS", variants)
    work = root / "work"
    data = make_dataset_with_test(root / "tiny", (64, 32, 32))
    shutil.copytree(data, work / "data" / "movie-bin")
    model = work / "minilm-fairseq"
    pretrain = train_args(criterion="sentence_prediction", max_update=1, disable_validation=True)
    fairseq_train(data, root / "pretrain", *pretrain)
    model.mkdir()
    shutil.copyfile(root / "pretrain" / "checkpoint_last.pt", model / "model.pt")
    (model / "fairseq_args.txt").write_text(" ".join(TINY_ROBERTA) + "\n")
    return work


@pytest.mark.slow
def test_restore_then_every_phase_trains_nothing_and_report_reproduces_docs(
    tmp_path, monkeypatch, capfd
):
    """The real path of a study resumed on another machine: the phases, their report,
    ``restore`` into a fresh work folder (same data and model, no checkpoints), the phases
    again (nothing trained, nothing unlinked), and a report identical byte for byte."""
    work = _tiny_study(monkeypatch, tmp_path)
    phases = [*TINY_STUDY_PHASES, "--work-dir", str(work), "--threads", "1"]
    assert study.main(phases) == 0
    docs = tmp_path / "docs"
    assert study_report.main(["--work-dir", str(work), "--out", str(docs)]) == 0
    capfd.readouterr()
    chosen = json.loads((work / "runs" / "movie" / "choices.json").read_text())["acl_cl"]
    assert (docs / "links.csv").read_text().splitlines() == [
        "folder,run,target",
        "movie/main,acl-seed1,movie/grid/acl-lam0.5-tau0.3",
        f"movie/main,acl_cl-seed1,movie/variants/{chosen['chosen']}",
        "movie/main,ce-seed1,movie/lr/lr0.001",
        "movie/variants/frozen-exit-0.5,acl-seed1,movie/grid/acl-lam0.5-tau0.3",
        "movie/variants/live-exit-0.5,acl-seed1,movie/grid/acl-lam0.5-tau0.3",
    ]
    assert list((docs / "earlyexit" / "movie").glob("*.tsv"))

    fresh = tmp_path / "fresh"  # another machine: the data and the model, then restore
    shutil.copytree(work / "data", fresh / "data")
    shutil.copytree(work / "minilm-fairseq", fresh / "minilm-fairseq")
    assert study.main(["restore", "--work-dir", str(fresh), "--docs", str(docs)]) == 0
    assert not list((fresh / "runs").glob("**/*.pt"))
    assert study.main([*TINY_STUDY_PHASES, "--work-dir", str(fresh), "--threads", "1"]) == 0
    printed = capfd.readouterr().out
    assert not re.search(r"[1-9]\d* trained,|: training \d+ updates|trained again", printed)
    assert "done before" in printed
    again = tmp_path / "docs-again"
    shutil.copytree(docs, again)
    assert study_report.main(["--work-dir", str(fresh), "--out", str(again)]) == 0
    files = sorted(p.relative_to(docs) for p in docs.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for name in files:
        assert (docs / name).read_bytes() == (again / name).read_bytes(), name

    # a stage 2 still to train: its stage 1 (a link, restored without checkpoint) is trained
    # again where it lives, and the result is checked against the committed one
    variant = fresh / "runs" / "movie" / "variants" / "live-exit-0.5" / "runs" / "acl_cl-seed1"
    (variant / "test.json").unlink()
    assert study.main(["movie-variants", "--work-dir", str(fresh), "--threads", "1"]) == 0
    printed = capfd.readouterr().out
    stage1 = fresh / "runs" / "movie" / "grid" / "acl-lam0.5-tau0.3" / "runs" / "acl-seed1"
    assert (stage1 / "checkpoint_best.pt").exists() and (variant / "test.json").exists()
    assert (fresh / "runs" / "movie" / "main" / "runs" / "acl-seed1").is_symlink()
    assert re.search(r"acl-seed1: trained again, .*: identical", printed), printed


def test_second_round_phases_run_seed_by_seed_and_share_by_method(tmp_path, monkeypatch):
    """The order and the part of a phase a process runs (--methods, --seeds): what a study
    cut short or shared by two processes ends up with."""
    calls: list[tuple[str, str, str]] = []

    def record(self, out, args):
        method, seed = args[args.index("--methods") + 1], args[args.index("--seeds") + 1]
        calls.append((str(out.relative_to(tmp_path / "runs")), method, seed))

    monkeypatch.setattr(study.Study, "compare", record)
    monkeypatch.setattr(round2, "count_examples", lambda data: 6000)
    both = round2.Round2(tmp_path, "pair-converged", seeds=[1, 2])
    both.choose("cap_epochs", {"best_dev_update": 564}, 3)
    both.pair_main()
    assert calls == [
        ("pair-converged/main", m, s) for s in "12" for m in ("ce", "acl", "acl_embed")
    ]
    calls.clear()
    round2.Round2(tmp_path, "pair-converged", methods=["acl"]).pair_main()
    assert calls == [("pair-converged/main", "acl", str(s)) for s in round2.SEEDS]
    with pytest.raises(SystemExit, match="--methods"):
        round2.Round2(tmp_path, "pair-converged", methods=["acl_cl"]).pair_main()
    calls.clear()
    round2.Round2(tmp_path, "lambda", methods=["acl"], seeds=[3]).lambda_study()
    ((folder, method, seed),) = calls
    assert (folder, method, seed) == ("lambda/main", "acl", "3")
    calls.clear()
    round2.run_phase(tmp_path, "pair-converged-fp32")  # the precision check: seed 1, CE and ACL
    assert calls == [("pair-converged/fp32", m, "1") for m in ("ce", "acl")]


def test_second_round_precision_is_one_per_comparison(tmp_path, monkeypatch):
    """pair-converged and fewshot-dev train every method under bf16 autocast; the phases begun
    in fp32 and the pair precision check do not; the report tells the two apart."""
    extras: dict[tuple[str, str], set[str]] = {}

    def record(self, out, args):
        rel = out.relative_to(tmp_path / "runs").parts
        folder = "/".join(rel[:2]) if rel[0] == "pair-converged" else rel[0]
        key = (folder, args[args.index("--methods") + 1])
        extras.setdefault(key, set()).add(args[args.index("--extra") + 1])

    monkeypatch.setattr(study.Study, "compare", record)
    monkeypatch.setattr(round2, "count_examples", lambda data: 96)
    monkeypatch.setattr(round2, "dev_accuracy", lambda out, run: 50.0)
    monkeypatch.setattr(round2.Round2, "early_exit_on_dev", lambda self, out, run: None)
    monkeypatch.setattr(round2, "link_run", lambda *a: None)
    for k in round2.FEWSHOT_DEV_SIZES:
        for d in round2.FEWSHOT_DEV_DRAWS:
            (tmp_path / "data" / round2.fewshot_dev_data(k, d)).mkdir(parents=True)
    round2.Round2(tmp_path, "pair-converged").choose("cap_epochs", {}, 3)
    for phase in ("pair-converged", "pair-converged-fp32", "lambda", "fewshot-dev",
                  "acl-cl-same-start"):  # fmt: skip
        round2.run_phase(tmp_path, phase, seeds=[1])
    bf16 = {key for key, ex in extras.items() if all("--autocast bf16" in e for e in ex)}
    fp32 = {key for key, ex in extras.items() if not any("--autocast" in e for e in ex)}
    assert bf16 | fp32 == set(extras)  # no comparison mixes precisions
    assert {folder for folder, _ in bf16} == {"pair-converged/main", "fewshot-dev"}
    main = {m for folder, m in bf16 if folder == "pair-converged/main"}
    assert main == {"ce", "acl", "acl_embed"}
    assert {m for folder, m in fp32 if folder == "pair-converged/fp32"} == {"ce", "acl"}
    assert {("lambda", "acl"), ("lambda", "ce_scl"), ("acl-cl-same-start", "acl_cl")} <= fp32
    cmd = ["fairseq-train", "DATA", "--lr", "0.0001", "--contrastive-lambda", "0.1"]
    cmd += ["--temperature", "0.3"]
    assert study_records.variant_of("acl", cmd) == "lr=0.0001 lambda=0.1 tau=0.3"
    assert study_records.variant_of("acl", [*cmd, "--autocast", "bf16"]).endswith(" autocast=bf16")
    assert study_records.variant_of("ce", [*cmd, "--autocast", "none"]) == "lr=0.0001"


def test_a_run_evaluated_by_a_later_call_keeps_its_training_time():
    """compare records the time of the call that evaluated a run: the evaluation alone when an
    earlier call trained it; the report then adds fairseq's own training clock."""
    inner = [{"wall": "100"}, {"wall": "4114"}]
    train = [{"train_wall": "4208", "train_train_wall": "847"}]  # the process clock, not train's
    seconds = study_records.run_seconds
    assert seconds(253.1, train, inner) == pytest.approx(4461.1)  # evaluated by a later call
    assert seconds(253.1, [], inner) == pytest.approx(4367.1)  # no epoch record: the last step's
    assert seconds(4300.0, train, inner) == 4300.0  # trained and evaluated in one call
    assert seconds(12.0, [], []) == 12.0 and seconds(None, train, inner) is None


def test_a_run_s_checkout_is_its_plugin_s_folder():
    """The checkout written as <repo> in docs/study: the --user-dir's, else fairseq-train's."""
    cmd = ["/a/.venv/bin/fairseq-train", "DATA", "--user-dir", "/b/acl_fairseq", "--lr", "1"]
    assert study_records.checkout_of(cmd) == "/b"  # the plugin's checkout, not the venv's
    assert study_records.checkout_of(cmd[:2]) == "/a"
    assert study_records.checkout_of(["fairseq-train", "DATA"]) is None


def test_the_fewshot_commands_results_become_rows_of_summary_and_paired(tmp_path):
    """A folder kept under fewshot-tool/: its draws' mean and sample std per method and split,
    and its comparisons with the command's own p-values, Holm values and verdict."""
    from studies.fewshot_tool import tool_paired_rows, tool_summary_rows

    folder = tmp_path / "fewshot-tool" / "pairs-k4"
    run = folder / "runs" / "k4-d1" / "lr0.0001" / "runs" / "ce-seed1"
    run.mkdir(parents=True)
    (run / "command.txt").write_text("fairseq-train bin --num-classes 3 --max-update 60 --cpu")
    tests = {"ce": [40.0, 43.0, 41.5], "acl": [42.0, 42.5, 45.0]}
    draws = [{"per_class": 4, "draw": d + 1, "method": m, "lr": 1e-4, "dev": 50.0 + d, "test": t}
             for m, values in tests.items() for d, t in enumerate(values)]  # fmt: skip
    comparison = {
        "per_class": 4, "method": "acl", "baseline": "ce", "draws": [1, 2, 3],
        "per_draw_difference": [2.0, -0.5, 3.5], "mean_difference": 5 / 3, "std": 2.02,
        "paired_t_p": 0.3, "example_draws": 3, "ours_only": 30, "theirs_only": 20,
        "mcnemar_p": 0.2, "bootstrap_low": -0.123, "bootstrap_high": 3.456, "bootstrap_p": 0.2,
        "paired_t_holm": 0.6, "mcnemar_holm": 0.4, "verdict": "no verdict",
    }  # fmt: skip
    result = {"test_size": 100, "draws": draws, "comparisons": [comparison], "warnings": []}
    (folder / "fewshot.json").write_text(json.dumps(result))

    rows = {(r[1], r[6]): r for r in tool_summary_rows(tmp_path)}
    assert set(rows) == {(m, s) for m in tests for s in ("dev", "test")}
    acl = rows[("acl", "test")]
    assert acl[:8] == ["fewshot-tool/pairs-k4", "acl", "k=4 per class; lr chosen on a dev of 12",
                       12, 3, "60", "test", "accuracy"]  # fmt: skip
    assert acl[8] == pytest.approx(statistics.mean(tests["acl"]), abs=1e-3)
    assert acl[9] == pytest.approx(statistics.stdev(tests["acl"]), abs=1e-3)
    assert rows[("ce", "dev")][8] == pytest.approx(51.0)

    (row,) = tool_paired_rows(tmp_path)
    cells = dict(zip(study_paired.PAIRED_COLUMNS, study_paired.paired_rows([], [row])[0]))
    assert cells["family"] == "fewshot-tool/pairs-k4" and cells["study"].endswith(" k4")
    assert cells["per_seed_difference"] == "+2.00 -0.50 +3.50" and cells["seeds"] == 3
    assert (cells["mean_difference"], cells["bootstrap_low"], cells["bootstrap_high"]) == (
        1.667, -0.12, 3.46)  # fmt: skip
    assert (cells["paired_t_holm"], cells["mcnemar_holm"], cells["verdict"]) == (
        0.6, 0.4, "no verdict")  # fmt: skip
