"""The pool and the test split of ``acl-fairseq-fewshot``: rows read and checked, the test split
(its file, or held out), the pool without the test's texts or repeated texts (counted)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from acl_fairseq.data.splits import repeated_texts, split_off, unique_texts, without_texts
from acl_fairseq.data.task_specs import (
    SplitData,
    SplitSpec,
    TaskSpec,
    check_label_spellings,
    format_bad_rows,
    read_split,
)
from acl_fairseq.errors import AclValueError

Row = tuple[str, ...]  # the text(s) of an example, its label last


class FewshotError(AclValueError):
    """A flag or input file that cannot work; the message names it."""


def read_labelled(path: Path, args: argparse.Namespace) -> SplitData:
    """The rows of a labelled TSV; bad rows are an error."""
    if not path.is_file():
        raise FewshotError(f"{path}: no such file")
    columns = tuple(int(c) for c in args.text_columns.split(","))
    spec = SplitSpec("train", str(path), columns, args.label_column, header=args.header)
    data, bad = read_split(path, spec, TaskSpec("fewshot", (spec,)), "train")
    if bad:
        raise FewshotError(f"{len(bad)} bad row(s) in {path}:\n{format_bad_rows(bad)}")
    if not data.labels:
        raise FewshotError(f"{path}: no labelled row")
    return data


def rows_of(data: SplitData) -> list[Row]:
    return [(*texts, label) for *texts, label in zip(*data.texts, data.labels or [])]


def check_one_label_per_text(data: SplitData) -> None:
    """One text with two labels is one example of two classes: ``FewshotError`` with how
    many texts and the lines of the first."""
    rows = rows_of(data)
    both = [group for group in repeated_texts(rows) if len({rows[i][-1] for i in group}) > 1]
    if both:
        first = both[0]
        other = next(i for i in first if rows[i][-1] != rows[first[0]][-1])
        lines = data.line_numbers
        raise FewshotError(
            f"{data.path}: {len(both)} text(s) have two or more labels, e.g. line "
            f"{lines[first[0]]} ({rows[first[0]][-1]!r}) and line {lines[other]} "
            f"({rows[other][-1]!r}): one example cannot be of two classes; correct or remove "
            "those rows"
        )


def check_classes(pool: list[Row], test: list[Row], args: argparse.Namespace) -> None:
    """The pool has two classes or more, and every class of the test split."""
    classes = {row[-1] for row in pool}
    if len(classes) < 2:
        raise FewshotError(
            f"{args.tsv}: the pool has only the class {sorted(classes)[0]!r}: a classifier "
            f"needs examples of two classes or more (check --label-column {args.label_column})"
        )
    missing = Counter(row[-1] for row in test if row[-1] not in classes)
    if missing:
        listed = ", ".join(f"{label!r} ({n} row(s))" for label, n in sorted(missing.items()))
        raise FewshotError(
            f"the test split has the class(es) {listed}, which the pool ({args.tsv} less the "
            "test split) lacks: no draw could train on them. Add examples of them to the TSV"
        )


def pool_and_test(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    """``(pool, test)`` (see the module doc); for a TSV without a repeated text and with
    ``--test-size``, the pool and the test split of ``split_off`` as they are."""
    data = read_labelled(args.tsv, args)
    files = [data]
    if args.test is not None:
        files.append(read_labelled(args.test, args))
    check_label_spellings(f"--label-column {args.label_column}", files)
    for found in files:
        check_one_label_per_text(found)
    rows = rows_of(data)
    if args.test is not None:
        pool, test = rows, rows_of(files[1])
        where = f"the test file {args.test}"
    else:
        try:
            pool, test = split_off(rows, args.test_size, seed=0)
        except ValueError as e:
            raise FewshotError(f"--test-size {args.test_size}: {e}") from None
        where = "the held-out test split (a repeated text)"
    pool, in_test = without_texts(pool, test)
    pool, repeated = unique_texts(pool)
    if in_test:
        print(f"{args.tsv}: {in_test} row(s) left out of the pool: their text is in {where}")
    if repeated:
        print(f"{args.tsv}: {repeated} row(s) left out of the pool: an earlier row has their text")
    check_classes(pool, test, args)
    return pool, test
