"""The early-exit loop of ``MultiExitRobertaModel.early_exit``: one batched loop, batch 1 included.

It mirrors ``TransformerEncoder.forward`` layer by layer and keeps the work per layer small:

* only the exits the policy decides at (``ExitPolicy.exits``: every shallow exit, or a per-exit
  policy's own) are evaluated: the other heads do not run;
* a policy that can never let a row out before the last exit (``ExitPolicy.never_exits``:
  ``entropy:0``, a patience of at least the number of shallow exits) runs the plain
  full-depth forward: no exit head is evaluated;
* an exit's logits come from its head (``pool`` then ``classify``, as in training) on what the
  exit sees (``model.exit_hidden``); with ``first`` pooling only the first position is
  layer-normed (the same numbers as normalising every position and pooling afterwards);
* each exit's logits go to the host (one sync per exit), where the policy's rule decides
  (``portable.decide``, the one decision every loop runs) and the row bookkeeping runs
  (``portable.rows.RunningRows``, shared with the ONNX Runtime loop and the bundle); the kept
  rows' indices come back as a tensor and the batch is compacted only when some row leaves;
* one unpadded row (batch 1) takes ``torch_row.run_single_row``: four or five tensor ops
  per exit instead of about twenty, the same decision;
* ``mean`` pooling uses weights computed once (``pooling.MeanWeights``).

Results equal the per-example and full-depth runs (the tests check both).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..early_exit.policies import ExitPolicy
from ..models.pooling import MeanWeights
from ..portable.rows import RunningRows
from .rows import EarlyExitResult, host_decider, to_torch
from .torch_row import run_single_row

__all__ = ["run_early_exit"]


def _exit_logits(model: Any, head: Any, x: Tensor, mean: MeanWeights | None) -> Tensor:
    """Logits (B x K) of the exit ``head`` on the hidden states ``x`` (T x B x C) after its
    layer. ``first`` pooling reads position 0 only, so only it goes through ``exit_hidden``
    (a per-position layer norm); ``mean`` pooling uses the precomputed ``mean`` weights."""
    if head.pooling == "first":
        x = x[:1]
    features = model.exit_hidden(x).transpose(0, 1)  # B x T' x C
    return head.classify(head.pool(features, weights=mean))[0]


def _run_layer(layer: Any, x: Tensor, padding_mask: Tensor | None) -> Tensor:
    """One encoder layer on ``x`` (T x B x C); fairseq layers return ``(x, attn)`` or ``x``."""
    out = layer(x, encoder_padding_mask=padding_mask)
    return out[0] if isinstance(out, tuple) and len(out) == 2 else out


def run_early_exit(
    model: Any, src_tokens: Tensor, policy: ExitPolicy, head_name: str, single_row: bool = True
) -> EarlyExitResult:
    """Batched early exit of ``model`` (a ``MultiExitRobertaModel`` in eval mode).

    Args:
        src_tokens: B x T token ids.
        policy: the exit policy (``ValueError`` when it names an exit the model lacks).
        head_name: the head group.
        single_row: one unpadded row takes the batch-1 path (``torch_row``); False runs
            the general loop (the reference the tests compare it with).
    Returns:
        ``EarlyExitResult(predictions B, exit_layers B, logits B x K)``.
    """
    num_layers = int(model.num_layers)
    used = set(policy.exits(model.shallow_exit_layers))  # the policy's skip list
    heads = {
        layer: head
        for layer, head in model.exit_heads(head_name)
        if layer in used or layer == num_layers
    }
    bsz, device = src_tokens.size(0), src_tokens.device
    if policy.never_exits(len(heads) - 1):
        logits = model(src_tokens, classification_head_name=head_name)[0]
        layers = torch.full((bsz,), num_layers, dtype=torch.long, device=device)
        return EarlyExitResult(logits.argmax(dim=-1), layers, logits)

    encoder = model.encoder.sentence_encoder
    padding_mask = model.padding_mask(src_tokens)  # B x T
    has_pads = bool(padding_mask.any())  # one host sync here
    if single_row and bsz == 1 and not has_pads and not model.training:
        return run_single_row(model, src_tokens, policy, heads)
    x, _ = encoder.forward_embedding(src_tokens)  # B x T x C
    if has_pads:  # the encoder multiplies by 1 when there is no padding: skip that
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
    x = x.transpose(0, 1)  # T x B x C

    uses_mean = any(head.pooling == "mean" for head in heads.values())
    mean = MeanWeights(padding_mask, has_pads) if uses_mean else None
    running = RunningRows(host_decider(policy, device), padding_mask.cpu().numpy(), num_layers)
    mask = padding_mask  # the running rows' padding, on the device
    for layer_idx, layer in enumerate(encoder.layers, start=1):
        x = _run_layer(layer, x, mask if running.has_pads else None)
        if layer_idx not in heads:
            continue
        logits = _exit_logits(model, heads[layer_idx], x, mean)
        keep = running.at_exit(layer_idx, logits.detach().float().cpu().numpy())
        if running.done:
            break
        if keep is not None:  # some rows left: keep the others (and their width)
            rows = torch.from_numpy(keep).to(device)
            x = x.index_select(1, rows)
            if running.width < x.size(0):
                x = x[: running.width]
            mask = torch.from_numpy(running.padding_mask).to(device)
            if mean is not None:
                mean.select(rows, x.size(0))
    return to_torch(running.result(), device)
