"""benchmarks/exit_efficiency.py: the shapes the early-exit loop runs, counted by hand; the
replay of those shapes computes what the loop computes; the factors multiply to the
efficiency. No timing is asserted."""

from __future__ import annotations

import math

import pytest
import torch

from acl_fairseq.early_exit.policies import parse_policy
from benchmarks import exit_efficiency as eff

from tiny_models import HEAD, build_with_task, random_batch, train_tiny, write_dicts


def mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[i >= n for i in range(width)] for n in lengths])


def test_shapes_by_hand():
    # rows of 2, 4, 3, 1 tokens leaving at layers 1, 3, 3, 2 of 3
    s = eff.Shapes(torch.tensor([1, 3, 3, 2]), mask([2, 4, 3, 1], 4), 3)
    assert [(None if k is None else k.tolist(), w, r) for k, w, r, _ in s.steps] == [
        (None, 4, 4), ([1, 2, 3], 4, 3), ([0, 1], 4, 2)
    ]  # fmt: skip
    assert [p for *_, p in s.steps] == [True, True, True]
    assert s.token_work() == (2 * 1 + 4 * 3 + 3 * 3 + 1 * 2, (2 + 4 + 3 + 1) * 3)
    assert s.padded_work() == (4 * 4 + 3 * 4 + 2 * 4, 4 * 4 * 3)
    # the long row leaves first: the others' width is trimmed, and they have no padding left
    s = eff.Shapes(torch.tensor([1, 3, 3]), mask([4, 2, 2], 4), 3)
    assert [(w, r, p) for _, w, r, p in s.steps] == [(4, 3, True), (2, 2, False), (2, 2, False)]
    assert s.padded_work() == (4 * 3 + 2 * 2 * 2, 4 * 3 * 3)


def test_factors_multiply_to_the_efficiency():
    times = {"full": 6.0, "policy": 4.0, "layers": 3.0, "heads": 3.5}
    work = {"token": (40, 60), "padded": (45, 60)}
    f = eff.factors(times, work, mean_layer=3.0, num_layers=6)
    assert f["row_ideal"] == 3.0 and f["token_ideal"] == 4.0 and f["padded_ideal"] == 4.5
    assert f["efficiency"] == pytest.approx(0.75)
    assert math.prod(f[k] for k in eff.FACTORS) == pytest.approx(f["efficiency"])
    assert f["length"] == pytest.approx(0.75) and f["shapes"] == pytest.approx(1.5)


def test_the_replay_computes_what_the_loop_computes(tmp_path):
    """Rows that reach the last layer in the replay of the loop's shapes have the loop's
    final-exit logits (the layers ran on the same rows and widths)."""
    model, task = build_with_task(write_dicts(tmp_path))
    model = train_tiny(model, task, steps=40)
    tokens, _ = random_batch(task, 24, seed=5)
    pad = task.source_dictionary.pad()
    policy = parse_policy("per_exit_entropy:1=0.6,3=0.5")
    with torch.no_grad():
        loop = model.early_exit(tokens, policy)
        depth = int(model.num_layers)
        assert 1 < int(loop.exit_layers.eq(depth).sum()) < 24  # some leave, some stay
        shapes = eff.Shapes(loop.exit_layers, tokens.eq(pad), depth)
        heads = dict(model.exit_heads(HEAD))
        for with_heads in (None, heads):
            x = eff.replay_torch(model, with_heads)(tokens, shapes)
            stay = loop.exit_layers.eq(depth).nonzero().view(-1)
            assert x.size(1) == stay.numel()
            keep, width, rows, pads = shapes.steps[-1]
            running_mask = tokens.eq(pad)[stay][:, :width]
            from acl_fairseq.models.pooling import MeanWeights

            mean = MeanWeights(running_mask, pads)
            final = heads[depth]
            logits = final.classify(final.pool(model.exit_hidden(x).transpose(0, 1), weights=mean))[
                0
            ]
            torch.testing.assert_close(logits, loop.logits[stay], rtol=1e-5, atol=1e-5)


def test_runs_end_to_end_on_a_checkpoint(sentiment_data, tmp_path, capsys):
    from fairseq_helpers import TINY_MULTI_EXIT, fairseq_train, train_args

    fairseq_train(
        sentiment_data, tmp_path / "ckpt",
        *train_args(TINY_MULTI_EXIT, criterion="multi_exit_ce", max_update=24,
                    no_epoch_checkpoints=True),
    )  # fmt: skip
    out = tmp_path / "efficiency.md"
    assert eff.main([
        str(tmp_path / "ckpt" / "checkpoint_last.pt"), str(sentiment_data), "--dev", "valid",
        "--test", "valid", "--max-examples", "32", "--rounds", "1", "--batch-size", "8",
        "--dtypes", "fp32,int8,ort", "--max-accuracy-drop", "100", "--out", str(out),
    ]) == 0  # fmt: skip
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "`" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| fp32", "| int8", "| ort"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        efficiency = float(cells[6].rstrip("%")) / 100
        product = math.prod(float(c) for c in cells[7:12])
        assert abs(product - efficiency) <= 0.01 + 0.03 * efficiency  # cells rounded
        assert float(cells[2]) == pytest.approx(1.0)  # the 100-point target: every row at exit 1
    assert "ort" in capsys.readouterr().out
