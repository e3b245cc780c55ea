"""benchmarks/exit_inputs.py: pooling against a naive loop, the features a tiny model gives
against its own exits, and refitted heads that find the label where only their input has it."""

from __future__ import annotations

import pytest
import torch

from benchmarks import exit_inputs as bench

from tiny_models import HEAD, build_with_task, random_batch, write_dicts


def test_pool_layers_against_a_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5]
    states = [torch.randn(5, 3, 4, generator=gen) for _ in range(2)]  # T x B x C per layer
    padding = torch.tensor([[i >= n for i in range(5)] for n in lengths])
    pooled = bench.pool_layers(states, padding)
    assert pooled.shape == (3, 2, 12)
    for b, n in enumerate(lengths):
        for layer, x in enumerate(states):
            rows = [x[t, b] for t in range(n)]
            mean = sum(rows) / n
            top = torch.stack(rows).max(dim=0).values
            expected = torch.cat([mean, top, x[0, b]])
            assert torch.allclose(pooled[b, layer], expected, atol=1e-6)


@pytest.mark.parametrize("extra", [(), ("--encoder-normalize-before",)])
def test_read_split_gives_what_the_exits_read(tmp_path, extra) -> None:
    """Each exit's mean-pooling head on the ``mean`` slot of its layer gives its own logits."""
    model, task = build_with_task(
        write_dicts(tmp_path), extra=("--exit-pooling", "mean", "--exit-head", "linear", *extra)
    )
    tokens, labels = random_batch(task, 24, seed=1)  # right-padded rows of different lengths
    split = bench.read_split(model, [(tokens[:12], labels[:12]), (tokens[12:], labels[12:])],
                             task.source_dictionary.pad())  # fmt: skip
    layers = [layer for layer, _ in split.exits]
    assert split.pooled.shape == (24, len(model.encoder.sentence_encoder.layers), 3 * 32)
    assert torch.equal(split.targets, labels)
    for (layer, logits), (_, head) in zip(split.exits, model.exit_heads(HEAD)):
        with torch.no_grad():
            mine = head.classify(bench.INPUTS["mean"](split.pooled, layer))[0]
        assert torch.allclose(mine, logits, atol=1e-5), layer
    assert layers[-1] == len(model.encoder.sentence_encoder.layers)


def constructed(n: int, seed: int) -> bench.Split:
    """Three layers of 3 x 2 pooled features ([mean | max | first]); the label (0 / 1) is in
    layer 1's mean slot and layer 2's max slot, nowhere else; the final exit answers it."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=gen)
    sign = (y.float() * 2 - 1).unsqueeze(-1)
    pooled = torch.randn(n, 3, 6, generator=gen)
    pooled[:, 0, 0:2] = sign * 3.0  # layer 1's mean
    pooled[:, 1, 2:4] = sign * 3.0  # layer 2's max
    final = torch.nn.functional.one_hot(y, 2).float() * 6.0
    noise = torch.randn(n, 2, generator=gen)
    return bench.Split(pooled, [(1, noise), (2, noise), (3, final)], y)


def test_refit_finds_the_label_only_where_the_input_holds_it() -> None:
    train, dev, test = constructed(400, 0), constructed(200, 1), constructed(200, 2)
    fitted = {}
    for inputs in bench.INPUTS:
        on_dev, on_test = bench.refit(train, [dev, test], inputs, 1, 20, 1e-2, 0.0)
        assert [layer for layer, _ in on_test] == [1, 2, 3]
        assert on_test[-1][1] is test.exits[-1][1]  # the final exit is kept
        assert on_dev[0][1].shape == (200, 2)
        fitted[inputs] = (on_dev, on_test)
    acc = {k: bench.accuracies(t, test.targets)[:2] for k, (_, t) in fitted.items()}
    assert acc["mean"][0] == 100.0 and acc["mean"][1] < 65  # layer 2's mean has no label
    assert acc["mean+first"][0] == 100.0 and acc["mean+first"][1] < 65
    assert acc["mean+max"] == [100.0, 100.0] == acc["mean+max+first"]  # layer 2's max has it
    assert acc["means-so-far-concat"] == [100.0, 100.0]  # exit 2 reads layer 1's mean
    assert acc["means-so-far-avg"][1] > 90


def test_summary_of_a_perfect_first_exit() -> None:
    """Exit 1 right and sure on every row: the oracle and every policy leave there (3x)."""
    train, dev, test = constructed(400, 0), constructed(200, 1), constructed(200, 2)
    on_dev, on_test = bench.refit(train, [dev, test], "mean", 1, 20, 1e-2, 0.0)
    got = bench.summary(on_dev, dev.targets, on_test, test.targets, [0.5, 1])
    assert got["oracle"] == pytest.approx(3.0)
    assert got["best 0.5"] == pytest.approx(3.0) == got["fixed 1"]
    assert set(got) == {"oracle", "fixed 0.5", "fixed 1", "best 0.5", "best 1"}


def test_unknown_input_is_refused(capsys) -> None:
    """An unknown ``--inputs`` name is refused with the list, before anything is loaded."""
    with pytest.raises(SystemExit):
        bench.main(["ck", "data", "--inputs", "mean,median"])
    assert "--inputs: unknown ['median']" in capsys.readouterr().err
