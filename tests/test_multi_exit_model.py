"""multi_exit_roberta: exits, early-exit inference, head registration and checkpoint loading.

Models are built like fairseq-train builds them: command-line args parsed by fairseq's
training parser, ``sentence_prediction`` task on a tiny data dir, ``task.build_model``. The
hydra conversion (``convert_namespace_to_omegaconf``, ~1 s) runs once for the task; for a
legacy model like this one it only copies the args into ``cfg.model = Namespace(...)`` with
``_name = arch``, which ``_model_cfg`` reproduces for the other variants.
"""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from fairseq import models, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models.roberta import RobertaModel
from omegaconf import OmegaConf

from acl_fairseq.early_exit.policies import EntropyPolicy, MaxProbPolicy, PatiencePolicy
from acl_fairseq.models.multi_exit_roberta import (
    EarlyExitResult,
    MultiExitClassificationHead,
    MultiExitRobertaModel,
    exit_head_name,
    parse_exit_layers,
)
from acl_fairseq.models.pooling import MeanWeights, masked_mean

HEAD = "sentence_classification_head"
NUM_CLASSES = 3
NUM_WORDS = 20
TINY_DIMS = [
    "--encoder-layers", "4", "--encoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "input0").mkdir()
    (root / "label").mkdir()
    (root / "input0" / "dict.txt").write_text(
        "".join(f"w{i} {100 - i}\n" for i in range(NUM_WORDS))
    )
    (root / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in range(NUM_CLASSES)))
    return root


def _args(data_dir, arch="multi_exit_roberta_tiny", extra=()) -> Namespace:
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser,
        [
            str(data_dir), "--task", "sentence_prediction", "--criterion", "sentence_prediction",
            "--num-classes", str(NUM_CLASSES), "--max-positions", "64", "--arch", arch, *extra,
        ],
    )  # fmt: skip


def _model_cfg(data_dir, arch="multi_exit_roberta_tiny", extra=()) -> Namespace:
    """``cfg.model`` as ``convert_namespace_to_omegaconf`` builds it for a legacy model."""
    args = _args(data_dir, arch, extra)
    model_cfg = Namespace(**vars(args))
    model_cfg._name = args.arch
    return model_cfg


@pytest.fixture(scope="module")
def setup(data_dir):
    """(full fairseq cfg, task) for the tiny multi-exit model."""
    cfg = convert_namespace_to_omegaconf(_args(data_dir))
    return cfg, tasks.setup_task(cfg.task)


def _sharpen(model):
    """Larger weights: input-dependent, confident and varied exits at random init."""
    with torch.no_grad():
        for param in model.encoder.sentence_encoder.layers.parameters():
            if param.dim() == 2:
                param.mul_(10.0)
        for head in model.classification_heads.values():
            head.out_proj.weight.mul_(8.0)


def _build(data_dir, task, arch="multi_exit_roberta_tiny", extra=(), seed=0, sharpen=True):
    """(model in eval mode with the task's head registered, its model cfg)."""
    model_cfg = _model_cfg(data_dir, arch, extra)
    torch.manual_seed(seed)
    model = task.build_model(model_cfg)
    if sharpen:
        _sharpen(model)
    return model.eval(), model_cfg


@pytest.fixture(scope="module")
def built(setup):
    """(model, task, full cfg): the model built from the full cfg, as fairseq-train does."""
    cfg, task = setup
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    _sharpen(model)
    return model.eval(), task, cfg


def _batch(task, lengths, seed=1):
    """Right-padded B x T batch: <s> words </s> pad..., and the unpadded rows."""
    d = task.source_dictionary
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        words = torch.randint(d.nspecial, d.nspecial + NUM_WORDS, (n,), generator=gen)
        rows.append(torch.cat([torch.tensor([d.bos()]), words, torch.tensor([d.eos()])]))
    tokens = torch.full((len(rows), max(len(r) for r in rows)), d.pad(), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, rows


LENGTHS = [3, 9, 1, 14, 6, 11, 2, 7]


def test_model_and_heads_are_registered(built):
    model, _, _ = built
    assert isinstance(model, MultiExitRobertaModel) and isinstance(model, RobertaModel)
    assert model.num_layers == 4 and model.shallow_exit_layers == (1, 2, 3)
    assert set(model.classification_heads) == {HEAD} | {
        exit_head_name(HEAD, layer) for layer in (1, 2, 3)
    }
    for head in model.classification_heads.values():
        assert isinstance(head, MultiExitClassificationHead)
        assert head.out_proj.out_features == NUM_CLASSES and head.pooling == "first"
    assert [layer for layer, _ in model.exit_heads(HEAD)] == [1, 2, 3, 4]


def test_exit_outputs_shapes_and_final_exit(built):
    model, task, _ = built
    tokens, _ = _batch(task, LENGTHS)
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


def test_features_and_label_embeddings_are_out_proj_input_and_weight(built):
    model, task, _ = built
    tokens, _ = _batch(task, LENGTHS)
    for out, (_, head) in zip(model.exit_outputs(tokens), model.exit_heads(HEAD)):
        assert out.label_embeddings is head.out_proj.weight
        expected = out.features @ out.label_embeddings.T + head.out_proj.bias
        assert torch.allclose(out.logits, expected, atol=1e-5)


def test_exit_outputs_are_differentiable_in_training_mode(setup, data_dir):
    _, task = setup
    model, _ = _build(data_dir, task, sharpen=False)
    model.train()
    tokens, _ = _batch(task, LENGTHS[:3])
    outputs = model.exit_outputs(tokens)
    sum(o.logits.sum() + o.features.sum() for o in outputs).backward()
    for layer, head in model.exit_heads(HEAD):
        assert head.dense.weight.grad is not None, layer
    assert model.encoder.sentence_encoder.layers[0].fc1.weight.grad is not None


def test_final_exit_equals_plain_roberta_with_same_weights(built, data_dir):
    model, task, _ = built
    plain, plain_cfg = _build(data_dir, task, "roberta", TINY_DIMS, seed=5, sharpen=False)
    assert type(plain) is RobertaModel
    state = {k: v for k, v in model.state_dict().items() if "_exit" not in k}
    plain.load_state_dict(state, strict=True, model_cfg=plain_cfg)
    tokens, _ = _batch(task, LENGTHS)
    assert torch.equal(
        plain(tokens, classification_head_name=HEAD)[0],
        model(tokens, classification_head_name=HEAD)[0],
    )
    # the head itself is a drop-in RobertaClassificationHead
    feats = model(tokens, features_only=True)[0]
    assert torch.equal(
        plain.classification_heads[HEAD](feats), model.classification_heads[HEAD](feats)
    )


@pytest.mark.parametrize("policy", [EntropyPolicy(0.0), MaxProbPolicy(1.01), PatiencePolicy(10)])
def test_never_exit_equals_full_forward(built, policy):
    model, task, _ = built
    tokens, _ = _batch(task, LENGTHS)
    result = model.early_exit(tokens, policy, classification_head_name=HEAD)
    assert isinstance(result, EarlyExitResult)
    full = model(tokens, classification_head_name=HEAD)[0]
    assert result.exit_layers.tolist() == [4] * len(LENGTHS)
    assert torch.allclose(result.logits, full, atol=1e-5)
    assert torch.equal(result.predictions, full.argmax(-1))


@pytest.mark.parametrize("policy", [EntropyPolicy(float("inf")), MaxProbPolicy(0.0), "patience:0"])
def test_always_exit_stops_at_first_exit(built, policy):
    model, task, _ = built
    tokens, _ = _batch(task, LENGTHS)
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


@pytest.mark.parametrize("name", ["entropy", "maxprob", "patience"])
def test_batched_early_exit_equals_per_example(built, name):
    model, task, _ = built
    tokens, rows = _batch(task, LENGTHS)
    policy = _policies(model, tokens)[name]
    result = model.early_exit(tokens, policy)
    assert len(set(result.exit_layers.tolist())) >= 2, result.exit_layers  # not vacuous
    exits = {o.layer: o.logits for o in model.exit_outputs(tokens)}
    for i, row in enumerate(rows):
        alone = model.early_exit(row.unsqueeze(0), policy)
        assert alone.exit_layers.item() == result.exit_layers[i].item(), i
        assert alone.predictions.item() == result.predictions[i].item(), i
        assert torch.allclose(alone.logits[0], result.logits[i], atol=1e-5), i
        # and the logits are those of the full multi-exit forward at that exit
        layer = result.exit_layers[i].item()
        assert torch.allclose(exits[layer][i], result.logits[i], atol=1e-5), i


def test_evaluated_policy_that_lets_nobody_out_equals_full_forward(built):
    """entropy 1e-30 is evaluated at every exit (not a never-exit policy) but no row leaves."""
    model, task, _ = built
    tokens, _ = _batch(task, LENGTHS)
    policy = EntropyPolicy(1e-30)
    assert not policy.never_exits(len(model.shallow_exit_layers))
    result = model.early_exit(tokens, policy)
    full = model(tokens, classification_head_name=HEAD)[0]
    assert result.exit_layers.tolist() == [4] * len(LENGTHS)
    assert torch.allclose(result.logits, full, atol=1e-5)
    assert torch.equal(result.predictions, full.argmax(-1))


@pytest.mark.parametrize("extra", [["--exit-pooling", "mean"], ["--encoder-normalize-before"]])
def test_batched_early_exit_equals_per_example_mean_pooling_and_prenorm(setup, data_dir, extra):
    _, task = setup
    model, _ = _build(data_dir, task, extra=extra)
    tokens, rows = _batch(task, LENGTHS)
    policy = _policies(model, tokens)["entropy"]
    result = model.early_exit(tokens, policy)
    assert len(set(result.exit_layers.tolist())) >= 2, result.exit_layers  # not vacuous
    exits = {o.layer: o.logits for o in model.exit_outputs(tokens)}
    for i, row in enumerate(rows):
        alone = model.early_exit(row.unsqueeze(0), policy)
        assert alone.exit_layers.item() == result.exit_layers[i].item(), i
        assert torch.allclose(alone.logits[0], result.logits[i], atol=1e-5), i
        assert torch.allclose(exits[result.exit_layers[i].item()][i], result.logits[i], atol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [[], ["--exit-pooling", "mean"], ["--encoder-normalize-before", "--exit-pooling", "mean"]],
)
def test_single_row_path_equals_exit_outputs_bit_for_bit(setup, data_dir, extra):
    """Batch 1 without padding takes ``_run_single_row`` (host decisions, no row bookkeeping):
    its logits are exactly the exit's, and a padded copy of the row (general path) agrees."""
    _, task = setup
    model, _ = _build(data_dir, task, extra=extra)
    tokens, rows = _batch(task, LENGTHS)
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


def test_prenorm_exits_use_the_final_layer_norm(setup, data_dir):
    _, task = setup
    model, _ = _build(data_dir, task, extra=["--encoder-normalize-before"])
    encoder = model.encoder.sentence_encoder
    assert encoder.layer_norm is not None
    tokens, rows = _batch(task, LENGTHS)
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


def test_early_exit_requires_eval_mode(built):
    model, task, _ = built
    model.train()
    with pytest.raises(RuntimeError, match="eval"):
        model.train().early_exit(_batch(task, [3])[0], "entropy:0.1")
    model.eval()


def test_exit_layers_option(setup, data_dir):
    _, task = setup
    model, _ = _build(data_dir, task, extra=["--exit-layers", "3,1"])
    assert model.shallow_exit_layers == (1, 3)
    assert [layer for layer, _ in model.exit_heads(HEAD)] == [1, 3, 4]
    tokens, _ = _batch(task, LENGTHS)
    assert [o.layer for o in model.exit_outputs(tokens)] == [1, 3, 4]
    assert set(model.early_exit(tokens, "maxprob:0").exit_layers.tolist()) == {1}
    with pytest.raises(ValueError, match=r"--exit-layers.*outside 1\.\.3.*4 layers"):
        _build(data_dir, task, extra=["--exit-layers", "2,4"])
    with pytest.raises(ValueError, match="--exit-layers"):
        _build(data_dir, task, extra=["--exit-layers", "0"])
    with pytest.raises(ValueError, match="--exit-layers"):
        _build(data_dir, task, extra=["--exit-layers", "a,b"])
    with pytest.raises(ValueError, match="--exit-layers.*duplicate"):
        _build(data_dir, task, extra=["--exit-layers", "1,1"])
    assert parse_exit_layers("none", 4) == () and parse_exit_layers(None, 6) == (1, 2, 3, 4, 5)


def test_mean_pooling_ignores_padding(setup, data_dir):
    _, task = setup
    model, _ = _build(data_dir, task, extra=["--exit-pooling", "mean"])
    assert all(h.pooling == "mean" for h in model.classification_heads.values())
    tokens, _ = _batch(task, LENGTHS)
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


def test_state_dict_round_trip(built, data_dir):
    model, task, cfg = built
    fresh, _ = _build(data_dir, task, seed=123, sharpen=False)
    tokens, _ = _batch(task, LENGTHS)
    first = model.exit_outputs(tokens)[0].logits
    assert not torch.allclose(fresh.exit_outputs(tokens)[0].logits, first)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fresh.load_state_dict(state, strict=True, model_cfg=cfg.model)
    for x, y in zip(model.exit_outputs(tokens), fresh.exit_outputs(tokens)):
        assert torch.equal(x.logits, y.logits)


def test_loading_plain_roberta_initialises_exit_heads(setup, data_dir):
    _, task = setup
    plain, _ = _build(data_dir, task, "roberta", TINY_DIMS, seed=7, sharpen=False)
    plain_state = {k: v.clone() for k, v in plain.state_dict().items()}
    model, model_cfg = _build(data_dir, task, seed=8, sharpen=False)
    exit_before = {k: v.clone() for k, v in model.state_dict().items() if "_exit" in k}
    assert len(exit_before) == 3 * 4  # 3 exits x (dense, out_proj) x (weight, bias)
    model.load_state_dict(plain_state, strict=True, model_cfg=model_cfg)
    after = model.state_dict()
    for k, v in plain_state.items():
        assert torch.equal(after[k], v), k
    for k, v in exit_before.items():  # fresh exit heads kept their own initialisation
        assert torch.equal(after[k], v), k
    tokens, _ = _batch(task, LENGTHS)
    assert torch.equal(
        model(tokens, classification_head_name=HEAD)[0],
        plain(tokens, classification_head_name=HEAD)[0],
    )
    # a checkpoint without any classification head (e.g. pre-trained RoBERTa) loads too
    no_heads = {k: v for k, v in plain_state.items() if not k.startswith("classification_heads.")}
    model.load_state_dict(no_heads, strict=True, model_cfg=model_cfg)


def test_load_checkpoint_heads_registers_head_groups_by_base_name(built, data_dir):
    model, task, _ = built
    model_cfg = _model_cfg(data_dir, extra=["--load-checkpoint-heads"])
    bare = models.build_model(model_cfg, task)  # no head registered yet (as hub loading does)
    assert len(bare.classification_heads) == 0
    # put the exit heads first to make sure the order of the checkpoint keys does not matter
    state = dict(sorted(model.state_dict().items(), key=lambda kv: "_exit" not in kv[0]))
    bare.load_state_dict(state, strict=True, model_cfg=model_cfg)
    assert set(bare.classification_heads) == set(model.classification_heads)
    bare.eval()
    tokens, _ = _batch(task, LENGTHS)
    for x, y in zip(model.exit_outputs(tokens), bare.exit_outputs(tokens)):
        assert torch.equal(x.logits, y.logits)


def test_checkpoint_exit_heads_at_missing_layers_are_dropped(built, data_dir):
    model, task, _ = built  # exits at 1, 2, 3
    fewer, model_cfg = _build(data_dir, task, extra=["--exit-layers", "2"])
    fewer.load_state_dict(dict(model.state_dict()), strict=True, model_cfg=model_cfg)
    assert set(fewer.classification_heads) == {HEAD, exit_head_name(HEAD, 2)}
    assert torch.equal(
        fewer.classification_heads[exit_head_name(HEAD, 2)].dense.weight,
        model.classification_heads[exit_head_name(HEAD, 2)].dense.weight,
    )


def test_layerdrop_is_rejected(setup, data_dir):
    with pytest.raises(ValueError, match="layerdrop"):
        _build(data_dir, setup[1], extra=["--encoder-layerdrop", "0.1"])


def test_architectures_and_size_overrides(setup, data_dir):
    _, task = setup
    minilm_like = [
        "--encoder-layers", "6", "--encoder-embed-dim", "48",
        "--encoder-ffn-embed-dim", "96", "--encoder-attention-heads", "12",
    ]  # fmt: skip
    model, model_cfg = _build(data_dir, task, "multi_exit_roberta", minilm_like, sharpen=False)
    assert (model_cfg.encoder_layers, model_cfg.encoder_embed_dim) == (6, 48)
    assert model_cfg.exit_pooling == "first" and model_cfg.exit_layers is None
    assert model.shallow_exit_layers == (1, 2, 3, 4, 5)
    tokens, _ = _batch(task, [4, 2])
    assert len(model.exit_outputs(tokens)) == 6
    base = _args(data_dir, arch="multi_exit_roberta_base")
    assert (base.encoder_layers, base.encoder_embed_dim, base.encoder_ffn_embed_dim) == (
        12, 768, 3072,
    )  # fmt: skip
    large = _args(data_dir, arch="multi_exit_roberta_large")
    assert (large.encoder_layers, large.encoder_embed_dim, large.encoder_attention_heads) == (
        24, 1024, 16,
    )  # fmt: skip
    tiny = _args(data_dir)
    assert (tiny.encoder_layers, tiny.encoder_embed_dim, tiny.encoder_attention_heads) == (4, 32, 4)


def test_hub_interface_round_trip(built, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    model, task, cfg = built
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    for sub in ("input0", "label"):
        (model_dir / sub).mkdir()
        (model_dir / sub / "dict.txt").write_text((data_dir / sub / "dict.txt").read_text())
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
    tokens, rows = _batch(task, LENGTHS)
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
