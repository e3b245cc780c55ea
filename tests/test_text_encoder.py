"""The one text encoder: raw text encoded exactly as ``acl-fairseq-prepare`` and the task
built the binarized splits (no training: a task set up on a prepared folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask

from acl_fairseq.data.text_encoder import EncodeError, ExampleEncoder, TextEncoder

from fairseq_helpers import prepare_tsv_task


def _task(data: Path, pair: bool) -> SentencePredictionTask:
    cfg = SentencePredictionConfig(
        data=str(data), num_classes=2, init_token=0, separator_token=2 if pair else None, seed=1
    )
    task = SentencePredictionTask.setup_task(cfg)
    task.load_dataset("test")
    return task


def test_tokens_equal_the_binarized_split(tmp_path: Path) -> None:
    data, rows = prepare_tsv_task(tmp_path)
    task = _task(data, pair=False)
    encoder = ExampleEncoder.from_task(task, data, 64)
    assert encoder.num_inputs == 1
    dataset = task.dataset("test")
    assert len(dataset) == len(rows)
    for i, row in enumerate(rows):
        ours = encoder.encode([row[0]])
        assert ours.tolist() == dataset[i]["net_input.src_tokens"].tolist(), row[0]
    assert ours[0] == 0 and ours[-1] == task.source_dictionary.eos()
    # the token line is what preparation writes, and it decodes back to the text
    text = TextEncoder.from_data(data)
    assert text.encode(rows[0][0]) == " ".join(text.tokens(rows[0][0]))
    assert text.decode(text.encode(rows[0][0])) == rows[0][0]


def test_pair_tokens_equal_the_binarized_split(tmp_path: Path) -> None:
    """input0 with --init-token, input1 with --separator-token, concatenated."""
    data, rows = prepare_tsv_task(tmp_path, pair=True)
    task = _task(data, pair=True)
    encoder = ExampleEncoder.from_task(task, data, 512)
    assert encoder.num_inputs == 2
    for i, row in enumerate(rows):
        ours = encoder.encode([row[0], row[1]])
        assert ours.tolist() == task.dataset("test")[i]["net_input.src_tokens"].tolist()
    with pytest.raises(EncodeError, match="line 3: 1 text.* sentence-pair model"):
        encoder.encode(["only one"], "line 3")
    encoder.max_positions = 5
    with pytest.raises(EncodeError, match="stdin line 2: .* more than the model's 5 positions"):
        encoder.encode([row[0], row[1]], "stdin line 2")
    encoder.truncate = True
    full = encoder.encode([row[0], row[1]])
    encoder.max_positions = 512
    assert full.tolist() == encoder.encode([row[0], row[1]])[:5].tolist()
