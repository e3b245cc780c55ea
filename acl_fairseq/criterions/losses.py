"""Contrastive losses of ACL and the exits' self-distillation, in pure torch (no fairseq import).

N samples, K classes, C features. ``features``: the pooled ``h`` that a classifier's
``out_proj`` consumes; ``label_embeddings``: the rows ``l_k`` of ``out_proj.weight`` (CE
logits are ``h . l_k + b_k``: one space). Computed in float32, also under autocast, with
log-sum-exp, so small temperatures stay finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "supcon_loss",
    "acl_embed_loss",
    "supervised_contrastive_loss",
    "cross_layer_loss",
    "self_distillation_loss",
]


def supcon_loss(vectors: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, "L_out") over one labelled set.

    For every anchor ``a`` with positives ``P(a) = {p != a, y_p = y_a}``::

        L_a = -1/|P(a)| * sum_{p in P(a)} log( exp(a.p/tau) / sum_{q != a} exp(a.q/tau) )

    averaged over the anchors with a positive (none: 0, still in the graph). ``vectors``:
    A x C (normalised here), ``labels``: A; a float32 scalar.
    """
    if vectors.dim() != 2 or labels.dim() != 1 or labels.size(0) != vectors.size(0):
        raise ValueError(
            f"supcon_loss expects vectors A x C and labels A, got {tuple(vectors.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = F.normalize(vectors.float(), dim=-1)
    # autocast would run the matmul in fp16/bf16 (e.g. CPU bf16 autocast): keep float32
    with torch.autocast(device_type=z.device.type, enabled=False):
        logits = (z @ z.t()) / temperature  # A x A
    n = z.size(0)
    self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)  # diag is -inf
    positives = (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~self_mask
    num_pos = positives.sum(dim=1)
    # zero the -inf diagonal (never a positive) before the masked sum, so no 0 * inf = nan
    pos_log_prob = log_prob.masked_fill(~positives, 0.0).sum(dim=1)
    has_pos = num_pos > 0
    if not bool(has_pos.any()):
        return z.sum() * 0.0
    per_anchor = -pos_log_prob[has_pos] / num_pos[has_pos]
    return per_anchor.mean()


def supervised_contrastive_loss(features: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """The CE+SCL baseline's term (Gunel et al. 2021): SupCon over the N samples alone
    (``features`` N x C, ``labels`` N)."""
    return supcon_loss(features, labels, temperature)


def _label_ids(num_classes: int, like: Tensor) -> Tensor:
    return torch.arange(num_classes, device=like.device, dtype=like.dtype)


def acl_embed_loss(
    features: Tensor, labels: Tensor, label_embeddings: Tensor, temperature: float
) -> Tensor:
    """ACL-Embed: SupCon over the N samples (``features`` N x C, ``labels`` N) plus the K
    label embeddings (K x C), each a sample of its class: every sample has a positive, at
    any batch size."""
    vectors = torch.cat([features, label_embeddings.to(features.dtype)], dim=0)
    all_labels = torch.cat([labels, _label_ids(label_embeddings.size(0), labels)])
    return supcon_loss(vectors, all_labels, temperature)


def cross_layer_loss(
    student_features: Tensor,
    student_label_embeddings: Tensor,
    teacher_features: Tensor,
    teacher_label_embeddings: Tensor,
    labels: Tensor,
    temperature: float,
) -> Tensor:
    """ACL-CL: SupCon over a shallow exit's and the last exit's features (N x C) and label
    embeddings (K x C), 2N + 2K vectors; the teacher's are detached, so only the student
    learns."""
    dtype = student_features.dtype
    vectors = torch.cat(
        [
            student_features,
            student_label_embeddings.to(dtype),
            teacher_features.detach().to(dtype),
            teacher_label_embeddings.detach().to(dtype),
        ],
        dim=0,
    )
    class_ids = _label_ids(student_label_embeddings.size(0), labels)
    all_labels = torch.cat([labels, class_ids, labels, class_ids])
    return supcon_loss(vectors, all_labels, temperature)


def self_distillation_loss(
    student_logits: Tensor, teacher_logits: Tensor, temperature: float
) -> Tensor:
    """FastBERT's self-distillation of one exit, summed over the batch::

        sum_n T^2 * KL( softmax(teacher_n / T) || softmax(student_n / T) )

    ``student_logits`` and ``teacher_logits``: N x K; the teacher is detached, so only the
    student learns. A float32 scalar (0 for N = 0, still in the graph).
    """
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(
            f"self_distillation_loss expects student and teacher logits N x K of one shape, got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    kl = F.kl_div(log_q, log_p, reduction="sum", log_target=True)
    return temperature**2 * kl
