"""prepare_for_inference: fp32 / bf16 / int8 of a multi-exit (and a plain) RoBERTa.

The agreement tests use a tiny multi-exit model trained in-process for a few seconds on a
synthetic majority-vote rule (``tiny_models.train_tiny``): its exits are 87-95% accurate with
varied confidence, so agreement between precisions is about the precision, not about ties
between the near-equal logits of random weights.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from acl_fairseq.cpu_features import has_vnni
from acl_fairseq.early_exit.policies import EntropyPolicy, PatiencePolicy, softmax_entropy
from acl_fairseq.early_exit.thresholds import simulate_exits
from acl_fairseq.portable.decide import Decision
from acl_fairseq.runtime.precision import (
    PRECISIONS,
    Float32Logits,
    check_precision,
    model_precision,
    prepare_for_inference,
    quantized_linears,
)
from benchmarks.exit_heads import Bf16Linear, prepare_exit_heads

from tiny_models import (
    HEAD,
    MINILM_DIMS,
    build_with_task,
    random_batch,
    train_tiny,
    write_dicts,
)

LOW = ("bf16", "int8")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_dicts(tmp_path_factory.mktemp("precision"))


@pytest.fixture(scope="module")
def trained(data_dir):
    """(fp32 model, task): the tiny multi-exit model after a few seconds of training."""
    model, task = build_with_task(data_dir)
    return train_tiny(model, task), task


@pytest.fixture(scope="module")
def prepared(trained):
    """{dtype: prepared copy of the trained model}."""
    model, _ = trained
    return {d: prepare_for_inference(copy.deepcopy(model), d) for d in PRECISIONS}


@pytest.fixture(scope="module")
def inputs(trained):
    _, task = trained
    return random_batch(task, 512, seed=1)


def test_check_precision_names_and_errors():
    assert check_precision("FP32") == "fp32"
    assert check_precision("bfloat16") == "bf16"
    assert check_precision(" int8 ") == "int8"
    with pytest.raises(ValueError, match="--dtype must be one of fp32, bf16, int8"):
        check_precision("fp16")


def test_weights_and_heads_at_each_precision(prepared):
    fp32, bf16, int8 = prepared["fp32"], prepared["bf16"], prepared["int8"]
    assert [model_precision(prepared[d]) for d in PRECISIONS] == list(PRECISIONS)
    assert not fp32.training and not bf16.training and not int8.training
    layer = lambda m: m.encoder.sentence_encoder.layers[0]  # noqa: E731
    assert layer(fp32).fc1.weight.dtype == torch.float32
    assert layer(bf16).fc1.weight.dtype == torch.bfloat16
    assert layer(bf16).self_attn.q_proj.weight.dtype == torch.bfloat16
    assert bf16.encoder.sentence_encoder.embed_tokens.weight.dtype == torch.bfloat16
    for name, head in bf16.classification_heads.items():
        assert head.dense.weight.dtype == torch.bfloat16, name
        assert isinstance(head.out_proj, Float32Logits), name
        assert head.out_proj.weight.dtype == torch.float32, name
    # int8: every Linear of the 4 layers (q, k, v, out, fc1, fc2) and the 4 heads' dense
    names = set(quantized_linears(int8))
    assert len(names) == 4 * 6 + 4
    for i in range(4):
        base = f"encoder.sentence_encoder.layers.{i}"
        for sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                    "self_attn.out_proj", "fc1", "fc2"):  # fmt: skip
            assert f"{base}.{sub}" in names
    assert {f"classification_heads.{h}.dense" for h in int8.classification_heads} <= names
    float_weights = [
        n
        for n, p in int8.encoder.sentence_encoder.layers.named_parameters()
        if p.dim() == 2 and p.dtype.is_floating_point
    ]
    assert float_weights == []  # no float matrix left in the layers
    for head in int8.classification_heads.values():
        assert type(head.out_proj) is torch.nn.Linear  # logits from a float32 out_proj


@pytest.mark.parametrize("dtype", PRECISIONS)
def test_forwards_return_float32_logits(prepared, inputs, dtype):
    model = prepared[dtype]
    tokens, _ = inputs
    with torch.no_grad():
        full = model(tokens[:16], classification_head_name=HEAD)[0]
        outs = model.exit_outputs(tokens[:16], classification_head_name=HEAD)
        result = model.early_exit(tokens[:16], "entropy:0.3")
    assert full.dtype == torch.float32 and full.shape == (16, 3)
    assert all(o.logits.dtype == torch.float32 for o in outs)
    assert result.logits.dtype == torch.float32
    assert torch.allclose(outs[-1].logits, full, atol=1e-5 if dtype == "fp32" else 1e-2)


@pytest.mark.parametrize("dtype", LOW)
def test_predictions_agree_with_fp32(prepared, inputs, dtype):
    """>= 98% of 512 random sentences get the fp32 prediction, at every exit."""
    tokens, labels = inputs
    with torch.no_grad():
        ref = prepared["fp32"].exit_outputs(tokens, classification_head_name=HEAD)
        low = prepared[dtype].exit_outputs(tokens, classification_head_name=HEAD)
    assert float(ref[-1].logits.argmax(-1).eq(labels).float().mean()) > 0.85  # it learned
    for a, b in zip(ref, low):
        agree = float(a.logits.argmax(-1).eq(b.logits.argmax(-1)).float().mean())
        assert agree >= 0.98, (a.layer, agree)
        assert not torch.equal(a.logits, b.logits)  # the precision really changed


def test_int8_runs_the_quantized_projections(prepared, inputs, monkeypatch):
    """Every quantized module runs once per forward, fairseq's attention fast path (which
    would take the projections' weights directly) is never taken."""
    model = prepared["int8"]
    tokens, _ = inputs
    calls: dict[str, int] = {}
    handles = [
        m.register_forward_hook(lambda *_, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
        for n, m in quantized_linears(model).items()
    ]

    def fast_path(*args, **kwargs):
        raise AssertionError("F.multi_head_attention_forward used the projections' weights")

    monkeypatch.setattr(F, "multi_head_attention_forward", fast_path)
    try:
        with torch.no_grad():
            model.exit_outputs(tokens[:8], classification_head_name=HEAD)
    finally:
        for h in handles:
            h.remove()
    assert calls == {n: 1 for n in quantized_linears(model)}


def test_int8_does_not_use_the_float_weights(trained, inputs):
    """The float32 weights the quantized layers came from are poisoned with NaN after
    quantization: the int8 model's outputs stay finite and unchanged, so no forward reads them
    (the same poison on the fp32 model gives NaN)."""
    model, _ = trained
    tokens, _ = inputs
    copy_ = copy.deepcopy(model)
    layers = copy_.encoder.sentence_encoder.layers
    originals = [m.weight for m in layers.modules() if type(m) is torch.nn.Linear]
    originals += [h.dense.weight for h in copy_.classification_heads.values()]
    int8 = prepare_for_inference(copy_, "int8")
    with torch.no_grad():
        before = int8(tokens[:32], classification_head_name=HEAD)[0]
        for weight in originals:
            weight.fill_(float("nan"))
        after = int8(tokens[:32], classification_head_name=HEAD)[0]
        poisoned = copy.deepcopy(model)
        next(poisoned.encoder.sentence_encoder.layers[0].self_attn.q_proj.parameters()).fill_(
            float("nan")
        )
        assert torch.isnan(poisoned(tokens[:32], classification_head_name=HEAD)[0]).all()
    assert torch.isfinite(after).all()
    assert torch.equal(before, after)


@pytest.mark.parametrize("dtype", PRECISIONS)
def test_early_exit_at_each_precision(prepared, inputs, dtype, monkeypatch):
    """Decisions on float32 logits; exits and predictions those of the one-pass simulation at
    the same precision (int8 quantizes activations per batch, so a row's numbers depend a
    little on the rows around it: >= 97% there), and >= 97% of predictions equal fp32's."""
    model = prepared[dtype]
    tokens, _ = inputs
    tokens = tokens[:128]
    with torch.no_grad():
        outs = model.exit_outputs(tokens, classification_head_name=HEAD)
        threshold = float(softmax_entropy(outs[0].logits).median())
        policy, seen, real = EntropyPolicy(threshold), [], Decision.decide
        monkeypatch.setattr(  # the decision records the dtype of the logits it gets
            Decision, "decide", lambda self, x, state: seen.append(x.dtype) or real(self, x, state)
        )
        result = model.early_exit(tokens, policy)
        alone = [model.early_exit(row[row.ne(1)].unsqueeze(0), policy) for row in tokens[:16]]
        ref = prepared["fp32"].early_exit(tokens, EntropyPolicy(threshold))
    assert seen and set(seen) == {np.dtype(np.float32)}
    layers, preds = simulate_exits([(o.layer, o.logits) for o in outs], EntropyPolicy(threshold))
    assert len(set(result.exit_layers.tolist())) >= 3  # not vacuous
    same = float(result.exit_layers.eq(layers).float().mean())
    assert same >= (1.0 if dtype == "fp32" else 0.97), same
    assert float(result.predictions.eq(preds).float().mean()) >= 0.97
    assert float(result.predictions.eq(ref.predictions).float().mean()) >= 0.97
    single = torch.cat([r.exit_layers for r in alone])
    assert float(single.eq(result.exit_layers[:16]).float().mean()) >= 0.9
    patience = model.early_exit(tokens, PatiencePolicy(1))
    assert patience.logits.dtype == torch.float32


def test_plain_roberta_and_errors(data_dir, trained):
    plain, _ = build_with_task(data_dir, arch="roberta")
    plain.register_classification_head(HEAD, num_classes=3)
    tokens = torch.tensor([[0, 5, 6, 7, 2]])
    with torch.no_grad():
        ref = plain(tokens, classification_head_name=HEAD)[0]
        for dtype in LOW:
            out = prepare_for_inference(copy.deepcopy(plain), dtype)(
                tokens, classification_head_name=HEAD
            )[0]
            assert out.dtype == torch.float32
            assert torch.allclose(out, ref, atol=0.1)
    model, _ = trained
    once = prepare_for_inference(copy.deepcopy(model), "bf16")
    assert prepare_for_inference(once, "bf16") is once
    with pytest.raises(ValueError, match="already prepared for bf16"):
        prepare_for_inference(once, "int8")
    with pytest.raises(TypeError, match="fairseq RoBERTa"):
        prepare_for_inference(torch.nn.Linear(2, 2), "bf16")


def test_minilm_shape_int8_and_bf16(tmp_path):
    """At MiniLM-L6's shape (6 x 384, 12 heads, FFN 1536): the 6 x 6 + 6 quantized layers
    run, and both precisions give float32 logits close to fp32 (random weights)."""
    model, task = build_with_task(write_dicts(tmp_path), dims=MINILM_DIMS)
    tokens, _ = random_batch(task, 8, seed=3)
    with torch.no_grad():
        ref = model.exit_outputs(tokens, classification_head_name=HEAD)
        for dtype in LOW:
            low = prepare_for_inference(copy.deepcopy(model), dtype)
            if dtype == "int8":
                assert len(quantized_linears(low)) == 6 * 6 + 6
            outs = low.exit_outputs(tokens, classification_head_name=HEAD)
            for a, b in zip(ref, outs):
                assert b.logits.dtype == torch.float32
                scale = float(a.logits.abs().max())
                assert float((a.logits - b.logits).abs().max()) < 0.1 * scale + 0.02


@pytest.mark.parametrize("full_range", [True, False])
def test_int8_activation_range(trained, inputs, full_range):
    """8-bit activations (VNNI CPUs) or torch's 7-bit ones: each quantized layer computes
    exactly FBGEMM's dynamic linear with that ``reduce_range``."""
    model, _ = trained
    int8 = prepare_for_inference(copy.deepcopy(model), "int8", int8_full_range=full_range)
    layer = quantized_linears(int8)["encoder.sentence_encoder.layers.0.fc1"]
    x = torch.randn(5, 7, 32)
    packed = layer._packed_params._packed_params
    expected = torch.ops.quantized.linear_dynamic(x, packed, reduce_range=not full_range)
    other = torch.ops.quantized.linear_dynamic(x, packed, reduce_range=full_range)
    assert torch.equal(layer(x), expected)
    assert not torch.equal(expected, other)  # the two ranges really differ


def test_default_activation_range_follows_the_cpu(trained):
    model, _ = trained
    int8 = prepare_for_inference(copy.deepcopy(model), "int8")
    layer = next(iter(quantized_linears(int8).values()))
    assert getattr(layer, "reduce_range", True) is (not has_vnni())


@pytest.mark.parametrize("dtype", LOW)
def test_cheap_exit_heads(trained, inputs, dtype):
    """Only the shallow heads change precision: the final exit's logits are unchanged, the
    shallow exits' predictions agree with fp32 on >= 98% of the inputs."""
    model, _ = trained
    tokens, _ = inputs
    cheap = prepare_exit_heads(copy.deepcopy(model), dtype)
    heads = cheap.exit_heads(HEAD)
    for _, head in heads[:-1]:
        if dtype == "bf16":
            assert isinstance(head.dense, Bf16Linear) and head.dense.weight.dtype == torch.bfloat16
        else:
            assert head.dense in quantized_linears(cheap).values()
    assert type(heads[-1][1].dense) is torch.nn.Linear
    assert len(quantized_linears(cheap)) == (3 if dtype == "int8" else 0)
    with torch.no_grad():
        ref = model.exit_outputs(tokens, classification_head_name=HEAD)
        out = cheap.exit_outputs(tokens, classification_head_name=HEAD)
        early = cheap.early_exit(tokens[:64], "entropy:0.3")
    assert torch.equal(ref[-1].logits, out[-1].logits)
    for a, b in zip(ref[:-1], out[:-1]):
        assert b.logits.dtype == torch.float32
        assert float(a.logits.argmax(-1).eq(b.logits.argmax(-1)).float().mean()) >= 0.98
    assert early.logits.dtype == torch.float32
