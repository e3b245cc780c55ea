"""The row bookkeeping of the batched early-exit loop, whatever runs the layers, on numpy host
arrays: the rows still running, the decision's state, each row's exit and logits.

A loop (``runtime.torch_loop`` in torch, ``ort_loop`` on ONNX Runtime) runs the layers and, at
each exit the policy decides at, hands the running rows' logits (on the host) to
``RunningRows.at_exit``, which records the rows that leave and returns the indices of the rows
that stay when some left; the loop then keeps those rows of its hidden states and their first
``width`` positions (trailing columns that became all padding are dropped: exact, padded keys
get no attention). ``done`` says that no row runs any more; at the last exit every running row
leaves.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from .decide import State

__all__ = ["Decider", "ExitResult", "RunningRows"]


class Decider(Protocol):
    """What decides at an exit: ``decide.Decision``, or a loop's adapter of another kind."""

    def init_state(self, rows: int) -> State: ...

    def decide(self, logits: np.ndarray, state: State) -> tuple[np.ndarray, State]: ...


class ExitResult(NamedTuple):
    """The early exit of B rows, K classes (numpy)."""

    predictions: np.ndarray  # B int64: argmax of the exit's logits
    exit_layers: np.ndarray  # B int64: the 1-based layer each row left at
    logits: np.ndarray  # B x K float32: the logits of that exit


def row_result(logits: np.ndarray, layer: int) -> ExitResult:
    """The result of rows that all left at ``layer`` with ``logits`` (B x K)."""
    logits = np.asarray(logits, dtype=np.float32)
    layers = np.full(logits.shape[0], layer, dtype=np.int64)
    return ExitResult(logits.argmax(axis=1), layers, logits)


class RunningRows:
    """The running rows of a batch of B rows (``padding_mask``: B x T bool, True at padding)
    under ``decider``; ``last_layer``: the exit every row still running leaves at."""

    def __init__(self, decider: Decider, padding_mask: Any, last_layer: int) -> None:
        padding_mask = np.asarray(padding_mask, dtype=bool)
        bsz, width = padding_mask.shape
        nonpad = ~padding_mask
        # per row: its real tokens and 1 + the position of its last one (for trimming)
        self.counts = nonpad.sum(axis=1)
        positions = np.arange(1, width + 1)
        self.ends = (nonpad * positions).max(axis=1) if width else self.counts
        self.decider = decider
        self.padding_mask = padding_mask  # B' x T' of the running rows
        self.has_pads = bool(padding_mask.any())  # whether the running rows have padding
        self.width = width  # T': positions the running rows keep
        self.rows = np.arange(bsz)  # original index of each running row
        self.state = decider.init_state(bsz)
        self.exit_layers = np.full(bsz, last_layer, dtype=np.int64)
        self.logits: np.ndarray | None = None  # B x K, made at the first exit
        self.last_layer = last_layer
        self.done = False  # no row runs any more

    @property
    def size(self) -> int:
        """B': the rows still running."""
        return int(self.rows.size)

    def at_exit(self, layer: int, logits: Any) -> np.ndarray | None:
        """The running rows' ``logits`` (B' x K) at the exit of ``layer``: records the rows that
        leave. Returns the indices (B'') of the rows that stay when some left and some stay
        (keep them, and the first ``width`` positions, of the hidden states), else None."""
        logits = np.asarray(logits, dtype=np.float32)
        if self.logits is None:
            self.logits = np.zeros((self.exit_layers.size, logits.shape[1]), dtype=np.float32)
        if layer == self.last_layer:  # every running row exits at the last layer
            self._record(layer, logits, slice(None))
            self.done = True
            return None
        leave, self.state = self.decider.decide(logits, self.state)
        if not leave.any():
            return None
        self._record(layer, logits, leave)
        keep = np.flatnonzero(~leave)
        if keep.size == 0:
            self.done = True
            return None
        self.rows = self.rows[keep]
        self.padding_mask = self.padding_mask[keep]
        self.counts, self.ends = self.counts[keep], self.ends[keep]
        self.state = {k: v[keep] for k, v in self.state.items()}
        if self.has_pads:  # drop trailing all-pad columns
            width = max(int(self.ends.max()), 1)
            if width < self.width:
                self.padding_mask, self.width = self.padding_mask[:, :width], width
            self.has_pads = bool(int(self.counts.min()) < self.width)
        return keep

    def _record(self, layer: int, logits: np.ndarray, which: Any) -> None:
        assert self.logits is not None
        rows = self.rows[which]
        self.logits[rows] = logits[which]
        self.exit_layers[rows] = layer

    def result(self) -> ExitResult:
        """The rows' predictions, exits and logits, once ``done``."""
        assert self.done and self.logits is not None  # the last layer always has an exit
        return ExitResult(self.logits.argmax(axis=1), self.exit_layers, self.logits)
