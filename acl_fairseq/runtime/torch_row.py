"""The batch-1 path of the early-exit loop: one unpadded row, as few tensor ops per exit as the
same numbers allow (docs/results.md, "What the exits cost at batch 1").

At batch 1 an exit's cost is not its arithmetic but the fixed cost of each tensor op run right
after a layer (its code and the head's weights pushed out of the caches by the layer). The
general loop spends about twenty ops per exit (slicing, a transpose, pooling, two dropouts, the
head's three, the policy's rule, the host sync); this path spends four or five:

* the head: ``first`` pooling reads position 0 of the running row (``x.select(0, 0)``, then
  ``exit_hidden``: the final layer norm of a pre-norm model), ``mean`` pooling sums the row's
  positions and divides by their count (``pooling.row_mean``, ``masked_mean``'s numbers); then
  ``dense``, activation, ``out_proj`` (their ``forward`` when no hook is set; a ``linear`` head
  has ``out_proj`` only); dropout is the identity in eval mode;
* the decision: the logits come to the host once (one sync per exit) and the policy's rule
  decides there (``portable.decide``, the one decision of every loop); a kind without a rule
  decides on the tensor (``rows.TensorDecider``).

Logits, exits and predictions equal the general loop's bit for bit (the tests compare both on
every kind and precision).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..early_exit.policies import ExitPolicy
from ..models.pooling import row_mean
from .rows import EarlyExitResult, host_decider

__all__ = ["run_single_row"]


def _hooks_anywhere() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _forward(module: Any, hooks: bool) -> Any:
    """``module.forward`` when no hook is registered on it or globally (``hooks``), else the
    module itself (its hooks run)."""
    if hooks or module._forward_hooks or module._forward_pre_hooks:
        return module
    return module.forward


def _row_head(
    model: Any, head: Any, hooks: bool, count: Tensor | None
) -> Callable[[Tensor], Tensor]:
    """``x`` (T x 1 x C, the running row's hidden states) -> logits (1 x K) of ``head`` in eval
    mode: the numbers of ``pool`` then ``classify`` (a linear head's ``dense`` and activation
    are the identity); ``count``: the row's length (1 x 1), for ``mean`` pooling."""
    dense, out_proj = _forward(head.dense, hooks), _forward(head.out_proj, hooks)
    activation, exit_hidden = head.activation_fn, model.exit_hidden
    if head.pooling == "first":
        return lambda x: out_proj(activation(dense(exit_hidden(x.select(0, 0)))))
    return lambda x: out_proj(activation(dense(row_mean(exit_hidden(x), count))))


def run_single_row(
    model: Any,
    src_tokens: Tensor,
    policy: ExitPolicy,
    heads: dict[int, Any],
) -> EarlyExitResult:
    """Early exit of one unpadded row (``src_tokens``: 1 x T); ``heads``: ``{layer: head}`` of
    the exits to evaluate, the last layer's included."""
    num_layers = int(model.num_layers)
    encoder = model.encoder.sentence_encoder
    device = src_tokens.device
    x, _ = encoder.forward_embedding(src_tokens)
    x = x.transpose(0, 1)  # T x 1 x C
    count = None  # the row's length, as MeanWeights has it, for mean pooling
    if any(head.pooling == "mean" for head in heads.values()):
        count = torch.full((1, 1), float(max(1, src_tokens.size(1))), device=device)
    hooks = _hooks_anywhere()
    row_heads = {layer: _row_head(model, head, hooks, count) for layer, head in heads.items()}
    decider = host_decider(policy, device)
    state = decider.init_state(1)
    logits, exit_layer = None, num_layers
    for layer_idx, layer in enumerate(encoder.layers, start=1):
        out = layer(x, encoder_padding_mask=None)
        x = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        if layer_idx not in heads:
            continue
        logits = row_heads[layer_idx](x)
        if layer_idx == num_layers:
            break
        leave, state = decider.decide(logits.detach().float().cpu().numpy(), state)
        if leave[0]:
            exit_layer = layer_idx
            break
    assert logits is not None  # the last layer always has an exit
    layers = torch.full((1,), exit_layer, dtype=torch.long, device=device)
    return EarlyExitResult(logits.argmax(dim=-1), layers, logits)
