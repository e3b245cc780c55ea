"""What a frozen backbone gives the exits, computed once per sentence (``--freeze-backbone``).

With the backbone frozen (embeddings, layers and final exit in eval mode, no gradients), the
input of each shallow exit head (its pooled features, before the head's own dropout) and the
final exit's logits and features are fixed functions of a sentence's tokens. ``FrozenExitCache``
keeps them per sentence, keyed by its non-pad tokens (so the padding and the batch a sentence
comes in do not matter), and computes only the sentences it has not seen: after the first
epoch the encoder no longer runs, only the heads that train. Each process (data-parallel
worker) caches the sentences it sees. Pure tensor math (no fairseq import).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["FrozenExitCache", "FrozenInputs", "row_keys"]

logger = logging.getLogger(__name__)


class FrozenInputs(NamedTuple):
    """What the frozen backbone gives the exits for B sentences (E shallow exits)."""

    pooled: Tensor  # B x E x C: each shallow exit head's pooled input (``head.pool``'s output)
    final_logits: Tensor  # B x K: the final exit's logits
    final_features: Tensor  # B x C': the final exit's ``out_proj`` input


def row_keys(src_tokens: Tensor, padding_idx: int) -> list[bytes]:
    """One key per row of B x T ``src_tokens``: the bytes of its non-pad tokens, in order."""
    tokens = src_tokens.detach().cpu()
    keep = tokens.ne(padding_idx)
    return [row[mask].numpy().tobytes() for row, mask in zip(tokens, keep)]


def _row_bytes(row: tuple[Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in row)


class FrozenExitCache:
    """``FrozenInputs`` per sentence, up to ``max_bytes`` (sentences beyond it are computed
    each time they come: correct, only slower); ``clear()`` when the frozen weights change."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.full = False
        self._rows: dict[bytes, tuple[Tensor, Tensor, Tensor]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        self._rows.clear()
        self.bytes, self.full = 0, False

    def get(
        self,
        src_tokens: Tensor,
        padding_idx: int,
        compute: Callable[[Tensor], FrozenInputs],
    ) -> FrozenInputs:
        """The ``FrozenInputs`` of the B x T ``src_tokens``: cached rows as they were stored,
        the others from ``compute`` (called once, on the B' x T rows not cached), then stored."""
        keys = row_keys(src_tokens, padding_idx)
        if not keys:
            return compute(src_tokens)
        missing = [i for i, key in enumerate(keys) if key not in self._rows]
        fresh: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        if missing:
            index = torch.tensor(missing, device=src_tokens.device)
            computed = compute(src_tokens.index_select(0, index))
            for j, i in enumerate(missing):
                row = tuple(part[j].detach().clone() for part in computed)
                fresh[i] = row  # type: ignore[assignment]
                self._store(keys[i], row)  # type: ignore[arg-type]
        rows = [fresh[i] if i in fresh else self._rows[key] for i, key in enumerate(keys)]
        return FrozenInputs(*(torch.stack(part) for part in zip(*rows)))

    def _store(self, key: bytes, row: tuple[Tensor, Tensor, Tensor]) -> None:
        if key in self._rows or self.full:
            return
        size = _row_bytes(row)
        if self.bytes + size > self.max_bytes:
            self.full = True
            logger.warning(
                f"--freeze-backbone-cache-mb: the cache is full ({self.bytes / 2**20:.0f} MiB, "
                f"{len(self._rows)} sentences); the sentences beyond it run the frozen encoder "
                "every time (raise the flag to cache them)"
            )
            return
        self._rows[key] = row
        self.bytes += size
