"""The batched early-exit loop of ``MultiExitRobertaModel.early_exit``.

It mirrors ``TransformerEncoder.forward`` layer by layer and keeps the work per layer small:

* a policy that can never let a row out before the last exit (``ExitPolicy.never_exits``:
  ``entropy:0``, ``maxprob`` above 1, a patience of at least the number of shallow exits) runs
  the plain full-depth forward: no exit head is evaluated;
* at a shallow exit with ``first`` pooling only the first position is layer-normed and fed to
  the head (the same numbers as normalising every position and pooling afterwards);
* one host sync per shallow exit (does any row leave?) and, only where some row leaves, a
  second one (how many rows stay and, with padding, the new width), and nothing else: the
  kept rows are found with a stable sort of the exit mask (no ``nonzero``),
  the leaving rows' logits are written with ``index_copy_`` on the running rows (rows that
  stay are overwritten at their own exit later), and the batch is compacted only when some
  row leaves;
* the padding bookkeeping uses per-row lengths computed once (no padding mask recomputed),
  and ``mean`` pooling uses weights computed once (``pooling.MeanWeights``);
* a single row without padding (batch 1) takes ``_run_single_row``: no row bookkeeping, the
  policy decides on the host (``ExitPolicy.decide_row``: one ``tolist`` per exit) and the
  loop stops at the row's exit. At batch 1 the per-exit cost is what remains: the head
  (pooling, dense, activation, out_proj) and that one sync.

Results equal the per-example and full-depth runs (the tests check both).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..models.pooling import MeanWeights, masked_mean
from ..models.types import EarlyExitResult
from .policies import ExitPolicy

__all__ = ["run_early_exit"]


def _classify(head: Any, pooled: Tensor) -> Tensor:
    """Logits (B x K) of ``head`` on pooled features (B x C): dense, activation, out_proj
    (dropout is the identity in eval mode)."""
    return head.out_proj(head.activation_fn(head.dense(pooled)))


def _head_logits(model: Any, head: Any, x: Tensor, mean: MeanWeights | None) -> Tensor:
    """Logits (B x K) of the exit ``head`` on the hidden states ``x`` (T x B x C) after a layer.

    With ``first`` pooling only ``x[0]`` goes through the final layer norm (per position, so
    the same values); ``mean`` pooling uses the precomputed ``mean`` weights.
    """
    layer_norm = model.encoder.sentence_encoder.layer_norm
    if head.pooling == "first":
        pooled = x[0]  # B x C
        if layer_norm is not None:
            pooled = layer_norm(pooled)
        return _classify(head, pooled)
    assert mean is not None, "mean pooling needs its weights"
    return _classify(head, masked_mean(model._exit_hidden(x).transpose(0, 1), mean))


def _run_layer(layer: Any, x: Tensor, padding_mask: Tensor | None) -> Tensor:
    """One encoder layer on ``x`` (T x B x C); fairseq layers return ``(x, attn)`` or ``x``."""
    out = layer(x, encoder_padding_mask=padding_mask)
    return out[0] if isinstance(out, tuple) and len(out) == 2 else out


def _uses_mean(heads: dict[int, Any]) -> bool:
    """True when some exit head pools with ``mean``."""
    return any(head.pooling == "mean" for head in heads.values())


def _run_single_row(
    model: Any, x: Tensor, policy: ExitPolicy, heads: dict[int, Any]
) -> EarlyExitResult:
    """The loop for one row without padding, from its embedded tokens ``x`` (T x 1 x C).

    No row bookkeeping: per exit the head runs, ``policy.decide_row`` decides with one host
    sync, and the loop stops at the first exit the row takes.
    """
    encoder = model.encoder.sentence_encoder
    no_pads = torch.zeros(1, x.size(0), dtype=torch.bool, device=x.device)
    mean = MeanWeights(no_pads, has_pads=False) if _uses_mean(heads) else None
    state = policy.init_row_state(x.device)
    num_layers = int(model.num_layers)
    for layer_idx, layer in enumerate(encoder.layers, start=1):
        x = _run_layer(layer, x, None)
        head = heads.get(layer_idx)
        if head is None:
            continue
        logits = _head_logits(model, head, x, mean)  # 1 x K
        if layer_idx == num_layers:
            break
        leaves, state = policy.decide_row(logits, state)
        if leaves:
            break
    exit_layer = torch.full((1,), layer_idx, dtype=torch.long, device=x.device)
    return EarlyExitResult(logits.argmax(dim=-1), exit_layer, logits)


def run_early_exit(
    model: Any, src_tokens: Tensor, policy: ExitPolicy, head_name: str
) -> EarlyExitResult:
    """Batched early exit of ``model`` (a ``MultiExitRobertaModel`` in eval mode).

    Args:
        src_tokens: B x T token ids.
        policy: the exit policy.
        head_name: the head group.
    Returns:
        ``EarlyExitResult(predictions B, exit_layers B, logits B x K)``.
    """
    heads = dict(model.exit_heads(head_name))
    num_layers = int(model.num_layers)
    bsz, device = src_tokens.size(0), src_tokens.device
    if policy.never_exits(len(heads) - 1):
        logits = model(src_tokens, classification_head_name=head_name)[0]
        layers = torch.full((bsz,), num_layers, dtype=torch.long, device=device)
        return EarlyExitResult(logits.argmax(dim=-1), layers, logits)

    encoder = model.encoder.sentence_encoder
    padding_mask = model._padding_mask(src_tokens)  # B x T
    has_pads = bool(padding_mask.any())  # one host sync here
    x, _ = encoder.forward_embedding(src_tokens)  # B x T x C
    if has_pads:  # the encoder multiplies by 1 when there is no padding: skip that
        x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
    x = x.transpose(0, 1)  # T x B x C
    if bsz == 1 and not has_pads:
        return _run_single_row(model, x, policy, heads)

    nonpad = ~padding_mask
    # per row: number of real tokens and 1 + position of the last one (for trimming)
    counts = nonpad.sum(dim=1)
    positions = torch.arange(1, src_tokens.size(1) + 1, device=device)
    ends = (nonpad * positions).amax(dim=1) if src_tokens.size(1) > 0 else counts
    mean = MeanWeights(padding_mask, has_pads) if _uses_mean(heads) else None
    rows = torch.arange(bsz, device=device)  # original index of each running row
    state = policy.init_state(bsz, device)
    exit_layers = torch.full((bsz,), num_layers, dtype=torch.long, device=device)
    all_logits: Tensor | None = None

    for layer_idx, layer in enumerate(encoder.layers, start=1):
        x = _run_layer(layer, x, padding_mask if has_pads else None)
        if layer_idx not in heads:
            continue
        logits = _head_logits(model, heads[layer_idx], x, mean)  # B' x K
        if all_logits is None:
            all_logits = logits.new_zeros(bsz, logits.size(-1))
        if layer_idx == num_layers:  # every running row exits at the last layer
            all_logits.index_copy_(0, rows, logits)
            exit_layers.index_fill_(0, rows, num_layers)
            break
        exit_mask, state = policy.decide(logits, state)
        if not bool(exit_mask.any()):  # one host sync; nobody leaves here
            continue
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
