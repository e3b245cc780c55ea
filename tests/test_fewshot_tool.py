"""``acl-fairseq-fewshot``: its input errors, a pool that never leaks into training or dev,
re-runs of an ``--out`` (other settings named, --force, the first version's record), the report
of a finished folder without training (--report-only), and a whole run on tiny data and a tiny
model. The fast tests replace acl-fairseq-compare by ``FakeCompare`` (it writes each run's
test.json and predictions.tsv as compare does, without training); the data is prepared for
real."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
import shutil
from pathlib import Path

import pytest
from scipy import stats

from acl_fairseq.cli.compare import cli as compare_cli
from acl_fairseq.cli.fewshot import cli as fewshot_cli
from acl_fairseq.cli.fewshot import record
from acl_fairseq.data.splits import check_disjoint, count_examples, fewshot_train_dev, split_off
from acl_fairseq.experiment.predictions import SplitPredictions, write_predictions

from fairseq_helpers import TINY_ROBERTA, write_tsv

TINY = ["--arch-args", " ".join(TINY_ROBERTA), "--tokenizer", "sentencepiece",
        "--spm-vocab-size", "100", "--cpu"]  # fmt: skip
SMALL = ["--per-class", "4", "--draws", "2", "--methods", "ce,acl", "--lrs", "1e-3,3e-3",
         "--updates", "4", "--validate-every", "2", "--batch-size", "4"]  # fmt: skip


class FakeCompare:
    """acl-fairseq-compare as the tool runs it, without training: per method and seed a
    finished run (test.json, predictions.tsv) whose accuracy depends on the method, the
    learning rate and the seed; ``calls`` lists every call's arguments."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, args: list[str]) -> None:
        self.calls.append(args)
        opts = compare_cli.build_parser().parse_args(args)
        sizes = {s: count_examples(opts.data, s) for s in ("valid", "test")}
        for method in opts.methods:
            for seed in opts.seeds:
                run = opts.out / "runs" / f"{method}-seed{seed}"
                run.mkdir(parents=True, exist_ok=True)
                skill = {"ce": 5, "acl": 7}.get(method, 6) + (opts.lr > 2e-3) + seed % 2
                splits = [
                    SplitPredictions(
                        s, [0] * n, {2: [int((i * 7) % 10 >= skill) for i in range(n)]}
                    )  # fmt: skip
                    for s, n in sizes.items()
                ]
                write_predictions(run / "predictions.tsv", splits)
                dev, test = (round(p.accuracy(), 2) for p in splits)
                result = {"method": method, "seed": seed, "dev_subset": "valid",
                          "test_subset": "test", "dev": {"accuracy": dev},
                          "test": {"accuracy": test}}  # fmt: skip
                (run / "test.json").write_text(json.dumps(result))


@pytest.fixture
def fake(monkeypatch) -> FakeCompare:
    compare = FakeCompare()
    monkeypatch.setattr(fewshot_cli, "run_compare", compare)
    return compare


def run_tool(*argv) -> int:
    return fewshot_cli.main([str(a) for a in argv])


def fails(*argv, capsys) -> str:
    assert run_tool(*argv) == 2
    return capsys.readouterr().err


def read_rows(path: Path) -> list[tuple[str, ...]]:
    return [tuple(line.split("\t")) for line in path.read_text().splitlines()]


def draws(out: Path, k: int = 4, n: int = 2) -> dict[int, dict[str, list]]:
    return {d: {s: read_rows(out / "raw" / f"k{k}-d{d}" / f"{s}.tsv")
                for s in ("train", "dev", "test")} for d in range(1, n + 1)}  # fmt: skip


# ----------------------------------------------------------------------- input errors
def test_tool_input_errors(tmp_path, capsys):
    tsv = tmp_path / "data.tsv"
    write_tsv(tsv, 40, 0)
    common = [tsv, "--test-size", "10", "--out", tmp_path / "out"]
    err = fails(*common, "--per-class", "12", *TINY, capsys=capsys)
    assert err.startswith("acl-fairseq-fewshot: error: --per-class 12: the pool has too few ")
    assert "each draw takes 12 per class for training and 12 for dev (24 per class)" in err
    err = fails(*common, capsys=capsys)
    assert err == (
        "acl-fairseq-fewshot: error: give --model M (a converted BERT) or --tokenizer and its "
        "files\n"
    )
    err = fails(*common, "--methods", "ce,acl_cl", *TINY, capsys=capsys)
    assert "--methods: acl_cl; expected some of ce, ce_scl, acl" in err
    err = fails(tsv, "--test-size", "40", "--out", tmp_path / "o", *TINY, capsys=capsys)
    assert "--test-size 40: cannot hold out 40 of 40 rows" in err
    err = fails(*common, "--model", tmp_path, capsys=capsys)
    assert f"--model {tmp_path}: expected the folder acl-fairseq-convert-bert writes" in err
    assert fails(tsv, *TINY, capsys=capsys) == (
        "acl-fairseq-fewshot: error: give the TSV and --test FILE or --test-size N (or "
        "--report-only)\n"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--per-class", "0"], "--per-class 0: must be at least 1"),
        (["--per-class", "-4"], "--per-class -4: must be at least 1"),
        (["--draws", "0", "--batch-size", "0"], "--draws 0, --batch-size 0: must be at least 1"),
        (["--test-size", "0"], "--test-size 0: must be at least 1"),
        (["--lrs", "0,1e-4"],
         "--lrs and --temperature must be above 0, --contrastive-lambda at least 0"),
        (["--text-columns", "1,x"], "--text-columns 1,x --label-column 2: one or two 1-based "
         "text columns and a 1-based label column"),
        (["--label-column", "1"], "--label-column 1 is a text column too"),
        (["--extra", "--x 'a"], "--extra \"--x 'a\": No closing quotation"),
    ],
)  # fmt: skip
def test_numbers_and_columns_are_checked_before_anything_is_read(tmp_path, capsys, flags, message):
    argv = [tmp_path / "absent.tsv", "--test-size", "10", *TINY, *flags]
    assert fails(*argv, capsys=capsys) == f"acl-fairseq-fewshot: error: {message}\n"


def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    """It was a traceback (FileExistsError) after the data was read."""
    tsv, out = tmp_path / "data.tsv", tmp_path / "study.txt"
    write_tsv(tsv, 40, 0)
    out.write_text("notes\n")
    message = (
        f"acl-fairseq-fewshot: error: --out {out}: a file, not a folder: give a folder for the "
        "study (made if missing)\n"
    )
    assert fails(tsv, "--test-size", "10", *TINY, "--out", out, capsys=capsys) == message
    assert fails("--report-only", "--out", out, capsys=capsys) == message
    assert out.read_text() == "notes\n"


def test_texts_longer_than_the_model_stop_before_any_training(tmp_path, fake, capsys, caplog):
    """A test text longer than the model's 64 positions: the draw stops before its first run
    (it trained, then failed with the cause deep in the log), naming --shorten-method."""
    tsv, test = tmp_path / "reviews.tsv", tmp_path / "test.tsv"
    write_tsv(tsv, 40, 0)
    rows = write_tsv(test, 10, 5)
    rows[3][0] = " ".join(f"w{i % 40}" for i in range(300))  # far beyond 64 tokens
    test.write_text("".join("\t".join(r) + "\n" for r in rows))
    argv = [tsv, "--test", test, *SMALL, *TINY]
    err = fails(*argv, "--out", tmp_path / "out", capsys=capsys)
    assert re.fullmatch(
        r"acl-fairseq-fewshot: error: draw k4-d1: 1 of the 10 test examples is longer than "
        r"the model's 64 positions \(the longest has \d+ tokens, counting <s> and the "
        r"separator\): pass --extra '--shorten-method truncate' to cut them, or shorten the "
        r"texts\n",
        err,
    ), err
    assert fake.calls == []
    # no warning before it about acl-fairseq-prepare's --max-tokens, a flag this tool lacks
    assert not [r for r in caplog.records if "--max-tokens" in r.getMessage()]
    truncate = ["--extra", "--shorten-method truncate", "--out", tmp_path / "cut"]
    assert run_tool(*argv, *truncate) == 0
    assert len(fake.calls) == 4  # 2 draws x 2 learning rates


# ----------------------------------------------------------------------- labels
def test_one_label_written_two_ways_is_refused(tmp_path, capsys):
    tsv = tmp_path / "data.tsv"
    rows = [(f"text number {i}", "1" if i % 2 else "0") for i in range(40)]
    rows[7] = ("text number 7", "1.0")
    tsv.write_text("".join(f"{t}\t{label}\n" for t, label in rows))
    err = fails(tsv, "--test-size", "10", *TINY, "--out", tmp_path / "o", capsys=capsys)
    assert err == (
        f"acl-fairseq-fewshot: error: --label-column 2: the labels '1' ({tsv} line 2) and "
        f"'1.0' ({tsv} line 8) are one class written two ways, so they would be two classes: "
        "write each class one way in the label column\n"
    )
    assert not (tmp_path / "o").exists()


def test_a_test_class_the_pool_lacks_and_a_text_of_two_labels_are_refused(tmp_path, capsys):
    tsv, test = tmp_path / "data.tsv", tmp_path / "test.tsv"
    write_tsv(tsv, 40, 0)
    test.write_text("a new text\tpos\nanother text\tneutral\nthird\tneutral\n")
    err = fails(tsv, "--test", test, *TINY, "--out", tmp_path / "o", capsys=capsys)
    assert err == (
        "acl-fairseq-fewshot: error: the test split has the class(es) 'neutral' (2 row(s)), "
        f"which the pool ({tsv} less the test split) lacks: no draw could train on them. Add "
        "examples of them to the TSV\n"
    )
    lines = tsv.read_text().splitlines()
    text, label = lines[3].split("\t")
    lines.append(f"{text}\t{'neg' if label == 'pos' else 'pos'}")
    tsv.write_text("\n".join(lines) + "\n")
    err = fails(tsv, "--test-size", "10", *TINY, "--out", tmp_path / "o", capsys=capsys)
    assert err.startswith(
        f"acl-fairseq-fewshot: error: {tsv}: 1 text(s) have two or more labels, e.g. line 4 "
        f"({label!r}) and line 41"
    )


# ----------------------------------------------------------------------- leakage
def test_a_test_file_that_overlaps_the_pool_never_reaches_training_or_dev(tmp_path, fake, capsys):
    tsv, test = tmp_path / "reviews.tsv", tmp_path / "test.tsv"
    rows = write_tsv(tsv, 80, 0)
    new = write_tsv(tmp_path / "new.tsv", 10, 5)
    test.write_text("".join("\t".join(r) + "\n" for r in rows[:30] + new))  # 30 pool rows
    out = tmp_path / "out"
    assert run_tool(tsv, "--test", test, *SMALL, *TINY, "--out", out) == 0
    printed = capsys.readouterr().out
    assert (
        f"{tsv}: 30 row(s) left out of the pool: their text is in the test file {test}" in printed
    )
    pool = [tuple(r) for r in rows[30:]]
    for splits in draws(out).values():
        check_disjoint(splits)
        assert len(splits["test"]) == 40 and set(splits["train"] + splits["dev"]) <= set(pool)


def test_a_pool_with_repeated_rows_never_shares_a_text_between_splits(tmp_path, fake, capsys):
    tsv = tmp_path / "reviews.tsv"
    rows = [tuple(r) for r in write_tsv(tsv, 60, 0)]
    tsv.write_text("".join("\t".join(r) + "\n" for r in rows + rows))  # every row twice
    out = tmp_path / "out"
    assert run_tool(tsv, "--test-size", "20", *SMALL, *TINY, "--out", out) == 0
    printed = capsys.readouterr().out
    pool, test = split_off(rows + rows, 20, seed=0)
    rest = [r for r in pool if r not in set(test)]
    in_test, repeated = len(pool) - len(rest), len(rest) - len(set(rest))
    assert in_test > 0 and repeated > 0
    assert (
        f"{tsv}: {in_test} row(s) left out of the pool: their text is in the held-out test "
        f"split (a repeated text)\n{tsv}: {repeated} row(s) left out of the pool: an earlier "
        "row has their text\n" in printed
    )
    for splits in draws(out).values():
        check_disjoint(splits)


def test_without_repeated_texts_the_draws_are_the_first_versions(tmp_path, fake):
    """A study begun by the first version is continued with the same draws."""
    tsv = tmp_path / "reviews.tsv"
    rows = [tuple(r) for r in write_tsv(tsv, 120, 0)]
    out = tmp_path / "out"
    assert run_tool(tsv, "--test-size", "30", *SMALL, *TINY, "--out", out) == 0
    pool, test = split_off(rows, 30, seed=0)
    for d, splits in draws(out).items():
        assert (splits["train"], splits["dev"]) == fewshot_train_dev(pool, 4, d)
        assert splits["test"] == test


# ----------------------------------------------------------------------- re-runs
@pytest.fixture
def study(tmp_path, fake, capsys):
    """A finished study (fake compare) and its command line."""
    tsv = tmp_path / "reviews.tsv"
    write_tsv(tsv, 120, 0)
    argv = [tsv, "--test-size", "30", *SMALL, *TINY, "--out", tmp_path / "out"]
    assert run_tool(*argv) == 0
    capsys.readouterr()
    return argv, tmp_path / "out", fake


def test_a_rerun_with_other_settings_names_them_and_force_starts_over(study, capsys):
    argv, out, fake = study
    calls = len(fake.calls)
    spm = argv.index("100")
    err = fails(*argv[:spm], "80", *argv[spm + 1 :], capsys=capsys)
    assert err == (
        f"acl-fairseq-fewshot: error: --out {out} holds a few-shot study made with other "
        "settings (--spm-vocab-size: then 100, now 80): its draws and runs are not this "
        "command's. Pass --force to delete them and start over, or give another --out\n"
    )
    err = fails(*argv, "--updates", "6", "--extra", "--autocast bf16", capsys=capsys)
    assert "(--updates: then 4, now 6; --extra: then --group-by-length --validate-interval " in err
    assert "now --group-by-length --validate-interval 1000 --save-interval 1000 --autocast " in err
    assert len(fake.calls) == calls  # nothing ran
    (out / "runs" / "k4-d1" / "lr0.001" / "stale").mkdir()
    assert run_tool(*argv, "--updates", "6", "--force") == 0
    assert f"--force: deleted the draws, data and runs in {out}" in capsys.readouterr().out
    assert not (out / "runs" / "k4-d1" / "lr0.001" / "stale").exists()
    assert fake.calls[-1][fake.calls[-1].index("--max-update") + 1] == "6"
    assert run_tool(*argv, "--updates", "6") == 0  # the new settings are the folder's now


def test_a_rerun_with_the_same_settings_continues_the_study(study, tmp_path, capsys):
    argv, out, fake = study
    calls = len(fake.calls)
    table = (out / "fewshot.md").read_text()
    moved = [str(Path(a).resolve()) if a == argv[0] else a for a in argv]  # same file, spelt anew
    assert run_tool(*moved, "--extra=--group-by-length", "--workers", "2") == 0
    assert fake.calls[calls:] == fake.calls[:calls] and (out / "fewshot.md").read_text() == table
    assert run_tool(*argv, "--per-class", "4,5", "--lrs", "1e-3,3e-3,1e-2") == 0  # grows
    assert (out / "raw" / "k5-d2" / "train.tsv").is_file()
    assert "### 5 examples per class" in (out / "fewshot.md").read_text()
    tsv = Path(argv[0])
    tsv.write_text(tsv.read_text().replace("\tpos\n", "\tneg\n", 1))
    err = fails(*argv, capsys=capsys)
    assert f"(TSV: then {tsv}, now {tsv} (other contents))" in err


def first_version_record(argv: list, out: Path) -> None:
    """fewshot_input.json as the first version wrote it (identity and command only)."""
    tsv = Path(argv[0])
    test_size = int(argv[argv.index("--test-size") + 1])
    identity = {"files": {str(tsv): hashlib.sha256(tsv.read_bytes()).hexdigest()},
                "split": ["1", 2, False, test_size]}  # fmt: skip
    command = shlex.join(["acl-fairseq-fewshot", *map(str, argv)])
    payload = {"identity": identity, "command": command}
    (out / record.RECORD_FILE).write_text(json.dumps(payload, indent=1) + "\n")


def test_a_folder_of_the_first_version_is_accepted_with_the_same_flags(study, capsys):
    argv, out, fake = study
    first_version_record(argv, out)
    assert run_tool(*argv) == 0
    upgraded = json.loads((out / record.RECORD_FILE).read_text())
    assert upgraded["settings"]["--spm-vocab-size"] == 100 and "identity" in upgraded
    first_version_record(argv, out)
    err = fails(*argv, "--batch-size", "8", capsys=capsys)
    assert "made with other settings (--batch-size: then 4, now 8)" in err


def test_a_draw_of_other_rows_is_never_reused(study, capsys):
    argv, out, _ = study
    dev = out / "raw" / "k4-d2" / "dev.tsv"
    dev.write_text(dev.read_text().splitlines(keepends=True)[1] * 2)  # as a leaky pool drew it
    err = fails(*argv, capsys=capsys)
    assert err.startswith(
        f"acl-fairseq-fewshot: error: --out {out.resolve()}: its draw k4-d2 holds other rows "
        "than this command draws"
    )
    assert run_tool(*argv, "--force") == 0


# ----------------------------------------------------------------------- the report
def test_report_only_rebuilds_the_table_of_a_finished_folder(study, tmp_path, capsys):
    argv, out, fake = study
    table = (out / "fewshot.md").read_text()
    written = json.loads((out / "fewshot.json").read_text())
    assert [(c["method"], c["baseline"]) for c in written["comparisons"]] == [("acl", "ce")]
    assert written["comparisons"][0]["example_draws"] == 2 and written["test_size"] == 30
    (out / "fewshot.md").unlink()
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    calls = len(fake.calls)
    Path(argv[0]).unlink()  # no input file needed
    assert run_tool("--report-only", "--out", copy) == 0
    assert (copy / "fewshot.md").read_text() == table and len(fake.calls) == calls
    assert json.loads((copy / "fewshot.json").read_text()) == written
    assert written["warnings"] == [] and "Warning" not in table
    raw = copy / "raw" / "k4-d2"  # a draw of a leaky pool, reported as it is, with a warning
    test_row = (raw / "test.tsv").read_text().splitlines(keepends=True)[0]
    (raw / "dev.tsv").write_text((raw / "dev.tsv").read_text() + test_row)
    assert run_tool("--report-only", "--out", copy) == 0
    leak = (
        f"draw k4-d2: dev and test share 1 text(s), e.g. ({test_row.split(chr(9))[0]!r},): its "
        "dev or test accuracy counts examples it was trained or chosen on"
    )
    assert capsys.readouterr().err == f"acl-fairseq-fewshot: warning: {leak}\n"
    assert (copy / "fewshot.md").read_text() == f"{table}\n**Warning**: {leak}\n"
    assert json.loads((copy / "fewshot.json").read_text())["warnings"] == [leak]
    shutil.rmtree(copy / "runs" / "k4-d2" / "lr0.003")
    err = fails("--report-only", "--out", copy, capsys=capsys)
    assert err.startswith("acl-fairseq-fewshot: error: --report-only: ")
    assert "lr0.003/runs/ce-seed2/test.json: not found (the run is not finished); run the " in err


def test_report_only_on_a_folder_of_the_first_version(tmp_path, capsys):
    """Its layout (runs/k16-d1/lr0.0001/runs/ce-seed1/{test.json,predictions.tsv}) and its
    record (the command only), without data folders."""
    out = tmp_path / "FEWSHOT"
    n = 50
    for d in (1, 2):
        for lr in (1e-4, 2e-4):
            for m, right in (("ce", 25), ("acl", 40 + d)):
                run = out / "runs" / f"k16-d{d}" / f"lr{lr:g}" / "runs" / f"{m}-seed{d}"
                run.mkdir(parents=True)
                right -= 5 * (lr == 2e-4)
                split = SplitPredictions("test", [1] * n, {6: [int(i < right) for i in range(n)]})
                write_predictions(run / "predictions.tsv", [split])
                result = {"dev_subset": "valid", "test_subset": "test",
                          "dev": {"accuracy": 60.0 + (lr == 1e-4)},
                          "test": {"accuracy": split.accuracy()}}  # fmt: skip
                (run / "test.json").write_text(json.dumps(result))
    command = ("acl-fairseq-fewshot reviews.tsv --test-size 2000 --per-class 16 --draws 2 "
               "--methods ce,acl --lrs 1e-4,2e-4 --model M --out FEWSHOT")  # fmt: skip
    (out / record.RECORD_FILE).write_text(json.dumps({"identity": {}, "command": command}))
    assert run_tool("--report-only", "--out", out) == 0
    table = (out / "fewshot.md").read_text()
    assert "### 16 examples per class (2 draws; dev of the same size, test 50)" in table
    assert "| CE | 50.0 ± 0.0 | d1 50.0 (0.0001), d2 50.0 (0.0001) |" in table  # chosen on dev
    assert "| ACL − CE | +33.0 | d1 +32.0, d2 +34.0 |" in table and "| 33 / 0 |" in table
    rows = json.loads((out / "fewshot.json").read_text())["comparisons"]
    assert rows[0]["ours_only"] == 33 and rows[0]["mcnemar_p"] == pytest.approx(2 * 0.5**33)
    assert rows[0]["paired_t_p"] == pytest.approx(stats.ttest_1samp([32.0, 34.0], 0).pvalue)
    assert rows[0]["verdict"] == "better"  # both tests below 0.05 (a family of one row)


# ----------------------------------------------------------------------- a whole run
@pytest.mark.slow
def test_fewshot_end_to_end_on_tiny_data(tmp_path, capfd):
    tsv = tmp_path / "reviews.tsv"
    write_tsv(tsv, 120, 0)
    out = tmp_path / "FEWSHOT"
    argv = [tsv, "--test-size", "30", *SMALL, *TINY, "--out", out]
    assert run_tool(*argv) == 0
    first = capfd.readouterr()
    printed = first.out
    written = json.loads((out / "fewshot.json").read_text())
    records = written["draws"]
    assert {(r["draw"], r["method"]) for r in records} == {(1, "ce"), (1, "acl"), (2, "ce"),
                                                           (2, "acl")}  # fmt: skip
    rows = [tuple(line.split("\t")) for line in tsv.read_text().splitlines()]
    _, test = split_off(rows, 30, seed=0)
    for draw in (1, 2):
        raw = out / "raw" / f"k4-d{draw}"
        train, dev = read_rows(raw / "train.tsv"), read_rows(raw / "dev.tsv")
        assert (train, dev) == fewshot_train_dev([r for r in rows if r not in set(test)], 4, draw)
        assert (raw / "test.tsv").read_text() == "".join("\t".join(r) + "\n" for r in test)
    for r in records:  # every number is a compare run's, the rate chosen on dev
        for lr in (1e-3, 3e-3):
            run = out / "runs" / f"k4-d{r['draw']}" / f"lr{lr:g}" / "runs"
            result = json.loads((run / f"{r['method']}-seed{r['draw']}" / "test.json").read_text())
            assert result["dev"]["accuracy"] == r["dev_by_lr"][str(lr)]
            assert result["test"]["accuracy"] == r["test_by_lr"][str(lr)]
            assert result["dev"]["num_updates"] <= 4
        best = max(r["dev_by_lr"].values())
        assert r["dev"] == best and r["test"] == r["test_by_lr"][str(r["lr"])]
        assert not math.isnan(r["test"])
    (row,) = written["comparisons"]  # McNemar over the 2 x 30 test examples of the chosen runs
    assert row["example_draws"] == 2 and row["ours_only"] + row["theirs_only"] <= 60
    table = (out / "fewshot.md").read_text()
    assert "### 4 examples per class (2 draws; dev of the same size, test 30)" in table
    assert "| ACL − CE |" in table and table in printed
    assert "DEBUG" not in first.out + first.err  # logging as the user gets it
    # a re-run trains nothing (compare is resumable) and gives the same table, also with the
    # first version's record of the folder
    first_version_record(argv, out)
    assert run_tool(*argv) == 0
    again = capfd.readouterr().out
    assert again.count(": done before (") == 8 and ": training " not in again
    assert (out / "fewshot.md").read_text() == table
    (out / "fewshot.md").unlink()
    assert run_tool("--report-only", "--out", out) == 0
    assert (out / "fewshot.md").read_text() == table
