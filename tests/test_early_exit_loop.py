"""The early-exit loop (``acl_fairseq.runtime.torch_loop``) against the per-example and the
full-depth forwards of the same model: the same exits, predictions and logits.

Models are tiny_built like fairseq-train builds them (``tiny_models``).
"""

from __future__ import annotations

import pytest
import torch

from acl_fairseq.early_exit.policies import EntropyPolicy, MaxProbPolicy, PatiencePolicy

from tiny_models import HEAD, LENGTHS, build_tiny, tiny_batch


@pytest.mark.parametrize("policy", [EntropyPolicy(0.0), PatiencePolicy(3), PatiencePolicy(10)])
def test_never_exit_equals_full_forward(tiny_built, policy):
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, LENGTHS)
    result = model.early_exit(tokens, policy, classification_head_name=HEAD)
    full = model(tokens, classification_head_name=HEAD)[0]
    assert result.exit_layers.tolist() == [4] * len(LENGTHS)
    assert torch.allclose(result.logits, full, atol=1e-5)
    assert torch.equal(result.predictions, full.argmax(-1))


@pytest.mark.parametrize("policy", [EntropyPolicy(float("inf")), MaxProbPolicy(0.0), "patience:0"])
def test_always_exit_stops_at_first_exit(tiny_built, policy):
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, LENGTHS)
    result = model.early_exit(tokens, policy)
    first = model.exit_outputs(tokens)[0]
    assert result.exit_layers.tolist() == [1] * len(LENGTHS)
    assert torch.allclose(result.logits, first.logits, atol=1e-5)
    assert torch.equal(result.predictions, first.logits.argmax(-1))


def _midpoint_threshold(values):
    """A threshold strictly between the two middle values (half the rows on each side)."""
    v = values.sort().values
    mid = len(v) // 2
    return float((v[mid - 1] + v[mid]) / 2)


def _policies(model, tokens):
    exits = model.exit_outputs(tokens)
    first_probs = exits[0].logits.softmax(-1)
    entropy = -(first_probs * first_probs.log()).sum(-1)
    return {
        "entropy": EntropyPolicy(_midpoint_threshold(entropy)),
        "maxprob": MaxProbPolicy(_midpoint_threshold(first_probs.max(-1).values)),
        "patience": PatiencePolicy(1),
    }


def assert_batched_equals_per_example(model, tokens, rows, policy) -> None:
    """The batch's early exit leaves each row at the layer, with the prediction and the logits,
    of that row alone, and those logits are the full multi-exit forward's at that exit; at
    least two rows leave at different exits (the comparison is not vacuous)."""
    result = model.early_exit(tokens, policy)
    assert len(set(result.exit_layers.tolist())) >= 2, result.exit_layers
    exits = {o.layer: o.logits for o in model.exit_outputs(tokens)}
    for i, row in enumerate(rows):
        alone = model.early_exit(row.unsqueeze(0), policy)
        assert alone.exit_layers.item() == result.exit_layers[i].item(), i
        assert alone.predictions.item() == result.predictions[i].item(), i
        assert torch.allclose(alone.logits[0], result.logits[i], atol=1e-5), i
        layer = result.exit_layers[i].item()
        assert torch.allclose(exits[layer][i], result.logits[i], atol=1e-5), i


@pytest.mark.parametrize("name", ["entropy", "maxprob", "patience"])
def test_batched_early_exit_equals_per_example(tiny_built, name):
    model, task, _ = tiny_built
    tokens, rows = tiny_batch(task, LENGTHS)
    assert_batched_equals_per_example(model, tokens, rows, _policies(model, tokens)[name])


def test_evaluated_policy_that_lets_nobody_out_equals_full_forward(tiny_built):
    """entropy 1e-30 is evaluated at every exit (not a never-exit policy) but no row leaves."""
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, LENGTHS)
    policy = EntropyPolicy(1e-30)
    assert not policy.never_exits(len(model.shallow_exit_layers))
    result = model.early_exit(tokens, policy)
    full = model(tokens, classification_head_name=HEAD)[0]
    assert result.exit_layers.tolist() == [4] * len(LENGTHS)
    assert torch.allclose(result.logits, full, atol=1e-5)
    assert torch.equal(result.predictions, full.argmax(-1))


@pytest.mark.parametrize("extra", [["--exit-pooling", "mean"], ["--encoder-normalize-before"]])
def test_batched_early_exit_equals_per_example_mean_pooling_and_prenorm(
    tiny_task, tiny_data, extra
):
    _, task = tiny_task
    model, _ = build_tiny(tiny_data, task, extra=extra)
    tokens, rows = tiny_batch(task, LENGTHS)
    assert_batched_equals_per_example(model, tokens, rows, _policies(model, tokens)["entropy"])


@pytest.mark.parametrize(
    "extra",
    [[], ["--exit-pooling", "mean"], ["--encoder-normalize-before", "--exit-pooling", "mean"]],
)
def test_single_row_path_equals_exit_outputs_bit_for_bit(tiny_task, tiny_data, extra):
    """Batch 1 without padding (a single running row: no row bookkeeping) gives exactly the
    exit's logits, and a padded copy of the row (padding bookkeeping) agrees."""
    _, task = tiny_task
    model, _ = build_tiny(tiny_data, task, extra=extra)
    tokens, rows = tiny_batch(task, LENGTHS)
    policies = _policies(model, tokens)
    pad = task.source_dictionary.pad()
    for name, policy in [*policies.items(), ("nobody leaves", EntropyPolicy(1e-30))]:
        layers = set()
        for row in rows:
            alone = model.early_exit(row.unsqueeze(0), policy)
            layer = alone.exit_layers.item()
            layers.add(layer)
            exits = {o.layer: o.logits for o in model.exit_outputs(row.unsqueeze(0))}
            assert torch.equal(alone.logits, exits[layer]), (name, row)
            assert torch.equal(alone.predictions, exits[layer].argmax(-1))
            padded = torch.cat([row, torch.full((3,), pad, dtype=row.dtype)]).unsqueeze(0)
            general = model.early_exit(padded, policy)
            assert general.exit_layers.item() == layer, (name, row)
            assert torch.allclose(general.logits, alone.logits, atol=1e-5)
        if name != "nobody leaves":
            assert len(layers) >= 2, (name, layers)  # not vacuous
        else:
            assert layers == {4}


def test_prenorm_exits_use_the_final_layer_norm(tiny_task, tiny_data):
    _, task = tiny_task
    model, _ = build_tiny(tiny_data, task, extra=["--encoder-normalize-before"])
    encoder = model.encoder.sentence_encoder
    assert encoder.layer_norm is not None
    tokens, rows = tiny_batch(task, LENGTHS)
    outputs = model.exit_outputs(tokens)
    assert torch.equal(outputs[-1].logits, model(tokens, classification_head_name=HEAD)[0])
    inner = model(tokens, features_only=True, return_all_hiddens=True)[1]["inner_states"]
    hidden = encoder.layer_norm(inner[2]).transpose(0, 1)
    assert torch.allclose(model.classification_heads[f"{HEAD}_exit2"](hidden), outputs[1].logits)
    never = model.early_exit(tokens, "entropy:0")
    assert torch.allclose(never.logits, outputs[-1].logits, atol=1e-5)
    result = model.early_exit(tokens, "patience:1")
    for i, row in enumerate(rows):
        assert model.early_exit(row.unsqueeze(0), "patience:1").exit_layers == result.exit_layers[i]


def test_early_exit_requires_eval_mode(tiny_built):
    model, task, _ = tiny_built
    model.train()
    with pytest.raises(RuntimeError, match="eval"):
        model.train().early_exit(tiny_batch(task, [3])[0], "entropy:0.1")
    model.eval()
