"""predict's input and output lines (``acl_fairseq.portable.lines``), which the bundle's runner
shares: rows and columns, batches by length, padding, the output line of a prediction."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from acl_fairseq.portable.lines import (
    BLANK_LINE,
    InputError,
    blank_lines,
    blank_note,
    check_inputs,
    collate,
    length_batches,
    output_lines,
    read_input,
    read_rows,
    warm_up,
    with_blanks,
)


def test_batches_follow_the_length_order_and_keep_every_example_once():
    lengths = [5, 3, 9, 3, 1, 5, 7]
    batches = length_batches(lengths, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths)
    assert flat[:2] == [4, 1] and flat[2] == 3  # ties keep the input order (stable)
    assert length_batches([], 4) == []
    with pytest.raises(InputError, match="--batch-size must be >= 1"):
        length_batches(lengths, 0)


def test_collate_pads_on_the_right():
    tokens = collate([np.array([5, 6, 2]), np.array([7, 2])], pad=1)
    assert tokens.dtype == np.int64 and tokens.tolist() == [[5, 6, 2], [7, 2, 1]]
    assert warm_up([[1, 2], [1], [1, 2, 3]], 32) == [[1], [1, 2, 3]]
    assert warm_up([[1, 2], [1]], 1) == [[1]] and warm_up([], 8) == []


def test_output_lines_are_label_probability_layer():
    logits = np.array([[0.0, math.log(3.0)], [2.0, 0.0]], dtype=np.float32)
    lines = output_lines(logits, [2, 4], ["neg", "pos"])
    assert lines == ["pos\t0.7500\t2", f"neg\t{1 / (1 + math.exp(-2)):.4f}\t4"]
    score = output_lines(np.array([[0.25]], dtype=np.float32), [3], None, True, 4.0)
    assert score == ["1\t-\t3"]


def test_rows_columns_and_their_errors():
    lines = read_input("-", io.StringIO("id\ta\tb\n1\tx y\tz\n"))
    rows = read_rows(lines, "stdin", [2, 3], header=True)
    assert [(r.line, r.texts) for r in rows] == [(2, ("x y", "z"))]
    check_inputs(rows, 2, "stdin", "MODEL", [2, 3])
    with pytest.raises(InputError, match="MODEL is a sentence-pair model"):
        check_inputs(rows, 2, "stdin", "MODEL", None)
    with pytest.raises(InputError, match="stdin line 2: 2 text column"):
        check_inputs(rows, 1, "stdin", "MODEL", [2, 3])
    with pytest.raises(InputError, match="asks for column 4"):
        read_rows(lines, "stdin", [4])


def test_blank_lines_are_not_classified_and_keep_their_place():
    rows = read_rows(["a\tb\n", " \t\n", "c\t\n", "\t \n"], "in.tsv", [1, 2], header=False)
    blank = blank_lines(rows)
    assert blank == [2, 4]  # every text empty or white space; line 3 has one text
    assert with_blanks(rows, set(blank), ["x", "y"]) == ["x", BLANK_LINE, "y", BLANK_LINE]
    assert blank_note(blank) == (
        "note: 2 blank input lines (lines 2, 4): not classified, '-' on their output lines"
    )
    many = list(range(1, 9))
    assert blank_note(many).startswith("note: 8 blank input lines (lines 1, 2, 3, 4, 5 and 3 more)")
