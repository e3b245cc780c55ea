"""acl-fairseq-prepare on files that would mislead it: a header line read as data, a file
without a usable row, a dev file of another layout, one label written two ways, a class missing
from train, a training file of one class; and its output as a user sees it."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from acl_fairseq.cli import prepare as prepare_cli

SPM_ARGS = ["--tokenizer", "sentencepiece", "--spm-vocab-size", "200", "--workers", "1"]
ROWS = "".join(f"the film number{i} .\t{'pos' if i % 2 else 'neg'}\n" for i in range(8))
DEV_ROWS = "".join(f"a film number{i} .\t{'pos' if i % 2 else 'neg'}\n" for i in range(6))


def run_main(argv: list) -> int:
    return prepare_cli.main([str(a) for a in argv])


def custom(tmp_path: Path, train: str, valid: str, *flags: str) -> tuple[int, str]:
    """acl-fairseq-prepare --task custom on the two file contents; (exit code, its error)."""
    (tmp_path / "train.tsv").write_text(train, encoding="utf-8")
    (tmp_path / "dev.tsv").write_text(valid, encoding="utf-8")
    argv = ["--task", "custom", "--train", tmp_path / "train.tsv", "--valid", tmp_path / "dev.tsv",
            "--text-columns", "1", "--label-column", "2", "--out-dir", tmp_path / "out",
            *SPM_ARGS, *flags]  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_main(argv)
    _, prefix, error = err.getvalue().partition("acl-fairseq-prepare: error: ")
    return code, error.removesuffix("\n") if prefix else ""


def test_a_forgotten_header_is_not_a_class(tmp_path: Path) -> None:
    """Without --header the header line would add a class named after the label column."""
    code, error = custom(tmp_path, "text\tlabel\n" + ROWS, "text\tlabel\n" + ROWS)
    assert code == 2
    assert error == (
        f"custom: {tmp_path / 'train.tsv'} line 1 has the label 'label', which no other line "
        "has: it looks like a header line (the column names). Pass --header to skip it; if "
        "'label' is a real class with one example, list every label with --labels"
    )
    assert custom(tmp_path, "text\tlabel\n" + ROWS, "text\tlabel\n" + DEV_ROWS, "--header")[0] == 0
    assert json.loads((tmp_path / "out/custom-bin/prepare_glue.json").read_text())["labels"] == [
        "neg", "pos"]  # fmt: skip


def test_a_file_without_a_usable_row_says_why(tmp_path: Path) -> None:
    comma = "".join(f"the film number{i} .,{'pos' if i % 2 else 'neg'}\n" for i in range(4))
    code, error = custom(tmp_path, comma, ROWS)
    assert code == 2
    assert error == (
        f"custom: none of the 4 rows of {tmp_path / 'train.tsv'} is usable: 4 row(s): missing "
        "field: expected 2 tab-separated fields (column 2 needed), found 1 (e.g. line 1). Check "
        "--text-columns 1, --label-column 2, --labels and --header against the file"
    )
    code, error = custom(tmp_path, "text\tlabel\n", ROWS, "--header")
    assert error == f"custom: {tmp_path / 'train.tsv'} has no data line after its header"


def test_a_dev_file_of_another_layout(tmp_path: Path) -> None:
    with_id = "".join(f"{i}\t{line}\n" for i, line in enumerate(ROWS.splitlines()))
    code, error = custom(tmp_path, ROWS, with_id)
    assert code == 2
    assert error == (
        f"custom: {tmp_path / 'dev.tsv'} has 3 tab-separated columns, {tmp_path / 'train.tsv'} "
        "has 2: both are read with the same --text-columns / --label-column, so one of them "
        "would be read from the wrong columns. Give files of one layout"
    )
    code, error = custom(tmp_path, "text\tlabel\n" + ROWS, "label\ttext\n" + ROWS, "--header")
    assert error == (
        f"custom: the header of {tmp_path / 'dev.tsv'} (label | text) is not the header of "
        f"{tmp_path / 'train.tsv'} (text | label): the columns may be in another order. Give "
        "files of one layout"
    )


def test_one_label_written_two_ways_is_not_two_classes(tmp_path: Path) -> None:
    """``1`` and ``1.0`` in one label column would be two classes (and half the ones wrong)."""
    rows = [f"the film number{i} .\t{i % 2}" for i in range(8)]
    train, dev = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    mixed = "\n".join(rows[:3] + ["the film number3 .\t1.0"] + rows[4:]) + "\n"
    code, error = custom(tmp_path, mixed, "\n".join(rows) + "\n")
    assert code == 2
    assert error == (
        f"custom: the labels '1' ({train} line 2) and '1.0' ({train} line 4) are one class "
        "written two ways, so they would be two classes: write each class one way in the label "
        "column"
    )
    code, error = custom(tmp_path, "\n".join(rows) + "\n", mixed)  # in dev: named there
    assert error.startswith(f"custom: the labels '1' ({train} line 2) and '1.0' ({dev} line 4)")
    cased = ROWS.replace("number5 .\tpos", "number5 .\tPos")
    assert custom(tmp_path, cased, ROWS)[1].startswith("custom: the labels 'pos' (")
    listed = ["--labels", "0,1,1.0", "--allow-overlap"]  # dev is train here
    assert custom(tmp_path, mixed, mixed, *listed)[0] == 0  # listed: as written


def test_a_class_missing_from_train_is_named_and_never_dropped(tmp_path: Path) -> None:
    """Dropping dev's rows of a class train lacks (--skip-bad-rows) would report a model that
    cannot predict that class without it."""
    dev = ROWS + "a new film .\tneutral\nanother one .\tneutral\n"
    code, error = custom(tmp_path, ROWS, dev)
    assert code == 2
    assert error == (
        f"custom: {tmp_path / 'dev.tsv'} has the class(es) 'neutral' (2 row(s), e.g. line 9), "
        f"missing from the training file {tmp_path / 'train.tsv'}: a model trained on it could "
        "never predict them. Add examples of each class to the training file (or correct those "
        "labels)"
    )
    assert custom(tmp_path, ROWS, dev, "--skip-bad-rows") == (2, error)
    assert not (tmp_path / "out" / "custom-bin").exists()


def test_a_training_file_of_one_class_stops(tmp_path: Path) -> None:
    one = "".join(f"the film number{i} .\tpos\n" for i in range(8))
    assert custom(tmp_path, one, one) == (
        2,
        f"custom: every row of {tmp_path / 'train.tsv'} has the label 'pos': a classifier "
        "needs examples of at least two classes (check the label column)",
    )


def test_a_dev_split_that_shares_rows_with_train_stops_unless_allowed(tmp_path: Path, caplog):
    """It was prepared without a word (the few-shot command checks this): the count and the
    first rows by file and line, then --allow-overlap keeps them, saying so."""
    train = "".join(f"film {i} was {'good' if i % 2 else 'bad'} .\t{i % 2}\n" for i in range(30))
    lines = train.splitlines(keepends=True)
    dev = "".join(lines[i] for i in range(0, 20, 2)) + "".join(
        f"another film {i} .\t{i % 2}\n" for i in range(20)
    )  # 10 of its 30 rows are rows of train
    code, error = custom(tmp_path, train, dev)
    assert code == 2
    train_tsv, dev_tsv = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    assert error == (
        "custom: 10 of the 30 valid rows are train rows (the same text): dev.tsv line 1 = "
        "train.tsv line 1 'film 0 was bad .', dev.tsv line 2 = train.tsv line 3 'film 2 was "
        "bad .', dev.tsv line 3 = train.tsv line 5 'film 4 was bad .', ...: an example in "
        "training and in dev or test scores higher than it should; remove those rows, or pass "
        "--allow-overlap to keep them"
    ), (train_tsv, dev_tsv)
    assert not (tmp_path / "out" / "custom-bin").exists()
    with caplog.at_level("INFO"):
        assert custom(tmp_path, train, dev, "--allow-overlap") == (0, "")
    assert (
        "10 of the 30 valid rows are train rows" in caplog.text
        and "(kept: --allow-overlap)" in caplog.text
    )


@pytest.mark.slow
def test_prepare_prints_no_debug_line_and_no_namespace(tmp_path: Path) -> None:
    """The command's whole output (its own process, logging as a user gets it)."""
    import os
    import subprocess
    import sys

    (tmp_path / "train.tsv").write_text(ROWS)
    (tmp_path / "dev.tsv").write_text(DEV_ROWS)
    argv = ["--task", "custom", "--train", tmp_path / "train.tsv", "--valid", tmp_path / "dev.tsv",
            "--text-columns", "1", "--label-column", "2", "--out-dir", tmp_path / "out",
            *SPM_ARGS]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"}
    proc = subprocess.run(
        [sys.executable, "-m", "acl_fairseq.cli.prepare", *map(str, argv)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "wrote" in output and "DEBUG" not in output and "Namespace(" not in output
