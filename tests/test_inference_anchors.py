"""benchmarks/inference_anchors.py: the HF anchor carries the fairseq model's weights (same
logits), and the table's accuracy / agreement / exit columns (no timing is asserted)."""

from __future__ import annotations

import sys

import pytest
import torch

from fairseq_helpers import REPO
from tiny_models import HEAD, build_tiny, random_batch, train_tiny, write_dicts

sys.path.insert(0, str(REPO / "benchmarks"))
import inference_anchors as anchors  # noqa: E402

from acl_fairseq.per_exit_policy import only_policy_exits  # noqa: E402


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_hf_anchor_equals_the_fairseq_model(tmp_path, pooling):
    model, task = build_tiny(write_dicts(tmp_path), extra=("--exit-pooling", pooling))
    tokens, _ = random_batch(task, 8, seed=2)  # right-padded rows of different lengths
    anchor = anchors.HfAnchor(model, "eager")
    pad = task.source_dictionary.pad()
    with torch.no_grad():
        expected = model(tokens, classification_head_name=HEAD)[0]
        got = anchor(tokens, tokens.ne(pad).long())
        alone = anchor(tokens[:1, : int(tokens[0].ne(pad).sum())], torch.ones(1, 1).long())
    assert not anchor.training
    assert torch.allclose(got, expected, atol=1e-5)
    assert alone.shape == (1, 3)


def test_table_rows(tmp_path):
    model, task = build_tiny(write_dicts(tmp_path))
    model = train_tiny(model, task, steps=40)
    pad = task.source_dictionary.pad()
    tokens, labels = random_batch(task, 48, seed=3)
    batches = [(tokens[i : i + 16], labels[i : i + 16]) for i in range(0, 48, 16)]
    policy = anchors.parse_any_policy("per_exit_entropy:1=0.4,3=0.2")
    hf = anchors._hf_run(anchors.HfAnchor(model), pad)
    configs = [
        anchors.Config("HF fp32 (eager)", "full depth", hf),
        anchors.Config("fp32", "full depth", anchors.project_runner(model, None)),
        anchors.Config("fp32", str(policy), anchors.project_runner(model, policy)),
    ]  # fmt: skip
    rows = anchors.measure(configs, batches, rounds=1)
    with torch.no_grad():
        full = model(tokens, classification_head_name=HEAD)[0].argmax(-1)
        with pytest.raises(ValueError, match="evaluate only its exits"):
            model.early_exit(tokens, policy)  # all 3 shallow exits: more than the policy's 2
        with only_policy_exits(model, policy):
            early = model.early_exit(tokens, policy)
    assert rows[0]["accuracy"] == pytest.approx(100.0 * float(full.eq(labels).double().mean()))
    assert rows[0]["agreement"] == 100.0 and rows[1]["mean_exit_layer"] == 4.0
    # early exit through the benchmark's runner equals the model's own loop per batch
    exits = torch.cat([anchors.project_runner(model, policy)(t)[1] for t, _ in batches])
    assert rows[2]["mean_exit_layer"] == pytest.approx(float(exits.double().mean()))
    assert set(exits.tolist()) <= {1, 3, 4}
    agreement = 100.0 * float(early.predictions.eq(full).double().mean())
    assert rows[2]["agreement"] == pytest.approx(agreement)
    assert rows[0]["speedup"] == 1.0
    lines = anchors.format_rows(32, 2, rows)
    assert lines[2].startswith(f"| 32 | 2 | fp32 | {policy} | ")
