"""The exit head: ``RobertaClassificationHead`` with a pooling choice, and the head names.

An exit head pools the hidden states it sees (``pool``) and classifies the pooled features
(``classify``: dropout, dense, activation, dropout, ``out_proj``). Training
(``forward_with_features``) and the early-exit loop both go through these two methods. A
``linear`` head (``--exit-head linear``, shallow exits only) has no ``dense`` layer and no
activation: ``out_proj`` reads the pooled features, which at batch 1 is most of an exit's cost
saved (docs/results.md).
"""

from __future__ import annotations

from typing import Any

from fairseq.models.roberta.model import RobertaClassificationHead
from torch import Tensor, nn

from ..errors import AclValueError
from .pooling import MeanWeights, masked_mean

__all__ = [
    "DEFAULT_HEAD",
    "EXIT_HEAD_CHOICES",
    "POOLING_CHOICES",
    "MultiExitClassificationHead",
    "exit_head_name",
    "head_kind_of",
]

DEFAULT_HEAD = "sentence_classification_head"
"""fairseq's ``sentence_prediction`` head name (``--classification-head-name``)."""
POOLING_CHOICES = ("first", "mean")
EXIT_HEAD_CHOICES = ("mlp", "linear")
"""``--exit-head``: RoBERTa's head (dense, activation, ``out_proj``) or ``out_proj`` alone."""


def exit_head_name(name: str, layer: int) -> str:
    """Name of the shallow exit head at ``layer`` for the head group ``name``."""
    return f"{name}_exit{layer}"


def _identity(x: Tensor) -> Tensor:
    return x


class MultiExitClassificationHead(RobertaClassificationHead):
    """``RobertaClassificationHead`` with a pooling choice and a padding mask.

    Same parameters (``dense``, ``out_proj``); with ``pooling="first"`` the output is
    bit-identical to ``RobertaClassificationHead``. ``"mean"`` averages non-pad positions.
    ``kind="linear"``: ``dense`` is the identity and there is no activation (``out_proj`` is
    C_in x K, its only parameters).
    """

    def __init__(
        self, *args: Any, pooling: str = "first", kind: str = "mlp", **kwargs: Any
    ) -> None:
        if kind not in EXIT_HEAD_CHOICES:
            raise AclValueError(f"--exit-head must be one of {EXIT_HEAD_CHOICES}, got {kind!r}")
        if kind == "linear":  # out_proj reads the pooled features: input_dim wide
            kwargs["inner_dim"] = kwargs.get("input_dim", args[0] if args else None)
        super().__init__(*args, **kwargs)
        if pooling not in POOLING_CHOICES:
            raise AclValueError(f"--exit-pooling must be one of {POOLING_CHOICES}, got {pooling!r}")
        self.pooling, self.kind = pooling, kind
        if kind == "linear":
            self.dense = nn.Identity()
            self.activation_fn = _identity

    def pool(
        self,
        features: Tensor,
        padding_mask: Tensor | None = None,
        weights: MeanWeights | None = None,
    ) -> Tensor:
        """B x T x C features -> B x C.

        ``mean`` pooling averages the real tokens: ``weights`` (computed once per batch) or
        the B x T bool ``padding_mask`` (True = pad); with neither, every position.
        """
        if self.pooling == "first":
            return features[:, 0, :]  # <s> token (equiv. to [CLS])
        if weights is None and padding_mask is not None:
            weights = MeanWeights(padding_mask)
        if weights is None:
            return features.mean(dim=1)
        return masked_mean(features, weights)

    def classify(self, pooled: Tensor) -> tuple[Tensor, Tensor]:
        """Pooled features B x C -> (logits B x K, out_proj input B x C')."""
        x = self.dropout(pooled)
        x = self.dense(x)
        x = self.activation_fn(x)
        x = self.dropout(x)
        return self.out_proj(x), x

    def forward_with_features(
        self, features: Tensor, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """B x T x C -> (logits B x K, out_proj input B x C')."""
        return self.classify(self.pool(features, padding_mask))

    def forward(self, features: Tensor, padding_mask: Tensor | None = None, **kwargs: Any):
        """B x T x C -> logits B x K."""
        return self.forward_with_features(features, padding_mask)[0]


def head_kind_of(keys: Any, prefix: str) -> str:
    """The kind of the head whose state-dict ``keys`` start with ``prefix`` (``NAME.``):
    ``mlp`` when it has a ``dense`` layer, else ``linear``."""
    return "mlp" if f"{prefix}dense.weight" in keys else "linear"
