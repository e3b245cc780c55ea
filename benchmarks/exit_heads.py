"""Exit heads alone at low precision in a float32 model: what ``benchmarks/exit_cost_batch1.py``
measures (a shallow head's ``dense`` in bf16 or int8, the encoder and the final head as they are).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from acl_fairseq.runtime.precision import (
    Float32Logits,
    _quantize,
    _select_engine,
    check_precision,
)

__all__ = ["Bf16Linear", "prepare_exit_heads"]


class Bf16Linear(nn.Linear):
    """A linear layer with bfloat16 weights in a float32 model: its input is cast to bfloat16
    and its output stays bfloat16 (the head's ``out_proj``, a ``Float32Logits``, takes it)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Bf16Linear:
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        out.load_state_dict(linear.state_dict())
        return out.to(device=linear.weight.device, dtype=torch.bfloat16)


def prepare_exit_heads(model: Any, dtype: str, head_name: str | None = None):
    """Only the *shallow* exit heads of ``head_name`` at ``dtype``: their ``dense`` in bf16
    (``Bf16Linear``) or int8, their ``out_proj`` float32; the encoder and the final head keep
    their precision (so full-depth predictions do not change). For a float32 multi-exit model
    at batch 1, where a shallow head costs reading its C x C ``dense`` weights back into the
    cache after every layer: half (bf16) or a quarter (int8) of those bytes. In place, eval
    mode; returns ``model``.
    """
    dtype = check_precision(dtype)
    model.eval()
    if dtype == "fp32":
        return model
    shallow = (model.exit_heads(head_name) if head_name else model.exit_heads())[:-1]
    prefix = {id(m): n for n, m in model.named_modules()}
    if dtype == "bf16":
        for _layer, head in shallow:
            if type(head.dense) is nn.Linear:
                head.dense = Bf16Linear.from_linear(head.dense)
            if not isinstance(head.out_proj, Float32Logits):
                head.out_proj = Float32Logits.from_linear(head.out_proj)
        return model
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 exit heads run on the CPU only (torch's dynamic quantization)")
    from torch.ao.quantization import per_channel_dynamic_qconfig

    _select_engine()
    spec = {
        f"{prefix[id(head)]}.dense": per_channel_dynamic_qconfig
        for _layer, head in shallow
        if type(head.dense) is nn.Linear
    }
    _quantize(model, spec, None)
    return model
