"""What the multi-exit model returns: one exit's output, and an early-exit prediction.

Their own module, so the model and its hub interface both import them without importing
each other.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["EarlyExitResult", "ExitOutput"]


class ExitOutput(NamedTuple):
    """One exit's output for a batch of B examples, K classes, feature size C."""

    layer: int  # 1-based encoder layer the exit sits on
    logits: Tensor  # B x K
    features: Tensor  # B x C, the input of the head's out_proj (after dense, act, dropout)
    label_embeddings: Tensor  # K x C, the head's out_proj.weight


class EarlyExitResult(NamedTuple):
    """Result of ``MultiExitRobertaModel.early_exit`` for B examples, K classes."""

    predictions: Tensor  # B, long: argmax of the exit's logits
    exit_layers: Tensor  # B, long: 1-based layer of the exit each example left at
    logits: Tensor  # B x K: logits of that exit
    labels: list[str] | None = None  # B label names (the hub's ``predict_early_exit``)
