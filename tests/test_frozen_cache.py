"""``--freeze-backbone``'s per-sentence cache (``models.frozen_cache``, ``frozen_backbone``):
what it gives equals the encoder run on every batch (the uncached path, today's refit at
dropout 0), whatever the padding, order or batch a sentence comes in; it is not used when the
backbone is not frozen; and a refit through fairseq-train fits the same heads with and without
it (one worker and two data-parallel workers)."""

from __future__ import annotations

import pytest
import torch

from acl_fairseq.models.frozen_cache import FrozenExitCache, FrozenInputs, row_keys

from fairseq_helpers import (
    TINY_MULTI_EXIT_3,
    fairseq_setup,
    fairseq_train_with,
    json_records,
    make_dataset,
    rank_output,
    train_args,
)
from tiny_models import write_dicts

NUM_CLASSES = 3
PAD = 1


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_dicts(tmp_path_factory.mktemp("data"), 30, NUM_CLASSES)


def build(data_dir, *flags: str, dropout: str = "0"):
    """(task, model) as fairseq-train builds them (``--task acl_sentence_prediction``)."""
    _, task, model = fairseq_setup(
        [
            data_dir, "--task", "acl_sentence_prediction", "--num-classes", str(NUM_CLASSES),
            "--max-positions", "64", "--arch", "multi_exit_roberta_tiny", "--encoder-layers",
            "3", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
            "--encoder-attention-heads", "2", "--dropout", dropout, "--attention-dropout",
            dropout, "--criterion", "multi_exit_ce", "--exit-pooling", "mean", *flags,
        ],
        seed=3,
    )  # fmt: skip
    return task, model


def sentences(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` sentences ``<s> words </s>`` of 1 to 8 random words."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    bos, eos = torch.tensor([0]), torch.tensor([2])
    return [torch.cat([bos, torch.randint(4, 30, (k,), generator=g), eos]) for k in lengths]


def batch(rows: list[torch.Tensor], extra_pad: int = 0) -> torch.Tensor:
    """Right-padded B x T tokens, ``extra_pad`` all-pad columns more than needed."""
    width = max(len(r) for r in rows) + extra_pad
    out = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def uncached(model, tokens):
    """The exits' outputs with the encoder run on this batch (the cache set aside)."""
    cache, model.frozen_cache = model.frozen_cache, None
    try:
        return model.exit_outputs(tokens)
    finally:
        model.frozen_cache = cache


def assert_same_outputs(got, want, atol=1e-6):
    assert [o.layer for o in got] == [o.layer for o in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.logits, w.logits, atol=atol, rtol=0)
        torch.testing.assert_close(g.features, w.features, atol=atol, rtol=0)
        assert g.label_embeddings is w.label_embeddings


def test_row_keys_ignore_padding_and_tell_sentences_apart():
    a, b = torch.tensor([0, 5, 6, 2]), torch.tensor([0, 5, 2])
    assert row_keys(batch([a, b]), PAD) == row_keys(batch([a, b], extra_pad=3), PAD)
    left = torch.tensor([[PAD, PAD, 0, 5, 2]])  # left padding: the same sentence
    assert row_keys(left, PAD) == [row_keys(batch([b]), PAD)[0]]
    assert len(set(row_keys(batch([a, b, torch.tensor([0, 6, 5, 2])]), PAD))) == 3


def test_cache_computes_each_sentence_once_and_keeps_to_its_budget():
    calls = []

    def compute(tokens):
        calls.append(len(tokens))
        value = tokens.ne(PAD).sum(1, keepdim=True).float()  # depends on the row only
        return FrozenInputs(value.expand(-1, 4).reshape(-1, 2, 2), value * 2, value * 3)

    rows = sentences(6, seed=0)
    cache = FrozenExitCache(max_bytes=10**6)
    first = cache.get(batch(rows[:4]), PAD, compute)
    again = cache.get(batch([rows[5], rows[2], rows[0], rows[4]], extra_pad=2), PAD, compute)
    assert calls == [4, 2] and len(cache) == 6  # rows 2 and 0 came from the cache
    torch.testing.assert_close(again.final_logits[1:3], first.final_logits[[2, 0]])
    assert again.pooled.shape == (4, 2, 2)
    row_size = (4 + 1 + 1) * 4  # pooled E x C, logits, features: float32
    small = FrozenExitCache(max_bytes=2 * row_size)  # room for two sentences
    calls.clear()
    for _ in range(2):
        out = small.get(batch(rows[:4]), PAD, compute)
    assert len(small) == 2 and small.full and calls == [4, 2]  # the other two: every time
    torch.testing.assert_close(out.final_logits, first.final_logits)


def test_frozen_part_stays_in_eval_mode_and_the_heads_train(data_dir):
    _, model = build(data_dir, "--freeze-backbone", dropout="0.3")
    model.train()
    trainable = {id(h) for _, h in model.exit_heads()[:-1]}
    assert not model.encoder.training and any(m.training for m in model.modules())
    for head in model.classification_heads.values():
        assert head.training == (id(head) in trainable)
    tokens = batch(sentences(5, seed=1))
    # no dropout in the frozen part: the final exit is a fixed function of the tokens
    once, twice = uncached(model, tokens), uncached(model, tokens)
    torch.testing.assert_close(once[-1].logits, twice[-1].logits, atol=0, rtol=0)
    model.eval()
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("exit_head", ["linear", "mlp"])
def test_cached_outputs_equal_the_encoder_run_on_every_batch(data_dir, exit_head):
    task, model = build(data_dir, "--freeze-backbone", "--exit-head", exit_head)
    assert model.frozen_cache is not None and len(model.frozen_cache) == 0
    rows = sentences(12, seed=2)
    model.train()
    for start in (0, 6):  # the first epoch: every sentence computed once
        tokens = batch(rows[start : start + 6])
        assert_same_outputs(model.exit_outputs(tokens), uncached(model, tokens))
    assert len(model.frozen_cache) == 12
    # a later epoch: other batches, order and padding; no encoder pass
    order = [7, 3, 11, 0, 5, 9, 1]
    tokens = batch([rows[i] for i in order], extra_pad=4)
    model.encoder.forward = None  # would fail if called
    cached = model.exit_outputs(tokens)
    del model.encoder.forward
    assert_same_outputs(cached, uncached(model, tokens))
    # gradients reach the shallow heads (from the cached inputs), nothing else
    loss = sum(o.logits.logsumexp(-1).sum() for o in cached)
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("_exit" in n for n in grads)


def test_new_weights_clear_the_cache(data_dir):
    _, model = build(data_dir, "--freeze-backbone")
    tokens = batch(sentences(4, seed=3))
    model.exit_outputs(tokens)
    assert len(model.frozen_cache) == 4
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert len(model.frozen_cache) == 0
    assert_same_outputs(model.exit_outputs(tokens), uncached(model, tokens))


def test_no_cache_unless_the_backbone_is_frozen(data_dir):
    _, model = build(data_dir, dropout="0.3")
    assert model.frozen_cache is None and not model.use_frozen_cache()
    model.train()
    tokens = batch(sentences(5, seed=4))
    a, b = model.exit_outputs(tokens), model.exit_outputs(tokens)
    assert not torch.equal(a[-1].logits, b[-1].logits)  # the encoder ran, with its dropout
    _, off = build(data_dir, "--freeze-backbone", "--freeze-backbone-cache-mb", "0")
    assert off.frozen_cache is None
    _, frozen = build(data_dir, "--freeze-backbone")
    frozen.encoder.sentence_encoder.layers[0].fc1.weight.requires_grad_(True)  # not frozen
    assert frozen.cached_exit_outputs(tokens, "sentence_classification_head") is None
    frozen.exit_outputs(tokens)
    assert len(frozen.frozen_cache) == 0


def test_a_negative_cache_size_is_a_clear_error(data_dir):
    with pytest.raises(ValueError, match=r"--freeze-backbone-cache-mb must be >= 0"):
        build(data_dir, "--freeze-backbone", "--freeze-backbone-cache-mb", "-1")


REFIT = [
    *TINY_MULTI_EXIT_3, "--criterion", "multi_exit_ce", "--freeze-backbone", "--exit-head",
    "linear", "--self-distill-weight", "1", "--self-distill-temperature", "2",
    "--exit-pooling", "mean", "--max-epoch", "3", "--activation-dropout", "0",
]  # fmt: skip
HEAD_TOLERANCE = 1e-5
"""Max abs difference of the refitted heads' weights, cached or not: float rounding (a
sentence's features computed in another batch, with other padding)."""


def heads_of(save_dir):
    state = torch.load(save_dir / "checkpoint_last.pt", weights_only=False)["model"]
    return {k: v for k, v in state.items() if "_exit" in k}


def losses(out: str, kind: str) -> list[float]:
    """The ``loss`` of fairseq's per-epoch ``train`` or ``valid`` JSON records."""
    key = f"{kind}_loss"
    return [float(r[key]) for r in json_records(out) if key in r and "epoch" in r]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_refit_fits_the_same_heads_with_and_without_the_cache(tmp_path, workers):
    """Dropout 0 in the encoder (there today's refit, the encoder in train mode, computes what
    the eval-mode frozen part computes), the heads' own dropout on; 3 epochs, each validated:
    the heads and the losses agree with the uncached run, and the heads learned."""
    data = make_dataset(tmp_path / "data", 96, 32)
    flags = train_args([], batch_size=8, seed=3, required_batch_size_multiple=1, dropout=0,
                       attention_dropout=0, pooler_dropout=0.1)  # fmt: skip
    runs = {}
    for cache_mb in ("0", "64"):
        save = tmp_path / f"mb{cache_mb}-w{workers}"
        args = [*REFIT, *flags, "--freeze-backbone-cache-mb", cache_mb]
        if workers > 1:
            args += ["--ddp-backend", "legacy_ddp"]
        out = fairseq_train_with(data, save, *args, workers=workers)
        runs[cache_mb] = (heads_of(save), out if workers == 1 else rank_output(out, 0))
    (plain, plain_out), (cached, cached_out) = runs["0"], runs["64"]
    said = "--freeze-backbone: the frozen part runs once per sentence"
    assert said in cached_out and said not in plain_out
    assert plain.keys() == cached.keys() and plain
    diff = max((plain[k] - cached[k]).abs().max().item() for k in plain)
    assert diff <= HEAD_TOLERANCE, diff
    for kind in ("train", "valid"):
        want, got = losses(plain_out, kind), losses(cached_out, kind)
        assert len(got) == 3 and got == pytest.approx(want, abs=2e-3)
    assert losses(cached_out, "train")[-1] < losses(cached_out, "train")[0]
