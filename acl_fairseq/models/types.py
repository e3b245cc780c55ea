"""What the multi-exit model returns in training: one exit's output.

Its own module, so the model and the criterions import it without importing each other. The
early-exit result is the runtime's (``acl_fairseq.runtime.rows.EarlyExitResult``).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["ExitOutput"]


class ExitOutput(NamedTuple):
    """One exit's output for a batch of B examples, K classes, feature size C."""

    layer: int  # 1-based encoder layer the exit sits on
    logits: Tensor  # B x K
    features: Tensor  # B x C, the input of the head's out_proj (after dense, act, dropout)
    label_embeddings: Tensor  # K x C, the head's out_proj.weight
