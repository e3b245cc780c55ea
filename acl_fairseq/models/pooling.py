"""Mean pooling over the real tokens: the one implementation the exit heads (training and
full-depth forward) and the early-exit loop both use, so that they give the same numbers.

Pure tensor math (no fairseq import).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MeanWeights", "masked_mean", "row_mean"]


class MeanWeights:
    """The weights of a masked mean, computed once per batch.

    ``keep`` (B x T x 1 float32, 1 at real tokens) and ``count`` (B x 1, real tokens per row,
    at least 1). ``has_pads=False`` says that no position is padding: ``masked_mean`` then
    skips the multiply by 1 (exact: ``v * 1 = v``, and the sum runs over the same values).
    """

    def __init__(self, padding_mask: Tensor, has_pads: bool = True) -> None:
        """``padding_mask``: B x T bool, True at padding."""
        self.keep = (~padding_mask).unsqueeze(-1).float()  # B x T x 1
        self.count = self.keep.sum(dim=1).clamp(min=1.0)  # B x 1
        self.has_pads = has_pads

    def select(self, rows: Tensor, width: int) -> None:
        """Keeps ``rows`` (B' indices) and the first ``width`` positions (early-exit loop)."""
        self.keep = self.keep.index_select(0, rows)[:, :width]
        self.count = self.count.index_select(0, rows)


def masked_mean(features: Tensor, weights: MeanWeights) -> Tensor:
    """B x T x C features -> B x C mean over the real tokens, computed in float32 and
    returned in the features' dtype (half-precision sums would lose the small tokens)."""
    dtype = features.dtype
    if dtype != torch.float32:
        features = features.float()
    if weights.has_pads:
        summed = (features * weights.keep).sum(dim=1)
    else:
        summed = features.sum(dim=1)
    pooled = summed / weights.count
    return pooled if dtype == torch.float32 else pooled.to(dtype)


def row_mean(x: Tensor, count: Tensor) -> Tensor:
    """T x 1 x C hidden states of one unpadded row -> 1 x C: ``masked_mean``'s numbers without
    its transpose and weights (the batch-1 path); ``count``: the row's length, 1 x 1 float32."""
    dtype = x.dtype
    pooled = (x if dtype == torch.float32 else x.float()).sum(dim=0) / count
    return pooled if dtype == torch.float32 else pooled.to(dtype)
