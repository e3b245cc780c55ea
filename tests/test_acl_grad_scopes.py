"""ACL-Grad's approximate scopes (``--acl-grad-scope head`` / ``top:K``) against naive
full-backward gradients, and what a skipped update (fp16 overflow, AMP) leaves in the
statistics."""

import math
from types import SimpleNamespace

import pytest
import torch
from fairseq.optim.amp_optimizer import AMPOptimizer
from fairseq.optim.fairseq_optimizer import FairseqOptimizer
from test_acl_grad import (
    PlainOptimizer,
    TwoTermCriterion,
    TwoTermModel,
    make_task,
    run_update,
)

from acl_fairseq.acl_grad import AclGrad, AclGradSettings, LossTerms, read_angle_log
from acl_fairseq.acl_grad.angles import gradient_angle


# --------------------------------------------------------------------- --acl-grad-scope head
class HeadedModel(TwoTermModel):
    """TwoTermModel plus a head parameter ``classification_heads.h.v`` (2)."""

    def __init__(self):
        super().__init__()
        self.classification_heads = torch.nn.ModuleDict({"h": torch.nn.Module()})
        self.classification_heads["h"].v = torch.nn.Parameter(torch.zeros(2))


class HeadedCriterion(TwoTermCriterion):
    """CE = a.w + u + c.v, contrastive = b.w + d.v: the head gradients are c and d."""

    def __init__(self, scope="head", threshold=90.0):
        self.acl_grad = AclGradSettings(threshold=threshold, scope=scope)

    def loss_terms(self, model, sample):
        ce, con, n, log = super().loss_terms(model, sample)
        v = model.classification_heads["h"].v
        ce = ce + (torch.tensor(sample["c"]) * v).sum()
        con = con + (torch.tensor(sample["d"]) * v).sum()
        return LossTerms(ce, con, n, log)


def head_sample(a, b, c, d):
    return {"a": a, "b": b, "c": c, "d": d}


def test_head_scope_decides_on_the_head_gradients_only():
    # whole-model gradients: ce (1,0|1|1,0), con (-2,0|0|1,1): 103.6 degrees; heads: 45
    sample = head_sample([1.0, 0.0], [-2.0, 0.0], [1.0, 0.0], [1.0, 1.0])
    whole = math.degrees(math.acos(-1 / math.sqrt(18)))
    model, task = HeadedModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    agg = run_update(task, model, opt, [sample], HeadedCriterion("head"))
    assert agg.get_smoothed_value("acl_grad_angle") == pytest.approx(45.0, abs=1e-3)
    torch.testing.assert_close(model.w.grad, torch.tensor([-1.0, 0.0]))  # kept: a + b
    torch.testing.assert_close(model.classification_heads["h"].v.grad, torch.tensor([2.0, 1.0]))
    # the exact scope, on the same gradients, drops the term
    model, task = HeadedModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    agg = run_update(task, model, opt, [sample], HeadedCriterion("all"))
    assert agg.get_smoothed_value("acl_grad_angle") == pytest.approx(whole, abs=0.05)
    torch.testing.assert_close(model.w.grad, torch.tensor([1.0, 0.0]))  # dropped: a only


def test_head_scope_drops_the_term_in_the_same_backward_pass():
    sample = head_sample([1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [-1.0, 0.5])
    model, task = HeadedModel(), make_task()
    opt = PlainOptimizer(model.parameters(), loss_scale=8.0)
    agg = run_update(task, model, opt, [sample], HeadedCriterion("head"))
    assert agg.get_smoothed_value("acl_grad_drop") == 1.0
    torch.testing.assert_close(model.w.grad, 8.0 * torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(model.u.grad, 8.0 * torch.tensor([1.0]))
    head_grad = model.classification_heads["h"].v.grad
    torch.testing.assert_close(head_grad, 8.0 * torch.tensor([1.0, 0.0]))
    assert not task.acl_grad.holds_contrastive_gradient  # no side buffer


def test_head_scope_decides_per_micro_batch(tmp_path):
    log = tmp_path / "angles.tsv"
    conflicting = head_sample([1.0, 0.0], [5.0, 5.0], [1.0, 0.0], [-1.0, 0.0])
    agreeing = head_sample([1.0, 0.0], [5.0, 5.0], [1.0, 0.0], [1.0, 0.0])
    model, task = HeadedModel(), make_task(log=str(log))
    opt = PlainOptimizer(model.parameters())
    run_update(task, model, opt, [conflicting, agreeing], HeadedCriterion("head"))
    # micro-batch 1 dropped its term, micro-batch 2 kept it: 2a + b
    torch.testing.assert_close(model.w.grad, torch.tensor([7.0, 5.0]))
    torch.testing.assert_close(model.classification_heads["h"].v.grad, torch.tensor([3.0, 0.0]))
    rows = read_angle_log(log)
    assert [(r.angle, r.kept) for r in rows] == [(180.0, False), (0.0, True)]
    assert [r.head_angle for r in rows] == [r.angle for r in rows]


def test_exact_scope_logs_the_head_angle_of_the_update(tmp_path):
    log = tmp_path / "angles.tsv"
    sample = head_sample([1.0, 0.0], [-2.0, 0.0], [1.0, 0.0], [1.0, 1.0])
    model, task = HeadedModel(), make_task(log=str(log))
    opt = PlainOptimizer(model.parameters())
    run_update(task, model, opt, [sample, sample], HeadedCriterion("all"))
    (row,) = read_angle_log(log)
    assert row.angle == pytest.approx(math.degrees(math.acos(-1 / math.sqrt(18))), abs=1e-3)
    assert not row.kept
    assert row.head_angle == pytest.approx(45.0, abs=1e-3)


def test_head_scope_without_head_parameters_is_a_clear_error():
    model, task = TwoTermModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    criterion = HeadedCriterion("head")
    criterion.loss_terms = TwoTermCriterion().loss_terms
    with pytest.raises(ValueError, match="--acl-grad-scope all"):
        run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [1.0, 1.0]}], criterion)


# --------------------------------------------------------------------- --acl-grad-scope top:K
class LayeredModel(torch.nn.Module):
    """An embedding, 3 encoder layers named as in RoBERTa and a classification head."""

    def __init__(self, frozen_embedding=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(4, generator=g))
        self.embed.requires_grad_(not frozen_embedding)
        layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.encoder = torch.nn.Module()
        self.encoder.sentence_encoder = torch.nn.Module()
        self.encoder.sentence_encoder.layers = layers
        self.classification_heads = torch.nn.ModuleDict({"h": torch.nn.Linear(4, 2)})
        with torch.no_grad():
            for p in [*layers.parameters(), *self.classification_heads.parameters()]:
                p.copy_(torch.randn(p.shape, generator=g))
        self.num_updates = 0

    def set_num_updates(self, n):
        self.num_updates = n


class LayeredCriterion(TwoTermCriterion):
    """CE and a contrastive stand-in, both depending on every parameter."""

    def __init__(self, scope="all", threshold=90.0):
        self.acl_grad = AclGradSettings(threshold=threshold, scope=scope)

    def loss_terms(self, model, sample):
        x = torch.tensor(sample["x"]) * model.embed
        for layer in model.encoder.sentence_encoder.layers:
            x = torch.tanh(layer(x))
        logits = model.classification_heads["h"](x)
        ce = torch.nn.functional.cross_entropy(logits[None], torch.tensor([sample["y"]]))
        con = (x * torch.tensor(sample["t"])).sum() + logits.pow(2).sum() * 0.1
        return LossTerms(ce, con, 1, {})


LAYERED_SAMPLE = {"x": [1.0, -0.5, 0.3, 2.0], "y": 1, "t": [0.5, 1.0, -1.0, 0.2]}
LAYER_NAMES = {
    0: ["classification_heads.h.weight", "classification_heads.h.bias"],
    1: ["encoder.sentence_encoder.layers.2.weight", "encoder.sentence_encoder.layers.2.bias"],
}


def naive_angle(criterion, sample, names, frozen_embedding=False):
    """The angle on ``names`` from two full backward passes of a fresh model."""
    grads = []
    for term in (0, 1):
        model = LayeredModel(frozen_embedding)
        criterion.loss_terms(model, sample)[term].backward()
        named = dict(model.named_parameters())
        grads.append([named[n].grad for n in names])
    return gradient_angle(*grads), grads


def scope_names(k, model=None):
    model = model or LayeredModel()
    lowest = 3 - k
    return [
        n
        for n, p in model.named_parameters()
        if p.requires_grad
        and ("classification_heads" in n or any(f"layers.{i}." in n for i in range(lowest, 3)))
    ]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_top_k_decides_on_the_gradients_of_its_parameters(tmp_path, k):
    """top:K's angle is the angle of the full-backward gradients restricted to the heads and
    the top K layers; the kept update's .grad is one ordinary backward of CE + term."""
    names = scope_names(k)
    assert len(names) == 2 + 2 * k
    expected, _ = naive_angle(LayeredCriterion(), LAYERED_SAMPLE, names)
    log = tmp_path / "angles.tsv"
    model, task = LayeredModel(), make_task(log=str(log))
    opt = PlainOptimizer(model.parameters())
    run_update(task, model, opt, [LAYERED_SAMPLE], LayeredCriterion(f"top:{k}", threshold=180))
    (row,) = read_angle_log(log)
    assert row.angle == pytest.approx(expected, abs=1e-4) and row.kept
    full = LayeredModel()
    ce, con, _, _ = LayeredCriterion().loss_terms(full, LAYERED_SAMPLE)
    (ce + con).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), full.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert not task.acl_grad.holds_contrastive_gradient  # no side buffer


def test_top_k_angles_differ_with_k_and_top_zero_is_head():
    angles = [naive_angle(LayeredCriterion(), LAYERED_SAMPLE, scope_names(k))[0] for k in range(4)]
    assert len({round(a, 3) for a in angles}) == 4  # the constructed case tells K apart
    results = {}
    for scope in ("head", "top:0"):
        model, task = LayeredModel(), make_task()
        opt = PlainOptimizer(model.parameters())
        agg = run_update(task, model, opt, [LAYERED_SAMPLE], LayeredCriterion(scope))
        results[scope] = (
            agg.get_smoothed_value("acl_grad_angle"),
            [p.grad for p in model.parameters()],
        )
    assert results["head"][0] == results["top:0"][0]
    for a, b in zip(results["head"][1], results["top:0"][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threshold", [30.0, 150.0])
def test_top_all_layers_decides_like_the_exact_scope(threshold):
    """With nothing trainable below the layers, top:L measures every trainable parameter."""
    out = {}
    for scope in ("all", "top:3"):
        model, task = LayeredModel(frozen_embedding=True), make_task()
        opt = PlainOptimizer([p for p in model.parameters() if p.requires_grad])
        agg = run_update(
            task, model, opt, [LAYERED_SAMPLE], LayeredCriterion(scope, threshold=threshold)
        )
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        out[scope] = (
            agg.get_smoothed_value("acl_grad_angle"),
            agg.get_smoothed_value("acl_grad_drop"),
            grads,
        )
    assert out["top:3"][0] == pytest.approx(out["all"][0], abs=1e-4)
    assert out["top:3"][1] == out["all"][1] == (1.0 if threshold == 30.0 else 0.0)
    for a, b in zip(out["all"][2], out["top:3"][2]):
        torch.testing.assert_close(a, b)


def test_exact_scope_logs_the_top_k_angles_of_the_update(tmp_path):
    log = tmp_path / "angles.tsv"
    model, task = LayeredModel(), make_task(log=str(log), log_top_k="3,1")
    opt = PlainOptimizer(model.parameters())
    run_update(task, model, opt, [LAYERED_SAMPLE], LayeredCriterion("all"))
    (row,) = read_angle_log(log)
    assert [k for k, _ in row.top_angles] == [1, 3]
    for k, angle in row.top_angles:
        expected, _ = naive_angle(LayeredCriterion(), LAYERED_SAMPLE, scope_names(k))
        assert angle == pytest.approx(expected, abs=1e-3)
    head, _ = naive_angle(LayeredCriterion(), LAYERED_SAMPLE, scope_names(0))
    assert row.head_angle == pytest.approx(head, abs=1e-3)
    every = [n for n, _ in LayeredModel().named_parameters()]
    assert row.angle == pytest.approx(
        naive_angle(LayeredCriterion(), LAYERED_SAMPLE, every)[0], abs=1e-3
    )


@pytest.mark.parametrize(
    "scope,log_top_k,message",
    [
        ("top:4", None, "--acl-grad-scope: K=4 is outside 0..3"),
        ("all", "1,4", "--acl-grad-log-top-k: K=4 is outside 0..3"),
        ("top:1", "1", "--acl-grad-log-top-k .* needs\n?.*--acl-grad-scope all"),
    ],
)
def test_k_beyond_the_encoder_layers_is_a_set_up_error(scope, log_top_k, message):
    unit = AclGrad(log_top_k=log_top_k)
    with pytest.raises(ValueError, match=message):
        unit.check_model(LayeredModel(), AclGradSettings(90.0, scope))
    unit.check_model(LayeredModel(), None)  # ACL-Grad off: nothing to check
    AclGrad(log_top_k="0,3").check_model(LayeredModel(), AclGradSettings(90.0, "all"))
    AclGrad().check_model(LayeredModel(), AclGradSettings(90.0, "top:3"))


@pytest.mark.parametrize("scope", ["top:", "top:-1", "top:1.5", "layers", "top:x"])
def test_a_malformed_scope_names_the_flag(scope):
    cfg = SimpleNamespace(acl_grad=False, acl_grad_threshold=90.0, acl_grad_scope=scope)
    with pytest.raises(ValueError, match="--acl-grad-scope must be 'all', 'head' or 'top:K'"):
        AclGradSettings.from_config(cfg)
    with pytest.raises(ValueError, match="--acl-grad-log-top-k is a comma list"):
        AclGrad(log_top_k="1,x")


# --------------------------------------------------------------------- skipped updates
@pytest.mark.parametrize("scope", ["all", "head"])
def test_a_skipped_update_enters_no_statistic(tmp_path, scope):
    """fp16 overflow: the trainer zeroes the gradients instead of stepping. The update's
    finite decisions (the head scope decides before the backward pass that overflows) are
    neither logged nor averaged; the next, applied update is."""
    log = tmp_path / "angles.tsv"
    model, task = HeadedModel(), make_task(log=str(log))
    opt = PlainOptimizer(model.parameters())
    sample = head_sample([1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0])
    agg = run_update(task, model, opt, [sample, sample], HeadedCriterion(scope), overflow=True)
    assert "acl_grad_angle" not in agg.keys() and not log.exists()
    agg = run_update(task, model, opt, [sample], HeadedCriterion(scope), update_num=0)
    (row,) = read_angle_log(log)
    assert row.update == 0 and row.kept
    assert agg.get_smoothed_value("acl_grad_angle") == pytest.approx(row.angle, abs=0.05)


class HalvingScaler:
    """torch's GradScaler as ACL-Grad sees it: it scales losses and halves its scale when it
    skips a step."""

    def __init__(self):
        self.factor = 8.0

    def scale(self, loss):
        return loss * self.factor

    def get_scale(self):
        return self.factor


class AmpLikeOptimizer(AMPOptimizer):
    """fairseq's ``AMPOptimizer`` whose scaler skips the step when ``skip`` (e.g. an
    overflow), as torch's GradScaler does inside ``step``."""

    def __init__(self, params, skip):
        FairseqOptimizer.__init__(self, SimpleNamespace())
        self.fp32_optimizer = PlainOptimizer(params)
        self._grad_scaler = HalvingScaler()
        self.skip = skip

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        if self.skip:
            self.scaler.factor /= 2
        else:
            self.fp32_optimizer.step()


@pytest.mark.parametrize("skip", [True, False])
def test_an_update_amp_skips_enters_no_statistic(tmp_path, skip):
    log = tmp_path / "angles.tsv"
    model, task = TwoTermModel(), make_task(log=str(log))
    opt = AmpLikeOptimizer(model.parameters(), skip)
    agg = run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [1.0, 1.0]}])
    assert ("acl_grad_angle" in agg.keys()) is not skip
    assert len(read_angle_log(log)) == (0 if skip else 1)
