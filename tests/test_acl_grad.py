"""ACL-Grad: the angle, the decision, and what the task's train_step leaves in ``.grad``."""

import math
from types import SimpleNamespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.logging import metrics
from fairseq.optim.dynamic_loss_scaler import DynamicLossScaler
from fairseq.optim.fairseq_optimizer import FairseqOptimizer

from acl_fairseq.acl_grad import (
    AclGradOptimizer,
    AclGradSettings,
    AngleRecord,
    LossTerms,
    read_angle_log,
)
from acl_fairseq.acl_grad.angles import ContrastiveGradientBuffer, decide, gradient_angle
from acl_fairseq.tasks.acl_sentence_prediction import (
    AclSentencePredictionConfig,
    AclSentencePredictionTask,
)


def test_gradient_angle_reference_values():
    e1 = [torch.tensor([1.0, 0.0]), torch.tensor([0.0])]
    e2 = [torch.tensor([0.0, 1.0]), torch.tensor([0.0])]
    assert gradient_angle(e1, e2) == pytest.approx(90.0)
    assert gradient_angle(e1, e1) == pytest.approx(0.0, abs=1e-6)
    assert gradient_angle(e1, [-t for t in e1]) == pytest.approx(180.0)
    diag = [torch.tensor([1.0, 1.0]), torch.tensor([0.0])]
    assert gradient_angle(e1, diag) == pytest.approx(45.0)
    # scale invariance (fp16 loss scaling) and splitting across tensors
    a = [torch.randn(3, 4), torch.randn(5)]
    b = [torch.randn(3, 4), torch.randn(5)]
    flat = math.degrees(
        math.acos(
            torch.nn.functional.cosine_similarity(
                torch.cat([t.flatten() for t in a]).double(),
                torch.cat([t.flatten() for t in b]).double(),
                dim=0,
            ).item()
        )
    )
    assert gradient_angle(a, b) == pytest.approx(flat, abs=1e-4)  # float32 dot products
    assert gradient_angle([t * 4096 for t in a], b) == pytest.approx(flat, abs=1e-4)


def test_undefined_angles_keep_the_term_and_are_not_finite():
    zero = [torch.zeros(3)]
    other = [torch.ones(3)]
    assert math.isnan(gradient_angle(zero, other))
    inf = [torch.tensor([float("inf"), 0.0, 0.0])]
    assert math.isnan(gradient_angle(inf, other))
    d = decide(math.nan, 90.0)
    assert d.keep and not d.finite


@pytest.mark.parametrize(
    "angle,threshold,keep", [(89.9, 90, True), (90.1, 90, False), (120, 150, True), (30, 0, False)]
)
def test_decide(angle, threshold, keep):
    assert decide(angle, threshold).keep is keep


def test_buffer_accumulates_reduces_and_adds():
    p1 = torch.nn.Parameter(torch.zeros(2, 2))
    p2 = torch.nn.Parameter(torch.zeros(3))
    buf = ContrastiveGradientBuffer([p1, p2])
    assert buf.empty
    buf.accumulate([torch.ones(2, 2), None])
    buf.accumulate([torch.ones(2, 2), torch.full((3,), 2.0)])
    buf.all_reduce(lambda t: t.mul_(0.5))  # stands in for a mean over 2 workers
    p1.grad = torch.ones(2, 2)
    buf.add_to_grad()
    torch.testing.assert_close(p1.grad, torch.full((2, 2), 2.0))
    torch.testing.assert_close(p2.grad, torch.ones(3))
    assert buf.empty


# ----------------------------------------------------------------- the task and its ACL-Grad
class TwoTermModel(torch.nn.Module):
    """Parameters w (2) and u (1); the criterion below makes CE = a.w + u and
    contrastive = b.w, so the gradients are (a, 1) and (b, 0)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.u = torch.nn.Parameter(torch.zeros(1))
        self.num_updates = 0

    def set_num_updates(self, n):
        self.num_updates = n


class TwoTermCriterion:
    """An ``AclGradCriterion`` (the task's contract), ACL-Grad on at 90 degrees."""

    acl_grad = AclGradSettings(threshold=90.0, scope="all")

    def loss_terms(self, model, sample):
        a = torch.tensor(sample["a"])
        b = torch.tensor(sample["b"])
        ce = (a * model.w).sum() + model.u.sum()
        con = (b * model.w).sum()
        return LossTerms(ce, con, 1, {})

    def check_model(self, model):
        pass


class PlainOptimizer(FairseqOptimizer):
    def __init__(self, params, loss_scale=None):
        super().__init__(SimpleNamespace())
        self._optimizer = torch.optim.SGD(params, lr=0.0)
        if loss_scale is not None:
            self.scaler = DynamicLossScaler(init_scale=loss_scale)

    def backward(self, loss):
        if getattr(self, "scaler", None) is not None:
            loss = self.scaler.scale(loss)
        loss.backward()


def make_task(tmp_path=None, log=None, log_top_k=None):
    d = Dictionary()
    cfg = AclSentencePredictionConfig(
        data="unused", num_classes=2, acl_grad_log=log, acl_grad_log_top_k=log_top_k
    )
    return AclSentencePredictionTask(cfg, d, d)


def run_update(task, model, opt, samples, criterion=None, update_num=0, overflow=False):
    """What fairseq's Trainer does for one update (single worker): with ``overflow``, what it
    does when the fp16 loss scaler finds an overflow (zero the gradients instead of a step).
    The step itself is left out (SGD at lr 0), so the tests read what reached ``.grad``."""
    criterion = criterion or TwoTermCriterion()
    opt.zero_grad()
    with metrics.aggregate(new_root=True) as agg:
        for s in samples:
            task.train_step(s, model, criterion, opt, update_num=update_num)
        opt.all_reduce_grads(model)
        if overflow:
            opt.zero_grad()
        else:
            task.optimizer_step(opt, model, update_num)
    return agg


def test_agreeing_gradients_keep_the_term_and_grad_is_the_sum():
    model, task = TwoTermModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    agg = run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [1.0, 1.0]}])
    # g_ce = (1,0 | 1), g_con = (1,1 | 0): angle 60 deg -> kept
    torch.testing.assert_close(model.w.grad, torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(model.u.grad, torch.tensor([1.0]))
    assert agg.get_smoothed_value("acl_grad_angle") == pytest.approx(60.0, abs=0.05)
    assert agg.get_smoothed_value("acl_grad_drop") == 0.0


def test_conflicting_gradients_drop_the_term_and_grad_is_ce_only():
    model, task = TwoTermModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    agg = run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [-1.0, 0.2]}])
    torch.testing.assert_close(model.w.grad, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(model.u.grad, torch.tensor([1.0]))
    assert agg.get_smoothed_value("acl_grad_angle") > 90
    assert agg.get_smoothed_value("acl_grad_drop") == 1.0


def test_update_freq_decides_on_the_accumulated_gradients():
    # Micro-batch 1 alone conflicts (b=(-1,0) vs a=(1,0)); the decision is on the update's
    # sums, g_ce = (2,0|2). With b2=(3,3): g_con = (2,3|0), 67 degrees, kept. With b2=(0,3):
    # g_con = (-1,3|0), 103 degrees, dropped.
    model, task = TwoTermModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    run_update(
        task, model, opt, [{"a": [1.0, 0.0], "b": [-1.0, 0.0]}, {"a": [1.0, 0.0], "b": [3.0, 3.0]}]
    )
    torch.testing.assert_close(model.w.grad, torch.tensor([4.0, 3.0]))
    torch.testing.assert_close(model.u.grad, torch.tensor([2.0]))
    run_update(
        task, model, opt, [{"a": [1.0, 0.0], "b": [-1.0, 0.0]}, {"a": [1.0, 0.0], "b": [0.0, 3.0]}]
    )
    torch.testing.assert_close(model.w.grad, torch.tensor([2.0, 0.0]))


def test_loss_scaling_does_not_change_the_decision_and_grad_is_scaled():
    for scale in (1.0, 1024.0):
        model, task = TwoTermModel(), make_task()
        opt = PlainOptimizer(model.parameters(), loss_scale=scale)
        agg = run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [1.0, 1.0]}])
        torch.testing.assert_close(model.w.grad, scale * torch.tensor([2.0, 1.0]))
        assert agg.get_smoothed_value("acl_grad_angle") == pytest.approx(60.0, abs=0.05)


def test_overflow_does_not_enter_the_statistics_and_reaches_grad():
    model, task = TwoTermModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    agg = run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [float("inf"), 1.0]}])
    assert "acl_grad_angle" not in agg.keys()
    assert not torch.isfinite(model.w.grad).all()  # the trainer's overflow path sees it
    # the next update starts clean
    agg = run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [1.0, 1.0]}])
    torch.testing.assert_close(model.w.grad, torch.tensor([2.0, 1.0]))


def test_zero_grad_drops_a_half_accumulated_buffer():
    model, task = TwoTermModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    opt.zero_grad()
    task.train_step({"a": [1.0, 0.0], "b": [5.0, 5.0]}, model, TwoTermCriterion(), opt, 0)
    # e.g. an OOM: the trainer zeroes the gradients and starts the update again
    run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [1.0, 1.0]}])
    torch.testing.assert_close(model.w.grad, torch.tensor([2.0, 1.0]))


def test_angle_log_file(tmp_path):
    log = tmp_path / "angles.tsv"
    model, task = TwoTermModel(), make_task(log=str(log))
    opt = PlainOptimizer(model.parameters())
    run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [1.0, 1.0]}])
    run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [-1.0, 0.0]}])
    rows = read_angle_log(log)
    # second update: g_ce = (1,0|1), g_con = (-1,0|0) -> 135 degrees
    assert [r.angle for r in rows] == pytest.approx([60.0, 135.0], abs=1e-3)
    assert [r.kept for r in rows] == [True, False]


def test_one_decision_per_update_with_update_freq(tmp_path, monkeypatch):
    import acl_fairseq.acl_grad.step as unit

    decisions = []
    monkeypatch.setattr(unit, "decide", lambda *a: decisions.append(a) or decide(*a))
    log = tmp_path / "angles.tsv"
    model, task = TwoTermModel(), make_task(log=str(log))
    opt = PlainOptimizer(model.parameters())
    micro_batches = [{"a": [1.0, 0.0], "b": [1.0, 1.0]}, {"a": [0.0, 1.0], "b": [1.0, 0.0]}]
    for update in range(3):  # --update-freq 2: two train_steps, one all-reduce
        run_update(task, model, opt, micro_batches, update_num=update)
    assert len(decisions) == 3
    assert [r.update for r in read_angle_log(log)] == [0, 1, 2]
    # the decision is on the sums: g_ce = (1,1|2), g_con = (2,1|0)
    expected = math.degrees(math.acos(3 / (math.sqrt(6) * math.sqrt(5))))
    assert [r.angle for r in read_angle_log(log)] == pytest.approx([expected] * 3, abs=1e-3)


def test_all_reduce_of_another_module_is_an_error():
    model, task = TwoTermModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    opt.zero_grad()
    task.train_step({"a": [1.0, 0.0], "b": [1.0, 1.0]}, model, TwoTermCriterion(), opt, 0)
    with pytest.raises(RuntimeError, match="not on the model whose contrastive gradient"):
        opt.all_reduce_grads(torch.nn.Linear(2, 2))
    assert task.acl_grad.holds_contrastive_gradient  # nothing was decided or dropped
    # a new model on the same optimizer: the buffer and the wrapper move to it
    other = TwoTermModel()
    task.train_step({"a": [1.0, 0.0], "b": [1.0, 1.0]}, other, TwoTermCriterion(), opt, 0)
    with pytest.raises(RuntimeError, match="called on a TwoTermModel"):
        opt.all_reduce_grads(model)
    opt.all_reduce_grads(other)
    torch.testing.assert_close(other.w.grad, torch.tensor([2.0, 1.0]))
    assert not task.acl_grad.holds_contrastive_gradient


def test_the_criterions_own_all_reduce_passes_through():
    class ModuleCriterion(torch.nn.Module, TwoTermCriterion):
        pass

    model, task, criterion = TwoTermModel(), make_task(), ModuleCriterion()
    opt = PlainOptimizer(model.parameters())
    opt.zero_grad()
    task.train_step({"a": [1.0, 0.0], "b": [1.0, 1.0]}, model, criterion, opt, 0)
    opt.all_reduce_grads(model)
    opt.all_reduce_grads(criterion)  # fairseq's trainer does so for a criterion with parameters
    torch.testing.assert_close(model.w.grad, torch.tensor([2.0, 1.0]))


def test_criterion_without_terms_uses_fairseq_train_step():
    class PlainCriterion:
        def __call__(self, model, sample):
            return (torch.tensor(sample["a"]) * model.w).sum(), 1, {}

    model, task = TwoTermModel(), make_task()
    opt = PlainOptimizer(model.parameters())
    opt.zero_grad()
    task.train_step({"a": [3.0, 4.0]}, model, PlainCriterion(), opt, update_num=0)
    torch.testing.assert_close(model.w.grad, torch.tensor([3.0, 4.0]))
    assert AclGradOptimizer.of(opt) is None


def test_angle_log_reads_old_and_new_files(tmp_path):
    path = tmp_path / "angles.tsv"
    path.write_text(
        "0\t80.0000\t1\n1\t95.5000\t0\t70.0000\n2\t91.0000\t0\t60.0000\t1:88.5000\t3:90.2500\n\n"
    )
    old3, old4, new = read_angle_log(path)
    assert old3.update == 0 and old3.kept and math.isnan(old3.head_angle) and old3.top_angles == ()
    assert old4 == AngleRecord(1, 95.5, False, 70.0)
    assert new == AngleRecord(2, 91.0, False, 60.0, ((1, 88.5), (3, 90.25)))
    assert AngleRecord.from_line(new.to_line()) == new
    assert old4.to_line() == "1\t95.5000\t0\t70.0000\n"  # no top-K: the 4-column line
    with pytest.raises(ValueError, match="K:angle"):
        AngleRecord.from_line("0\t80.0\t1\t70.0\t88.5\n")
