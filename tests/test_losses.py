"""Contrastive losses against a naive, loop-based reference written from the formula."""

import math

import pytest
import torch

from acl_fairseq.criterions.losses import (
    acl_embed_loss,
    cross_layer_loss,
    self_distillation_loss,
    supcon_loss,
    supervised_contrastive_loss,
)


def naive_supcon(vectors, labels, tau):
    """Loop over anchors/positives/denominators, float64, no vectorisation."""
    v = [x.double() / x.double().norm() for x in vectors]
    labels = [int(y) for y in labels]
    losses = []
    for a in range(len(v)):
        positives = [p for p in range(len(v)) if p != a and labels[p] == labels[a]]
        if not positives:
            continue
        denom = sum(torch.exp(v[a] @ v[q] / tau) for q in range(len(v)) if q != a)
        terms = [torch.log(torch.exp(v[a] @ v[p] / tau) / denom) for p in positives]
        losses.append(-sum(terms) / len(positives))
    if not losses:
        return torch.zeros((), dtype=torch.float64)
    return sum(losses) / len(losses)


def naive_acl_embed(h, y, lab, tau):
    vectors = list(h) + list(lab)
    labels = list(y.tolist()) + list(range(lab.size(0)))
    return naive_supcon(vectors, labels, tau)


def naive_cross_layer(hs, ls, ht, lt, y, tau):
    vectors = list(hs) + list(ls) + list(ht) + list(lt)
    k = ls.size(0)
    labels = y.tolist() + list(range(k)) + y.tolist() + list(range(k))
    return naive_supcon(vectors, labels, tau)


@pytest.mark.parametrize("n,k,c,tau", [(8, 3, 5, 0.3), (13, 2, 16, 0.1), (5, 7, 4, 1.0)])
def test_supcon_matches_naive(n, k, c, tau):
    g = torch.Generator().manual_seed(n * 100 + k)
    x = torch.randn(n, c, generator=g)
    y = torch.randint(0, k, (n,), generator=g)
    assert supcon_loss(x, y, tau).item() == pytest.approx(naive_supcon(x, y, tau).item(), rel=1e-5)
    assert supervised_contrastive_loss(x, y, tau).item() == pytest.approx(
        naive_supcon(x, y, tau).item(), rel=1e-5
    )


def test_supcon_gradient_matches_naive():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 2])
    x1 = x.clone().requires_grad_(True)
    supcon_loss(x1, y, 0.2).backward()
    x2 = x.clone().requires_grad_(True)
    naive_supcon(x2, y, 0.2).backward()
    torch.testing.assert_close(x1.grad.double(), x2.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n,k", [(10, 2), (6, 5), (1, 3), (4, 1)])
def test_acl_embed_matches_naive_and_gradients(n, k):
    g = torch.Generator().manual_seed(10 * n + k)
    h = torch.randn(n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    lab = torch.randn(k, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, k, (n,), generator=g)
    ours = acl_embed_loss(h, y, lab, 0.3)
    ref = naive_acl_embed(h, y, lab, 0.3)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    gh, gl = torch.autograd.grad(ours, (h, lab))
    rh, rl = torch.autograd.grad(ref, (h, lab))
    torch.testing.assert_close(gh.double(), rh, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(gl.double(), rl, rtol=1e-4, atol=1e-7)


def test_acl_embed_batch_of_one_has_a_positive_but_scl_does_not():
    h = torch.randn(1, 4, requires_grad=True)
    lab = torch.randn(2, 4)
    y = torch.tensor([1])
    scl = supervised_contrastive_loss(h, y, 0.3)
    assert scl.item() == 0.0
    scl.backward()  # connected to the graph, zero gradient
    assert torch.count_nonzero(h.grad) == 0
    acl = acl_embed_loss(h, y, lab, 0.3)
    assert acl.item() > 0
    (gh,) = torch.autograd.grad(acl, h)
    assert torch.count_nonzero(gh) > 0


def test_single_class_batch():
    h = torch.randn(6, 4)
    y = torch.zeros(6, dtype=torch.long)
    lab = torch.randn(3, 4)
    # every sample is a positive of every other: loss is finite and matches the reference
    assert supcon_loss(h, y, 0.5).item() == pytest.approx(naive_supcon(h, y, 0.5).item(), rel=1e-5)
    assert acl_embed_loss(h, y, lab, 0.5).item() == pytest.approx(
        naive_acl_embed(h, y, lab, 0.5).item(), rel=1e-5
    )


def test_anchors_without_positive_are_excluded():
    # labels 0,0,1: the anchor of class 1 has no positive and must not enter the mean
    h = torch.randn(3, 5)
    y = torch.tensor([0, 0, 1])
    ours = supcon_loss(h, y, 0.3)
    ref = naive_supcon(h, y, 0.3)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)


def test_many_classes():
    g = torch.Generator().manual_seed(3)
    k = 300
    h = torch.randn(32, 24, generator=g)
    y = torch.randint(0, k, (32,), generator=g)
    lab = torch.randn(k, 24, generator=g)
    ours = acl_embed_loss(h, y, lab, 0.1)
    assert torch.isfinite(ours)
    assert ours.item() == pytest.approx(naive_acl_embed(h, y, lab, 0.1).item(), rel=1e-4)


def test_cross_layer_matches_naive_and_detaches_teacher():
    g = torch.Generator().manual_seed(5)
    n, k, c = 7, 3, 6
    hs = torch.randn(n, c, generator=g, requires_grad=True)
    ls = torch.randn(k, c, generator=g, requires_grad=True)
    ht = torch.randn(n, c, generator=g, requires_grad=True)
    lt = torch.randn(k, c, generator=g, requires_grad=True)
    y = torch.randint(0, k, (n,), generator=g)
    ours = cross_layer_loss(hs, ls, ht, lt, y, 0.2)
    ref = naive_cross_layer(hs, ls, ht, lt, y, 0.2)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    ours.backward()
    assert ht.grad is None and lt.grad is None
    assert hs.grad is not None and torch.count_nonzero(hs.grad) > 0
    assert ls.grad is not None and torch.count_nonzero(ls.grad) > 0


def test_low_temperature_and_degenerate_vectors_are_finite():
    y = torch.tensor([0, 1, 0, 1])
    same = torch.ones(4, 8)
    zero = torch.zeros(4, 8, requires_grad=True)
    lab = torch.randn(2, 8)
    for x in (same, zero):
        loss = acl_embed_loss(x, y, lab, 0.05)
        assert torch.isfinite(loss)
    loss = acl_embed_loss(zero, y, lab, 0.05)
    loss.backward()
    assert torch.isfinite(zero.grad).all()
    big = torch.randn(4, 8) * 1e4
    assert torch.isfinite(supcon_loss(big, y, 0.05))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_computed_in_float32(dtype):
    g = torch.Generator().manual_seed(7)
    h = torch.randn(16, 32, generator=g)
    y = torch.randint(0, 2, (16,), generator=g)
    lab = torch.randn(2, 32, generator=g)
    full = acl_embed_loss(h, y, lab, 0.05)
    half = acl_embed_loss(h.to(dtype), y, lab.to(dtype), 0.05)
    assert half.dtype == torch.float32 and torch.isfinite(half)
    assert half.item() == pytest.approx(full.item(), rel=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(acl_embed_loss(h, y, lab, 0.05))


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        supcon_loss(torch.randn(3, 2), torch.tensor([0, 1, 0]), 0.0)
    with pytest.raises(ValueError, match="A x C"):
        supcon_loss(torch.randn(3, 2), torch.tensor([0, 1]), 0.1)
    assert math.isfinite(supcon_loss(torch.randn(2, 2), torch.tensor([0, 0]), 0.1).item())


def naive_self_distillation(student, teacher, temperature):
    """T^2 * sum_n sum_k p_nk * (log p_nk - log q_nk), a loop over examples, float64."""
    total = torch.zeros((), dtype=torch.float64)
    for zs, zt in zip(student.double(), teacher.double()):
        p = torch.exp(zt / temperature) / torch.exp(zt / temperature).sum()
        q = torch.exp(zs / temperature) / torch.exp(zs / temperature).sum()
        total = total + sum(p[k] * (torch.log(p[k]) - torch.log(q[k])) for k in range(len(p)))
    return temperature**2 * total


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_self_distillation_against_naive(temperature):
    g = torch.Generator().manual_seed(11)
    student = torch.randn(5, 3, generator=g) * 2
    teacher = torch.randn(5, 3, generator=g) * 2
    loss = self_distillation_loss(student, teacher, temperature)
    ref = naive_self_distillation(student, teacher, temperature)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert self_distillation_loss(teacher, teacher, temperature).item() == pytest.approx(
        0.0, abs=1e-6
    )


def test_self_distillation_teacher_gets_no_gradient():
    student = torch.randn(4, 2, requires_grad=True)
    teacher = torch.randn(4, 2, requires_grad=True)
    self_distillation_loss(student, teacher, 2.0).backward()
    assert teacher.grad is None
    assert torch.count_nonzero(student.grad) > 0


def test_self_distillation_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        self_distillation_loss(torch.randn(3, 2), torch.randn(3, 2), 0.0)
    with pytest.raises(ValueError, match="N x K of one shape"):
        self_distillation_loss(torch.randn(3, 2), torch.randn(3, 3), 1.0)
