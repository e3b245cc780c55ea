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
* the policy decides on the device (``ExitPolicy.decide``, the one rule of each policy); one
  host sync per shallow exit (does any row leave?) and, only where some row leaves and more
  than one row runs, a second one (how many rows stay and, with padding, the new width): the
  kept rows are found with a stable sort of the exit mask (no ``nonzero``), the leaving rows'
  logits are written with ``index_copy_`` on the running rows (rows that stay are overwritten
  at their own exit later), and the batch is compacted only when some row leaves;
* one unpadded row (batch 1) takes ``early_exit_row.run_single_row``: four or five tensor ops
  per exit instead of about twenty, the built-in kinds deciding on the host (the same
  numbers); a single running row of a batch stops at its exit with no row bookkeeping;
* the padding bookkeeping uses per-row lengths computed once (no padding mask recomputed),
  and ``mean`` pooling uses weights computed once (``pooling.MeanWeights``).

Results equal the per-example and full-depth runs (the tests check both).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..early_exit.policies import ExitPolicy
from .early_exit_row import run_single_row
from .pooling import MeanWeights
from .types import EarlyExitResult

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
        single_row: one unpadded row takes the batch-1 path (``early_exit_row``); False runs
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
        return run_single_row(model, src_tokens, policy, heads, _exit_logits)
    x, _ = encoder.forward_embedding(src_tokens)  # B x T x C
    if has_pads:  # the encoder multiplies by 1 when there is no padding: skip that
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
    x = x.transpose(0, 1)  # T x B x C

    nonpad = ~padding_mask
    # per row: number of real tokens and 1 + position of the last one (for trimming)
    counts = nonpad.sum(dim=1)
    positions = torch.arange(1, src_tokens.size(1) + 1, device=device)
    ends = (nonpad * positions).amax(dim=1) if src_tokens.size(1) > 0 else counts
    uses_mean = any(head.pooling == "mean" for head in heads.values())
    mean = MeanWeights(padding_mask, has_pads) if uses_mean else None
    rows = torch.arange(bsz, device=device)  # original index of each running row
    state = policy.init_state(bsz, device)
    exit_layers = torch.full((bsz,), num_layers, dtype=torch.long, device=device)
    all_logits: Tensor | None = None

    for layer_idx, layer in enumerate(encoder.layers, start=1):
        x = _run_layer(layer, x, padding_mask if has_pads else None)
        if layer_idx not in heads:
            continue
        logits = _exit_logits(model, heads[layer_idx], x, mean)  # B' x K
        if all_logits is None:
            all_logits = logits.new_zeros(bsz, logits.size(-1))
        if layer_idx == num_layers:  # every running row exits at the last layer
            all_logits.index_copy_(0, rows, logits)
            exit_layers.index_fill_(0, rows, num_layers)
            break
        exit_mask, state = policy.decide(logits, state)
        if not bool(exit_mask.any()):  # one host sync; nobody leaves here
            continue
        if x.size(1) == 1:  # a single running row leaves: no row bookkeeping
            all_logits.index_copy_(0, rows, logits)
            exit_layers.index_fill_(0, rows, layer_idx)
            break
        stay = ~exit_mask
        if has_pads:  # kept rows, their widest end and fewest real tokens: one sync
            big = torch.iinfo(counts.dtype).max
            stats = torch.stack(
                [
                    stay.sum(),
                    torch.where(stay, ends, 0).amax(),
                    torch.where(stay, counts, big).amin(),
                ]
            ).tolist()
            kept, width, fewest = (int(v) for v in stats)
        else:
            kept = int(stay.sum())
        all_logits.index_copy_(0, rows, logits)  # rows that stay are overwritten later
        exit_layers.index_fill_(0, rows, layer_idx)  # likewise
        if kept == 0:
            break
        keep = torch.sort(exit_mask.to(torch.uint8), stable=True).indices[:kept]
        rows = rows.index_select(0, keep)
        x = x.index_select(1, keep)
        padding_mask = padding_mask.index_select(0, keep)
        counts, ends = counts.index_select(0, keep), ends.index_select(0, keep)
        state = {k: v.index_select(0, keep) for k, v in state.items()}
        if has_pads:  # drop trailing all-pad columns (exact: padded keys get no attention)
            width = max(width, 1)
            if width < padding_mask.size(1):
                x, padding_mask = x[:width], padding_mask[:, :width]
            has_pads = fewest < width
        if mean is not None:
            mean.select(keep, x.size(0))

    assert all_logits is not None  # the last layer always has an exit
    predictions = all_logits.argmax(dim=-1)  # the stored logits: same argmax as at the exit
    return EarlyExitResult(predictions, exit_layers, all_logits)
