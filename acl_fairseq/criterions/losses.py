"""Contrastive losses of ACL, in pure torch (no fairseq import).

Notation: N samples in a batch, K classes, C feature size. ``features`` are the pooled
vectors ``h`` that a classifier's ``out_proj`` consumes; ``label_embeddings`` are the rows
``l_k`` of ``out_proj.weight``, so CE logits are ``h . l_k + b_k`` and both live in one space.

All losses are computed in float32 (also under fp16/bf16 autocast): vectors are
L2-normalised, similarities divided by the temperature, and the log-softmax uses
log-sum-exp, so a temperature of 0.05 stays finite.
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
]


def supcon_loss(vectors: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, "L_out") over one labelled set.

    For every anchor ``a`` with positives ``P(a) = {p != a, y_p = y_a}``::

        L_a = -1/|P(a)| * sum_{p in P(a)} log( exp(a.p/tau) / sum_{q != a} exp(a.q/tau) )

    and the loss is the mean of ``L_a`` over the anchors that have at least one positive.
    Anchors without a positive contribute nothing; if no anchor has one, the loss is 0
    (still connected to the graph, so ``backward`` works and gives zero gradients).

    Args:
        vectors: A x C, not necessarily normalised (normalised here).
        labels: A, integer labels.
        temperature: tau > 0.
    Returns:
        scalar float32 tensor.
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
    """The CE+SCL baseline's term (Gunel et al. 2021): SupCon over the N samples alone.

    Args:
        features: N x C pooled features.
        labels: N.
    """
    return supcon_loss(features, labels, temperature)


def _label_ids(num_classes: int, like: Tensor) -> Tensor:
    return torch.arange(num_classes, device=like.device, dtype=like.dtype)


def acl_embed_loss(
    features: Tensor, labels: Tensor, label_embeddings: Tensor, temperature: float
) -> Tensor:
    """ACL-Embed: SupCon over the N samples plus the K label embeddings (N + K vectors).

    Label embedding ``k`` is a sample of class ``k``, so every sample has a positive (its
    label embedding), also at batch size 1 or with a single class in the batch.

    Args:
        features: N x C pooled features.
        labels: N, values in [0, K).
        label_embeddings: K x C (the classifier's ``out_proj.weight``).
    """
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
    """ACL-CL: SupCon over a shallow exit's and the last exit's samples and labels.

    The set is ``{h^m_i} + {l^m_k} + {h^M_i} + {l^M_k}`` (2N + 2K vectors); teacher vectors
    are detached here, so only the student (shallow exit) receives gradients.

    Args:
        student_features, teacher_features: N x C.
        student_label_embeddings, teacher_label_embeddings: K x C.
        labels: N.
    """
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
