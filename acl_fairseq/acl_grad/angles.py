"""ACL-Grad's math: the angle between the CE and the contrastive gradient, and the decision.

Pure torch (no fairseq import); collectives are passed in as callables, so it is tested on
one process. The decision is per optimizer update, on gradients accumulated over every
micro-batch and worker (docs/acl_grad.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Decision",
    "ContrastiveGradientBuffer",
    "gradient_angle",
    "decide",
]


@dataclass(frozen=True)
class Decision:
    """One ACL-Grad check: ``angle`` in degrees (nan: undefined), ``keep`` the term, and
    ``finite`` (False on an fp16 overflow: the term is kept so the loss scaler sees it, and
    the angle enters no statistic)."""

    angle: float
    keep: bool
    finite: bool


def _dot_products(a: Sequence[Tensor], b: Sequence[Tensor]) -> tuple[float, float, float]:
    """<a,a>, <b,b>, <a,b> over two lists of same-shaped tensors: per tensor in float32,
    summed in float64 on the host (one device sync)."""
    if len(a) != len(b):
        raise ValueError(f"gradient lists differ in length: {len(a)} and {len(b)}")
    if not a:
        return 0.0, 0.0, 0.0
    triples = []
    for x, y in zip(a, b):
        x = x.detach().reshape(-1)
        y = y.detach().reshape(-1)
        if x.dtype not in (torch.float32, torch.float64):
            x, y = x.float(), y.float()
        triples.append(torch.stack([x @ x, y @ y, x @ y]))
    if len({t.dtype for t in triples}) > 1 or len({t.device for t in triples}) > 1:
        triples = [t.to("cpu", torch.float64) for t in triples]
    aa = bb = ab = 0.0
    for xx, yy, xy in torch.stack(triples).cpu().double().tolist():  # float64 sums, in order
        aa += xx
        bb += yy
        ab += xy
    return aa, bb, ab


def gradient_angle(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """Angle in degrees between two gradients (lists of same-shaped tensors); nan for a zero
    or non-finite one. Invariant to loss scaling."""
    aa, bb, ab = _dot_products(a, b)
    if not (math.isfinite(aa) and math.isfinite(bb) and math.isfinite(ab)):
        return math.nan
    if aa == 0.0 or bb == 0.0:
        return math.nan
    cos = min(max(ab / (math.sqrt(aa) * math.sqrt(bb)), -1.0), 1.0)
    return math.degrees(math.acos(cos))


def decide(angle: float, threshold: float) -> Decision:
    """Keeps the contrastive term unless the angle exceeds ``threshold`` degrees; a nan
    angle keeps it (a zero gradient cannot conflict; an overflow must reach the scaler)."""
    finite = not math.isnan(angle)
    keep = (not finite) or angle <= threshold
    return Decision(angle=angle, keep=keep, finite=finite)


class ContrastiveGradientBuffer:
    """The contrastive gradient of the current update, beside ``.grad``, for fixed
    ``params``: one flat buffer per (device, dtype), so one all-reduce each."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self.params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self._groups = list(groups.items())
        self._flat: list[Tensor] | None = None
        self._views: list[Tensor] = []

    @property
    def empty(self) -> bool:
        return self._flat is None

    def reset(self) -> None:
        """Drops what was accumulated (called when the trainer zeroes ``.grad``)."""
        self._flat = None
        self._views = []

    def _allocate(self) -> None:
        self._flat = []
        self._views = [None] * len(self.params)  # type: ignore[list-item]
        for (device, dtype), idx in self._groups:
            flat = torch.zeros(sum(self.params[i].numel() for i in idx), dtype=dtype, device=device)
            offset = 0
            for i in idx:
                n = self.params[i].numel()
                self._views[i] = flat[offset : offset + n].view_as(self.params[i])
                offset += n
            self._flat.append(flat)

    def accumulate(self, grads: Sequence[Tensor | None]) -> None:
        """Adds one micro-batch's contrastive gradients (aligned with ``params``; None = 0)."""
        if len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradients, got {len(grads)}")
        if self._flat is None:
            self._allocate()
        pairs = [
            (v, g if g.dtype == v.dtype else g.to(v.dtype))
            for v, g in zip(self._views, grads)
            if g is not None
        ]
        if pairs:
            torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])

    def all_reduce(self, all_reduce: Callable[[Tensor], None]) -> None:
        """Reduces the buffer in place across data-parallel workers with ``all_reduce``,
        which must use the same convention (sum or mean) as the trainer's for ``.grad``."""
        if self._flat is None:
            self._allocate()
        for flat in self._flat:  # type: ignore[union-attr]
            all_reduce(flat)

    def angle_to_grad(self, subset: Sequence[int] | None = None) -> float:
        """Angle in degrees between the ``.grad`` of ``params`` (CE) and this buffer;
        ``subset`` (indices into ``params``) restricts both to those parameters."""
        if self._flat is None:
            return math.nan
        indices = range(len(self.params)) if subset is None else subset
        a, b = [], []
        for i in indices:
            p, view = self.params[i], self._views[i]
            a.append(p.grad if p.grad is not None else torch.zeros_like(view))
            b.append(view)
        if not a:
            return math.nan
        return gradient_angle(a, b)

    def add_to_grad(self) -> None:
        """``p.grad += contrastive gradient`` for every parameter, then empties the buffer."""
        if self._flat is None:
            return
        with_grad = [(p.grad, v) for p, v in zip(self.params, self._views) if p.grad is not None]
        if with_grad:
            torch._foreach_add_([g for g, _ in with_grad], [v for _, v in with_grad])
        for p, view in zip(self.params, self._views):
            if p.grad is None:
                p.grad = view.clone()
        self.reset()
