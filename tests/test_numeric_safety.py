"""Numeric safety: bf16 autocast, degenerate features, non-finite gradients, determinism.

* Criterion level: the contrastive criterions stay finite (loss and gradients) through a tiny
  model's forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, at temperature 0.05,
  with identical or all-zero pooled features.
* Trainer level (fairseq's ``Trainer`` in-process): a batch whose contrastive gradient is
  inf/nan does not enter the ACL-Grad statistics, reaches the gradient (so fairseq's own
  overflow handling sees it) and leaves nothing behind: the next update is clean. Tested on
  both paths fairseq has: fp32 (``FloatingPointError``, what CPU training does) and
  ``--fp16`` with dynamic loss scaling (the update is skipped and the scale halved; fairseq
  needs CUDA only for one ``.cuda()`` call there, made a no-op here).
* Determinism: two ``fairseq-train`` runs with the same seed log identical losses.
"""

import math

import pytest
import torch
from fairseq.logging import metrics
from fairseq.trainer import Trainer

import acl_fairseq  # noqa: F401  (registers the task, criterions and models)
from acl_fairseq.criterions.losses import (
    acl_embed_loss,
    cross_layer_loss,
    supervised_contrastive_loss,
)

from fairseq_helpers import fairseq_setup, fairseq_train, json_records, train_args

NUM_CLASSES = 3
VOCAB = 30
TINY = [
    "--encoder-layers", "3", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--max-positions", "64",
]  # fmt: skip
CRITERIONS = {
    "acl_embed": ["--arch", "roberta", "--criterion", "acl_embed"],
    "acl_embed_head": ["--arch", "roberta", "--criterion", "acl_embed", "--acl-grad-scope", "head"],
    "ce_scl": ["--arch", "roberta", "--criterion", "ce_scl", "--acl-grad"],
    "acl_cross_layer": ["--arch", "multi_exit_roberta_tiny", "--criterion", "acl_cross_layer"],
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "input0").mkdir()
    (root / "label").mkdir()
    (root / "input0" / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(VOCAB)))
    (root / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in range(NUM_CLASSES)))
    return root


def build(data_dir, args: list[str], save_dir=None):
    extra = ["--save-dir", str(save_dir)] if save_dir else []
    cfg, task, model = fairseq_setup(
        [
            data_dir, "--task", "acl_sentence_prediction", "--num-classes",
            str(NUM_CLASSES), "--cpu", *TINY, "--dropout", "0", "--attention-dropout", "0",
            "--pooler-dropout", "0", "--seed", "3", "--temperature", "0.05",
            "--optimizer", "adam", "--lr", "1e-3", *extra, *args,
        ],
        seed=3,
    )  # fmt: skip
    return cfg, task, model, task.build_criterion(cfg.criterion)


def make_sample(n=6, seq=7, seed=0, identical=False):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, VOCAB, (n, seq), generator=g)
    if identical:
        tokens[:] = tokens[0]
    tokens[:, 0] = 0
    return {
        "id": torch.arange(n),
        "net_input": {"src_tokens": tokens, "src_lengths": torch.full((n,), seq)},
        "target": torch.tensor([0, 1, 2, 0, 1, 1])[:n],
        "ntokens": n * seq,
        "nsentences": n,
    }


def zero_pooled_features(model) -> None:
    """Every head's pooled feature (its out_proj input, tanh(dense(x))) becomes exactly 0."""
    with torch.no_grad():
        for head in model.classification_heads.values():
            head.dense.weight.zero_()
            head.dense.bias.zero_()


# --------------------------------------------------------------------- criterion level
@pytest.mark.parametrize("case", ["random", "identical", "zero"])
@pytest.mark.parametrize("name", list(CRITERIONS))
def test_contrastive_criterions_are_finite_in_bf16_autocast(data_dir, name, case):
    _, _, model, criterion = build(data_dir, CRITERIONS[name])
    model.train()
    if case == "zero":
        zero_pooled_features(model)
    sample = make_sample(identical=case == "identical")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, con, n, log = criterion.loss_terms(model, sample)
    assert n == 6
    assert torch.isfinite(ce) and torch.isfinite(con), (ce, con)
    assert con.dtype == torch.float32 and ce.dtype == torch.float32
    (ce + con).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    if case == "random":  # the contrastive term really is in the graph
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, con, _, _ = criterion.loss_terms(model, sample)
        con.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_losses_are_float32_under_bf16_autocast():
    # autocast on CPU runs matmuls in bf16 even for float32 inputs: at temperature 0.05 a
    # bf16 similarity (3 significant digits) moves the logits by ~0.1
    g = torch.Generator().manual_seed(0)
    h, h2 = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    lab, lab2 = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    losses = [
        lambda: acl_embed_loss(h, y, lab, 0.05),
        lambda: supervised_contrastive_loss(h, y, 0.05),
        lambda: cross_layer_loss(h, lab, h2, lab2, y, 0.05),
    ]
    for loss in losses:
        full = loss()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = loss()
        assert mixed.dtype == torch.float32 and mixed.item() == full.item()


# ----------------------------------------------------------------------- trainer level
class InjectInf:
    """Multiplies the criterion's contrastive term by inf while ``on``: an inf/nan gradient."""

    def __init__(self, criterion):
        self.on = False
        attr = (
            "contrastive_terms" if hasattr(criterion, "contrastive_terms") else "contrastive_term"
        )
        original = getattr(criterion, attr)

        def poisoned(*args, **kwargs):
            out = original(*args, **kwargs)
            if not self.on:
                return out
            if isinstance(out, list):
                return [t * math.inf for t in out]
            return out * math.inf

        setattr(criterion, attr, poisoned)


def train_step(trainer, sample):
    with metrics.aggregate(new_root=True) as agg:
        out = trainer.train_step([sample])
    return out, agg


def all_finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["acl_embed", "acl_embed_head", "acl_cross_layer"])
def test_fp32_inf_gradient_raises_and_the_next_update_is_clean(data_dir, tmp_path, name):
    cfg, task, model, criterion = build(data_dir, CRITERIONS[name], save_dir=tmp_path)
    trainer = Trainer(cfg, task, model, criterion)
    inject = InjectInf(criterion)

    _, agg = train_step(trainer, make_sample(seed=1))
    assert trainer.get_num_updates() == 1 and 0 <= agg["acl_grad_angle"].avg <= 180

    before = params(model)
    inject.on = True
    with metrics.aggregate(new_root=True) as agg, pytest.raises(Exception) as info:
        trainer.train_step([make_sample(seed=2)])
    # fairseq fp32: FloatingPointError("gradients are Nan/Inf"); its NanDetector re-run may
    # then fail itself under recent torch (StopIteration in a backward hook), so look at
    # the chain
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__context__
    assert any(isinstance(e, FloatingPointError) for e in chain), chain
    assert "acl_grad_angle" not in agg.keys() and "acl_grad_drop" not in agg.keys()
    assert trainer.get_num_updates() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))  # no step taken

    inject.on = False
    _, agg = train_step(trainer, make_sample(seed=3))
    assert trainer.get_num_updates() == 2
    assert 0 <= agg["acl_grad_angle"].avg <= 180 and agg["acl_grad_angle"].count == 1
    assert all_finite(model)
    # kept or dropped, the buffer is spent within the update (the head scope has none)
    assert not task.acl_grad.holds_contrastive_gradient


@pytest.mark.parametrize("name", ["acl_embed", "acl_embed_head", "acl_cross_layer"])
def test_fp16_overflow_skips_the_update_and_the_next_one_is_clean(
    data_dir, tmp_path, name, monkeypatch
):
    # fairseq's overflow handler does grad_norm = torch.tensor(0.0).cuda(): the only CUDA call
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    cfg, task, model, criterion = build(
        data_dir, [*CRITERIONS[name], "--fp16", "--fp16-no-flatten-grads"], save_dir=tmp_path
    )
    trainer = Trainer(cfg, task, model, criterion)
    inject = InjectInf(criterion)

    _, agg = train_step(trainer, make_sample(seed=1))
    assert trainer.get_num_updates() == 1 and 0 <= agg["acl_grad_angle"].avg <= 180
    scale = trainer.optimizer.scaler.loss_scale

    before = params(model)
    inject.on = True
    out, agg = train_step(trainer, make_sample(seed=2))
    assert out is None  # the update was skipped ...
    assert trainer.get_num_updates() == 1
    assert trainer.optimizer.scaler.loss_scale == scale / 2  # ... and the loss scale halved
    assert "acl_grad_angle" not in agg.keys() and "acl_grad_drop" not in agg.keys()
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))

    inject.on = False
    _, agg = train_step(trainer, make_sample(seed=3))
    assert trainer.get_num_updates() == 2
    assert 0 <= agg["acl_grad_angle"].avg <= 180 and agg["acl_grad_angle"].count == 1
    assert all_finite(model) and not task.acl_grad.holds_contrastive_gradient
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model)))


# ------------------------------------------------------------------------- determinism
@pytest.mark.slow
def test_same_seed_gives_the_same_losses(sentiment_data, tmp_path):
    # dropout on: the trainer re-seeds every update
    args = train_args(
        criterion="acl_embed", max_update=8, seed=7, disable_validation=True, no_save=True
    )
    runs = [fairseq_train(sentiment_data, tmp_path / str(i), *args) for i in range(2)]
    timing = {"wps", "ups", "wall", "train_wall"}
    records = [
        [
            {k: v for k, v in r.items() if k.removeprefix("train_") not in timing}
            for r in json_records(out)
        ]
        for out in runs
    ]
    inner = [r for r in records[0] if "num_updates" in r and "epoch" in r]
    assert len(inner) == 8 and "acl_grad_angle" in inner[0] and "contrastive_loss" in inner[0]
    assert records[0] == records[1]
