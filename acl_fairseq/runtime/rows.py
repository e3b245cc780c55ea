"""The row bookkeeping of the batched early-exit loop, whatever runs the layers: the rows still
running, the policy's state, each row's exit and logits (pure torch, no model).

The loop (``runtime.torch_loop`` in torch, ``runtime.onnx_runtime`` on ONNX Runtime)
runs the layers and, at each exit the policy decides at, hands the running rows' logits to
``RunningRows.at_exit``, which records the rows that leave and returns the indices of the rows
that stay when some left (the loop then keeps those rows of its hidden states and their first
``width`` positions); ``done`` says that no row runs any more. At the last exit every running
row leaves.

* one host sync per exit (does any row leave?) and, only where some row leaves and more than
  one row runs, a second one (how many rows stay and, with padding, the new width);
* the kept rows are found with a stable sort of the exit mask (no ``nonzero``); the leaving
  rows' logits are written with ``index_copy_`` on the running rows (rows that stay are
  overwritten at their own exit later);
* with padding, trailing columns that became all-pad are dropped (exact: padded keys get no
  attention), from per-row lengths computed once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..early_exit.policies import ExitPolicy

__all__ = ["EarlyExitResult", "RunningRows"]


class EarlyExitResult(NamedTuple):
    """Result of ``MultiExitRobertaModel.early_exit`` for B examples, K classes."""

    predictions: Tensor  # B, long: argmax of the exit's logits
    exit_layers: Tensor  # B, long: 1-based layer of the exit each example left at
    logits: Tensor  # B x K: logits of that exit
    labels: list[str] | None = None  # B label names (the hub's ``predict_early_exit``)


class RunningRows:
    """The running rows of a batch of B rows (``padding_mask``: B x T bool, True at padding;
    ``has_pads``: whether any position is padding) under ``policy``; ``last_layer``: the exit
    every row still running leaves at."""

    def __init__(
        self, policy: ExitPolicy, padding_mask: Tensor, has_pads: bool, last_layer: int
    ) -> None:
        bsz, device = padding_mask.size(0), padding_mask.device
        nonpad = ~padding_mask
        # per row: number of real tokens and 1 + position of the last one (for trimming)
        self.counts = nonpad.sum(dim=1)
        positions = torch.arange(1, padding_mask.size(1) + 1, device=device)
        self.ends = (nonpad * positions).amax(dim=1) if padding_mask.size(1) > 0 else self.counts
        self.policy = policy
        self.padding_mask = padding_mask  # B' x T' of the running rows
        self.has_pads = has_pads  # whether the running rows have padding
        self.width = padding_mask.size(1)  # T': positions the running rows keep
        self.size = bsz  # B': rows still running
        self.rows = torch.arange(bsz, device=device)  # original index of each running row
        self.state = policy.init_state(bsz, device)
        self.exit_layers = torch.full((bsz,), last_layer, dtype=torch.long, device=device)
        self.logits: Tensor | None = None  # B x K, allocated at the first exit
        self.last_layer = last_layer
        self.done = False  # no row runs any more

    def at_exit(self, layer: int, logits: Tensor) -> Tensor | None:
        """The running rows' ``logits`` (B' x K) at the exit of ``layer``: records the rows that
        leave. Returns the indices (B'') of the rows that stay when some left and some stay
        (keep them, and the first ``width`` positions, of the hidden states), else None."""
        if self.logits is None:
            self.logits = logits.new_zeros(self.exit_layers.size(0), logits.size(-1))
        if layer == self.last_layer:  # every running row exits at the last layer
            self._record(layer, logits)
            self.done = True
            return None
        exit_mask, self.state = self.policy.decide(logits, self.state)
        if not bool(exit_mask.any()):  # one host sync; nobody leaves here
            return None
        if self.size == 1:  # a single running row leaves: no row bookkeeping
            self._record(layer, logits)
            self.done = True
            return None
        stay = ~exit_mask
        if self.has_pads:  # kept rows, their widest end and fewest real tokens: one sync
            big = torch.iinfo(self.counts.dtype).max
            stats = torch.stack(
                [
                    stay.sum(),
                    torch.where(stay, self.ends, 0).amax(),
                    torch.where(stay, self.counts, big).amin(),
                ]
            ).tolist()
            kept, width, fewest = (int(v) for v in stats)
        else:
            kept = int(stay.sum())
        self._record(layer, logits)  # rows that stay are overwritten later
        if kept == 0:
            self.done = True
            return None
        keep = torch.sort(exit_mask.to(torch.uint8), stable=True).indices[:kept]
        self.size = kept
        self.rows = self.rows.index_select(0, keep)
        self.padding_mask = self.padding_mask.index_select(0, keep)
        self.counts, self.ends = self.counts.index_select(0, keep), self.ends.index_select(0, keep)
        self.state = {k: v.index_select(0, keep) for k, v in self.state.items()}
        if self.has_pads:  # drop trailing all-pad columns
            width = max(width, 1)
            if width < self.width:
                self.padding_mask, self.width = self.padding_mask[:, :width], width
            self.has_pads = fewest < width
        return keep

    def _record(self, layer: int, logits: Tensor) -> None:
        assert self.logits is not None
        self.logits.index_copy_(0, self.rows, logits)
        self.exit_layers.index_fill_(0, self.rows, layer)

    def result(self) -> EarlyExitResult:
        """``EarlyExitResult(predictions B, exit_layers B, logits B x K)`` once ``done``."""
        assert self.done and self.logits is not None  # the last layer always has an exit
        # the stored logits: the same argmax as at the exit
        return EarlyExitResult(self.logits.argmax(dim=-1), self.exit_layers, self.logits)
