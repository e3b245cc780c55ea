"""``--freeze-backbone``: only the shallow exits' heads train; the rest runs once per sentence.

The frozen part (embeddings, transformer layers, the final exit and any other head group)
stays in eval mode whatever ``model.train()`` says, and runs without gradients: it is a fixed
function of the tokens, with or without caching (dropout in it would only add noise to inputs
that the heads are meant to fit). The shallow heads keep their own dropout. During
``fairseq-train`` (the task turns it on, ``use_frozen_cache``) what the frozen part gives the
exits is cached per sentence (``frozen_cache``), so that later epochs and validations run the
heads alone; loading weights clears the cache. Mixed into ``MultiExitRobertaModel``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from ..errors import AclValueError
from .frozen_cache import FrozenExitCache, FrozenInputs
from .heads import DEFAULT_HEAD
from .pooling import MeanWeights
from .types import ExitOutput

__all__ = ["DEFAULT_CACHE_MB", "FrozenBackboneMixin", "frozen_inputs"]

logger = logging.getLogger(__name__)

DEFAULT_CACHE_MB = 1024
"""``--freeze-backbone-cache-mb``'s default: rows x exits x C floats fit it for most data sets."""


def frozen_inputs(model: Any, src_tokens: Tensor, heads: list[tuple[int, Any]]) -> FrozenInputs:
    """What the frozen backbone gives the exits ``heads`` (``exit_heads``' list, the final
    last) for B x T ``src_tokens``: one encoder pass without gradients."""
    with torch.no_grad():
        features, extra = model.encoder(src_tokens, features_only=True, return_all_hiddens=True)
        inner_states = extra["inner_states"]  # L+1 tensors T x B x C
        padding_mask = model.padding_mask(src_tokens)
        weights = MeanWeights(padding_mask)
        pooled = [
            head.pool(model.exit_hidden(inner_states[layer]).transpose(0, 1), weights=weights)
            for layer, head in heads[:-1]
        ]
        logits, final_features = heads[-1][1].forward_with_features(features, padding_mask)
    return FrozenInputs(torch.stack(pooled, dim=1), logits, final_features)


class FrozenBackboneMixin:
    """``freeze_backbone``, the eval-mode frozen part, and the per-sentence cache."""

    frozen_group: str | None = None  # the head group whose shallow exits train
    frozen_cache: FrozenExitCache | None = None

    def freeze_backbone(self, name: str = DEFAULT_HEAD) -> None:
        """Leaves only the shallow exit heads of group ``name`` trainable; the rest in eval mode."""
        if not self.shallow_exit_layers:
            raise AclValueError(
                "--freeze-backbone leaves nothing to train: the model has no shallow exits "
                "(--exit-layers none)"
            )
        self.requires_grad_(False)
        for _layer, head in self.exit_heads(name)[:-1]:
            head.requires_grad_(True)
        self.frozen_group = name
        self.train(self.training)

    def train(self, mode: bool = True):
        """``nn.Module.train``; with a frozen backbone, all but the trainable heads stay in eval."""
        super().train(mode)
        if mode and self.frozen_group is not None:
            trainable = {id(head) for _, head in self.exit_heads(self.frozen_group)[:-1]}
            self.encoder.train(False)
            for head in self.classification_heads.values():
                if id(head) not in trainable:
                    head.train(False)
        return self

    def use_frozen_cache(self) -> bool:
        """Caches the frozen part's outputs per sentence from now on, when the backbone is
        frozen and ``--freeze-backbone-cache-mb`` is > 0 (``fairseq-train``: the task calls it);
        whether it does."""
        megabytes = float(getattr(self.args, "freeze_backbone_cache_mb", DEFAULT_CACHE_MB))
        if megabytes < 0:
            raise AclValueError(
                f"--freeze-backbone-cache-mb must be >= 0 (0: no cache), got {megabytes:g}"
            )
        if self.frozen_group is None or megabytes == 0:
            self.frozen_cache = None
            return False
        self.frozen_cache = FrozenExitCache(int(megabytes * 2**20))
        logger.info(
            f"--freeze-backbone: the frozen part runs once per sentence, its outputs cached "
            f"(up to {megabytes:g} MB, --freeze-backbone-cache-mb)"
        )
        return True

    def load_state_dict(self, state_dict, *args: Any, **kwargs: Any):
        """The model's own ``load_state_dict``; new weights, so an empty cache."""
        if self.frozen_cache is not None:
            self.frozen_cache.clear()
        return super().load_state_dict(state_dict, *args, **kwargs)

    def cached_exit_outputs(self, src_tokens: Tensor, name: str) -> list[ExitOutput] | None:
        """``exit_outputs`` from the cache (None when it does not apply: no cache, another
        head group, or a frozen parameter that trains after all)."""
        if self.frozen_cache is None or name != self.frozen_group:
            return None
        heads = self.exit_heads(name)
        if any(p.requires_grad for p in self.encoder.parameters()) or any(
            p.requires_grad for p in heads[-1][1].parameters()
        ):
            return None
        padding_idx = self.encoder.sentence_encoder.padding_idx
        inputs = self.frozen_cache.get(
            src_tokens, padding_idx, lambda rows: frozen_inputs(self, rows, heads)
        )
        outputs = []
        for e, (layer, head) in enumerate(heads[:-1]):
            logits, features = head.classify(inputs.pooled[:, e])
            outputs.append(ExitOutput(layer, logits, features, head.out_proj.weight))
        layer, final = heads[-1]
        outputs.append(
            ExitOutput(layer, inputs.final_logits, inputs.final_features, final.out_proj.weight)
        )
        return outputs
