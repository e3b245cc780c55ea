"""What the multi-exit model returns: one exit's output, and an early-exit prediction.

Their own module, so the model and its hub interface both import them without importing
each other. ``EarlyExitResult`` is defined with the loop's row bookkeeping
(``early_exit.running_rows``), which the ONNX Runtime backend shares.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ..early_exit.running_rows import EarlyExitResult

__all__ = ["EarlyExitResult", "ExitOutput"]


class ExitOutput(NamedTuple):
    """One exit's output for a batch of B examples, K classes, feature size C."""

    layer: int  # 1-based encoder layer the exit sits on
    logits: Tensor  # B x K
    features: Tensor  # B x C, the input of the head's out_proj (after dense, act, dropout)
    label_embeddings: Tensor  # K x C, the head's out_proj.weight
