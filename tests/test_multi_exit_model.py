"""multi_exit_roberta: exits, head registration, checkpoint loading and the hub interface.

Models are tiny_built like fairseq-train builds them (``tiny_models``); the early-exit loop's
tests are in test_early_exit_loop.py.
"""

from __future__ import annotations

import pytest
import torch
from fairseq import models
from fairseq.models.roberta import RobertaModel
from omegaconf import OmegaConf

from acl_fairseq.early_exit.policies import MaxProbPolicy
from acl_fairseq.models.heads import exit_head_name
from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel, parse_exit_layers
from acl_fairseq.models.pooling import MeanWeights, masked_mean, row_mean

from tiny_models import (
    HEAD,
    LENGTHS,
    NUM_CLASSES,
    TINY_DIMS,
    build_tiny,
    tiny_args,
    tiny_batch,
    tiny_cfg,
)


def test_model_and_heads_are_registered(tiny_built):
    model, _, _ = tiny_built
    assert model.num_layers == 4 and model.shallow_exit_layers == (1, 2, 3)
    assert set(model.classification_heads) == {HEAD} | {
        exit_head_name(HEAD, layer) for layer in (1, 2, 3)
    }
    for head in model.classification_heads.values():
        assert head.out_proj.out_features == NUM_CLASSES and head.pooling == "first"
    assert [layer for layer, _ in model.exit_heads(HEAD)] == [1, 2, 3, 4]


def test_exit_outputs_shapes_and_final_exit(tiny_built):
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, LENGTHS)
    outputs = model.exit_outputs(tokens, classification_head_name=HEAD)
    assert [o.layer for o in outputs] == [1, 2, 3, 4]
    for out in outputs:
        assert out.logits.shape == (len(LENGTHS), NUM_CLASSES)
        assert out.features.shape == (len(LENGTHS), 32)
        assert out.label_embeddings.shape == (NUM_CLASSES, 32)
    full = model(tokens, classification_head_name=HEAD)[0]
    assert torch.equal(outputs[-1].logits, full)
    net_input = {"src_tokens": tokens, "src_lengths": tokens.ne(1).sum(-1)}
    assert torch.equal(model.exit_outputs(**net_input)[-1].logits, full)
    # shallow exits differ from the final one
    assert not torch.allclose(outputs[0].logits, full)


def test_features_and_label_embeddings_are_out_proj_input_and_weight(tiny_built):
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, LENGTHS)
    for out, (_, head) in zip(model.exit_outputs(tokens), model.exit_heads(HEAD)):
        assert out.label_embeddings is head.out_proj.weight
        expected = out.features @ out.label_embeddings.T + head.out_proj.bias
        assert torch.allclose(out.logits, expected, atol=1e-5)


def test_exit_outputs_are_differentiable_in_training_mode(tiny_task, tiny_data):
    _, task = tiny_task
    model, _ = build_tiny(tiny_data, task, sharp=False)
    model.train()
    tokens, _ = tiny_batch(task, LENGTHS[:3])
    outputs = model.exit_outputs(tokens)
    sum(o.logits.sum() + o.features.sum() for o in outputs).backward()
    for layer, head in model.exit_heads(HEAD):
        assert head.dense.weight.grad is not None, layer
    assert model.encoder.sentence_encoder.layers[0].fc1.weight.grad is not None


def test_final_exit_equals_plain_roberta_with_same_weights(tiny_built, tiny_data):
    model, task, _ = tiny_built
    plain, plain_cfg = build_tiny(tiny_data, task, "roberta", TINY_DIMS, seed=5, sharp=False)
    assert type(plain) is RobertaModel
    state = {k: v for k, v in model.state_dict().items() if "_exit" not in k}
    plain.load_state_dict(state, strict=True, model_cfg=plain_cfg)
    tokens, _ = tiny_batch(task, LENGTHS)
    assert torch.equal(
        plain(tokens, classification_head_name=HEAD)[0],
        model(tokens, classification_head_name=HEAD)[0],
    )
    # the head itself is a drop-in RobertaClassificationHead
    feats = model(tokens, features_only=True)[0]
    assert torch.equal(
        plain.classification_heads[HEAD](feats), model.classification_heads[HEAD](feats)
    )


def test_exit_layers_option(tiny_task, tiny_data):
    _, task = tiny_task
    model, _ = build_tiny(tiny_data, task, extra=["--exit-layers", "3,1"])
    assert model.shallow_exit_layers == (1, 3)
    assert [layer for layer, _ in model.exit_heads(HEAD)] == [1, 3, 4]
    tokens, _ = tiny_batch(task, LENGTHS)
    assert [o.layer for o in model.exit_outputs(tokens)] == [1, 3, 4]
    assert set(model.early_exit(tokens, "maxprob:0").exit_layers.tolist()) == {1}
    with pytest.raises(ValueError, match=r"--exit-layers.*outside 1\.\.3.*4 layers"):
        build_tiny(tiny_data, task, extra=["--exit-layers", "2,4"])
    with pytest.raises(ValueError, match="--exit-layers"):
        build_tiny(tiny_data, task, extra=["--exit-layers", "0"])
    with pytest.raises(ValueError, match="--exit-layers"):
        build_tiny(tiny_data, task, extra=["--exit-layers", "a,b"])
    with pytest.raises(ValueError, match="--exit-layers.*duplicate"):
        build_tiny(tiny_data, task, extra=["--exit-layers", "1,1"])
    assert parse_exit_layers("none", 4) == () and parse_exit_layers(None, 6) == (1, 2, 3, 4, 5)


def test_mean_pooling_ignores_padding(tiny_task, tiny_data):
    _, task = tiny_task
    model, _ = build_tiny(tiny_data, task, extra=["--exit-pooling", "mean"])
    assert all(h.pooling == "mean" for h in model.classification_heads.values())
    tokens, _ = tiny_batch(task, LENGTHS)
    pad = torch.full((tokens.size(0), 5), task.source_dictionary.pad(), dtype=torch.long)
    more_padding = torch.cat([tokens, pad], dim=1)
    a, b = model.exit_outputs(tokens), model.exit_outputs(more_padding)
    for x, y in zip(a, b):
        assert torch.allclose(x.logits, y.logits, atol=1e-5)
        assert torch.allclose(x.features, y.features, atol=1e-5)
    assert torch.allclose(
        model(more_padding, classification_head_name=HEAD)[0], a[-1].logits, atol=1e-5
    )
    # mean pooling differs from first-token pooling
    head = model.classification_heads[HEAD]
    feats = model(tokens, features_only=True)[0]
    mask = tokens.eq(task.source_dictionary.pad())
    assert not torch.allclose(head.pool(feats, mask), feats[:, 0])


def test_state_dict_round_trip(tiny_built, tiny_data):
    model, task, cfg = tiny_built
    fresh, _ = build_tiny(tiny_data, task, seed=123, sharp=False)
    tokens, _ = tiny_batch(task, LENGTHS)
    first = model.exit_outputs(tokens)[0].logits
    assert not torch.allclose(fresh.exit_outputs(tokens)[0].logits, first)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fresh.load_state_dict(state, strict=True, model_cfg=cfg.model)
    for x, y in zip(model.exit_outputs(tokens), fresh.exit_outputs(tokens)):
        assert torch.equal(x.logits, y.logits)


def test_loading_plain_roberta_initialises_exit_heads(tiny_task, tiny_data):
    _, task = tiny_task
    plain, _ = build_tiny(tiny_data, task, "roberta", TINY_DIMS, seed=7, sharp=False)
    plain_state = {k: v.clone() for k, v in plain.state_dict().items()}
    model, model_cfg = build_tiny(tiny_data, task, seed=8, sharp=False)
    exit_before = {k: v.clone() for k, v in model.state_dict().items() if "_exit" in k}
    assert len(exit_before) == 3 * 4  # 3 exits x (dense, out_proj) x (weight, bias)
    model.load_state_dict(plain_state, strict=True, model_cfg=model_cfg)
    after = model.state_dict()
    for k, v in plain_state.items():
        assert torch.equal(after[k], v), k
    for k, v in exit_before.items():  # fresh exit heads kept their own initialisation
        assert torch.equal(after[k], v), k
    tokens, _ = tiny_batch(task, LENGTHS)
    assert torch.equal(
        model(tokens, classification_head_name=HEAD)[0],
        plain(tokens, classification_head_name=HEAD)[0],
    )
    # a checkpoint without any classification head (e.g. pre-trained RoBERTa) loads too
    no_heads = {k: v for k, v in plain_state.items() if not k.startswith("classification_heads.")}
    model.load_state_dict(no_heads, strict=True, model_cfg=model_cfg)


def test_load_checkpoint_heads_registers_head_groups_by_base_name(tiny_built, tiny_data):
    model, task, _ = tiny_built
    model_cfg = tiny_cfg(tiny_data, extra=["--load-checkpoint-heads"])
    bare = models.build_model(model_cfg, task)  # no head registered yet (as hub loading does)
    assert len(bare.classification_heads) == 0
    # put the exit heads first to make sure the order of the checkpoint keys does not matter
    state = dict(sorted(model.state_dict().items(), key=lambda kv: "_exit" not in kv[0]))
    bare.load_state_dict(state, strict=True, model_cfg=model_cfg)
    assert set(bare.classification_heads) == set(model.classification_heads)
    bare.eval()
    tokens, _ = tiny_batch(task, LENGTHS)
    for x, y in zip(model.exit_outputs(tokens), bare.exit_outputs(tokens)):
        assert torch.equal(x.logits, y.logits)


def test_checkpoint_exit_heads_at_missing_layers_are_dropped(tiny_built, tiny_data):
    model, task, _ = tiny_built  # exits at 1, 2, 3
    fewer, model_cfg = build_tiny(tiny_data, task, extra=["--exit-layers", "2"])
    fewer.load_state_dict(dict(model.state_dict()), strict=True, model_cfg=model_cfg)
    assert set(fewer.classification_heads) == {HEAD, exit_head_name(HEAD, 2)}
    assert torch.equal(
        fewer.classification_heads[exit_head_name(HEAD, 2)].dense.weight,
        model.classification_heads[exit_head_name(HEAD, 2)].dense.weight,
    )


def test_linear_exit_heads_are_out_proj_on_the_pooled_features(tiny_built, tiny_data):
    model, task, _ = tiny_built
    linear, _ = build_tiny(tiny_data, task, extra=["--exit-head", "linear"])
    tokens, _ = tiny_batch(task, LENGTHS)
    inner = linear.encoder(tokens, features_only=True, return_all_hiddens=True)[1]["inner_states"]
    outputs = linear.exit_outputs(tokens)
    for (layer, head), out in zip(linear.exit_heads(HEAD)[:-1], outputs):
        names = {n for n, _ in head.named_parameters()}
        assert head.kind == "linear" and names == {"out_proj.weight", "out_proj.bias"}
        pooled = inner[layer].transpose(0, 1)[:, 0]  # first-token pooling, post-norm model
        assert torch.equal(out.features, pooled)
        assert torch.allclose(out.logits, pooled @ head.out_proj.weight.T + head.out_proj.bias)
    final = linear.classification_heads[HEAD]
    assert final.kind == "mlp" and final.dense.weight.shape == (32, 32)
    assert all(h.kind == "mlp" for h in model.classification_heads.values())  # the default


@pytest.mark.parametrize("source, target", [("mlp", "linear"), ("linear", "mlp")])
def test_exit_heads_of_the_other_kind_start_fresh(tiny_task, tiny_data, source, target, caplog):
    """A stage that changes --exit-head restores the encoder and the final exit; each shallow
    exit keeps its own initialisation instead of failing on the other kind's weights."""
    _, task = tiny_task
    trained, _ = build_tiny(tiny_data, task, extra=["--exit-head", source], seed=3)
    model, model_cfg = build_tiny(tiny_data, task, extra=["--exit-head", target], seed=4)
    fresh = {k: v.clone() for k, v in model.state_dict().items() if "_exit" in k}
    state = {k: v.clone() for k, v in trained.state_dict().items()}
    with caplog.at_level("WARNING", logger="acl_fairseq.models.multi_exit_roberta"):
        model.load_state_dict(state, strict=True, model_cfg=model_cfg)
    said = f"the checkpoint's is {source}, this model's {target}: it starts fresh (--exit-head "
    assert f"{said}{source} keeps the checkpoint's)" in caplog.text  # not silently
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in fresh.items())
    assert all(torch.equal(after[k], v) for k, v in state.items() if "_exit" not in k)
    tokens, _ = tiny_batch(task, LENGTHS)
    final, trained_final = (m.exit_outputs(tokens)[-1].logits for m in (model, trained))
    assert torch.equal(final, trained_final)


def test_linear_exit_heads_round_trip_with_and_without_registered_heads(tiny_task, tiny_data):
    """fairseq's own upgrade reads every head's dense layer; linear exit heads have none."""
    _, task = tiny_task
    trained, _ = build_tiny(tiny_data, task, extra=["--exit-head", "linear"], seed=3)
    state = {k: v.clone() for k, v in trained.state_dict().items()}
    same, model_cfg = build_tiny(tiny_data, task, extra=["--exit-head", "linear"], seed=4)
    same.load_state_dict(dict(state), strict=True, model_cfg=model_cfg)
    model_cfg = tiny_cfg(tiny_data, extra=["--exit-head", "linear", "--load-checkpoint-heads"])
    bare = models.build_model(model_cfg, task)  # no head registered yet (as hub loading does)
    bare.load_state_dict(dict(state), strict=True, model_cfg=model_cfg)
    tokens, _ = tiny_batch(task, LENGTHS)
    for loaded in (same, bare):
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
        loaded.eval()
        for x, y in zip(trained.exit_outputs(tokens), loaded.exit_outputs(tokens)):
            assert torch.equal(x.logits, y.logits)


def test_layerdrop_is_rejected(tiny_task, tiny_data):
    with pytest.raises(ValueError, match="layerdrop"):
        build_tiny(tiny_data, tiny_task[1], extra=["--encoder-layerdrop", "0.1"])


def test_architectures_and_size_overrides(tiny_task, tiny_data):
    _, task = tiny_task
    minilm_like = [
        "--encoder-layers", "6", "--encoder-embed-dim", "48",
        "--encoder-ffn-embed-dim", "96", "--encoder-attention-heads", "12",
    ]  # fmt: skip
    model, model_cfg = build_tiny(tiny_data, task, "multi_exit_roberta", minilm_like, sharp=False)
    assert (model_cfg.encoder_layers, model_cfg.encoder_embed_dim) == (6, 48)
    assert model_cfg.exit_pooling == "first" and model_cfg.exit_layers is None
    assert model.shallow_exit_layers == (1, 2, 3, 4, 5)
    tokens, _ = tiny_batch(task, [4, 2])
    assert len(model.exit_outputs(tokens)) == 6
    base = tiny_args(tiny_data, arch="multi_exit_roberta_base")
    assert (base.encoder_layers, base.encoder_embed_dim, base.encoder_ffn_embed_dim) == (
        12, 768, 3072,
    )  # fmt: skip
    large = tiny_args(tiny_data, arch="multi_exit_roberta_large")
    assert (large.encoder_layers, large.encoder_embed_dim, large.encoder_attention_heads) == (
        24, 1024, 16,
    )  # fmt: skip
    tiny = tiny_args(tiny_data)
    assert (tiny.encoder_layers, tiny.encoder_embed_dim, tiny.encoder_attention_heads) == (4, 32, 4)


def test_hub_interface_round_trip(tiny_built, tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    model, task, cfg = tiny_built
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    for sub in ("input0", "label"):
        (model_dir / sub).mkdir()
        (model_dir / sub / "dict.txt").write_text((tiny_data / sub / "dict.txt").read_text())
    torch.save(
        {
            "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "model": model.state_dict(),
            "optimizer_history": [
                {
                    "criterion_name": "SentencePredictionCriterion",
                    "optimizer_name": "FairseqAdam",
                    "lr_scheduler_state": {"best": None},
                    "num_updates": 0,
                }
            ],
            "extra_state": {},
        },
        model_dir / "model.pt",
    )
    hub = MultiExitRobertaModel.from_pretrained(str(model_dir), "model.pt", ".", bpe=None)
    hub.eval()
    tokens, rows = tiny_batch(task, LENGTHS)
    result = hub.predict_early_exit(HEAD, tokens, "entropy:0")
    assert result.exit_layers.tolist() == [4] * len(LENGTHS)
    assert torch.allclose(result.logits, model(tokens, classification_head_name=HEAD)[0], atol=1e-5)
    one = hub.predict_early_exit(HEAD, rows[3], MaxProbPolicy(0.0))
    assert one.exit_layers.tolist() == [1]
    full = model(tokens, classification_head_name=HEAD)[0]
    assert torch.allclose(hub.predict(HEAD, tokens, return_logits=True), full, atol=1e-5)
    logits = hub.exit_logits(HEAD, tokens)
    assert list(logits) == [1, 2, 3, 4]
    for out in model.exit_outputs(tokens):
        assert torch.allclose(logits[out.layer], out.logits, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_masked_mean_against_a_naive_loop(dtype):
    torch.manual_seed(0)
    features = torch.randn(3, 5, 4).to(dtype)
    lengths = [5, 2, 1]
    mask = torch.tensor([[t >= n for t in range(5)] for n in lengths])
    pooled = masked_mean(features, MeanWeights(mask))
    assert pooled.dtype == dtype and pooled.shape == (3, 4)
    for row, n in enumerate(lengths):
        naive = sum(features[row, t].double() for t in range(n)) / n
        assert torch.allclose(
            pooled[row].double(), naive, atol=1e-3 if dtype == torch.float16 else 1e-6
        )
    # no padding at all: the multiply by 1 is skipped, the numbers are the same
    full = torch.zeros(3, 5, dtype=torch.bool)
    assert torch.equal(
        masked_mean(features, MeanWeights(full, has_pads=False)),
        masked_mean(features, MeanWeights(full)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_mean_is_masked_mean_of_one_unpadded_row(dtype):
    """The batch-1 path's pooling (T x 1 x C, no weights) gives ``masked_mean``'s numbers."""
    torch.manual_seed(0)
    for length in (1, 7, 33):
        x = torch.randn(length, 1, 48).to(dtype)  # T x 1 x C, as the encoder layers give it
        weights = MeanWeights(torch.zeros(1, length, dtype=torch.bool), has_pads=False)
        count = torch.full((1, 1), float(length))
        pooled = row_mean(x, count)
        assert pooled.dtype == dtype and pooled.shape == (1, 48)
        assert torch.equal(pooled, masked_mean(x.transpose(0, 1), weights))
