"""The fingerprint of a checkpoint's weights: what a saved policy, an ONNX Runtime cache entry
and an exported bundle are tied to, so that they never run on other weights."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["model_fingerprint"]


def model_fingerprint(state_dict: Mapping[str, Any]) -> str:
    """sha256 of a checkpoint's model weights (its ``state["model"]`` as read): every entry's
    name, dtype, shape and bytes, by name. The same for a copy of the file and for the
    checkpoint saved without its optimizer state; another for any other weights."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        value = state_dict[name]
        digest.update(name.encode("utf-8") + b"\0")
        if not torch.is_tensor(value):
            digest.update(repr(value).encode("utf-8") + b"\0")
            continue
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{tensor.dtype}{tuple(value.shape)}".encode() + b"\0")
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()
