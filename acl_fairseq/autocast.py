"""Mixed precision for ``--task acl_sentence_prediction``: ``--autocast bf16``.

fairseq 0.12's ``--bf16`` means TPU and ``--amp`` is fp16 on CUDA only. ``--autocast bf16``
runs the task's forward passes under ``torch.autocast`` (CPU or CUDA), the backward outside;
weights, gradients and ACL-Grad's angles stay fp32, losses are fp32 (:func:`full_precision`).
Other precision flags are refused at set-up (:func:`check_autocast`). docs/gpus.md.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.optim.amp_optimizer import AMPOptimizer
from omegaconf import II
from torch import Tensor, nn

from .errors import AclValueError

__all__ = [
    "AUTOCAST_DTYPES",
    "AutocastConfig",
    "check_autocast",
    "forward_precision",
    "full_precision",
]

AUTOCAST_DTYPES = {"bf16": torch.bfloat16}  # --autocast value -> torch dtype
AUTOCAST_CHOICES = ChoiceEnum(["none", *AUTOCAST_DTYPES])

# fairseq's precision flags (cfg.common), as the task sees them; each refused with --autocast
_EXCLUSIVE_FLAGS = {
    "fp16": "--fp16",
    "memory_efficient_fp16": "--memory-efficient-fp16",
    "bf16": "--bf16",
    "memory_efficient_bf16": "--memory-efficient-bf16",
    "amp": "--amp",
}


@dataclass
class AutocastConfig(FairseqDataclass):
    """The task's ``--autocast`` flag, and fairseq's precision flags it is checked against."""

    autocast: AUTOCAST_CHOICES = field(  # type: ignore[valid-type]
        default="none",
        metadata={
            "help": "mixed precision of the forward passes: 'bf16' runs them under "
            "torch.autocast with bfloat16, on CPU or CUDA, with fp32 weights, gradients, "
            "optimizer state and ACL-Grad angles (no loss scaling). fairseq's own --bf16 "
            "means TPU; do not combine with --fp16, --bf16 or --amp"
        },
    )
    fp16: bool = II("common.fp16")
    memory_efficient_fp16: bool = II("common.memory_efficient_fp16")
    bf16: bool = II("common.bf16")
    memory_efficient_bf16: bool = II("common.memory_efficient_bf16")
    amp: bool = II("common.amp")


def check_autocast(cfg: Any) -> None:
    """Raises ValueError naming the flags when ``--autocast`` is combined with another
    mixed-precision flag of fairseq. ``cfg`` is the task's config; a flag whose value is not
    known (a config built outside fairseq's command line) counts as off."""
    mode = str(getattr(cfg, "autocast", "none"))
    if mode == "none":
        return
    on = {key for key in _EXCLUSIVE_FLAGS if getattr(cfg, key, None) is True}
    on -= {k.replace("memory_efficient_", "") for k in on if k.startswith("memory_")}  # implied
    given = [flag for key, flag in _EXCLUSIVE_FLAGS.items() if key in on]
    if given:
        raise AclValueError(
            f"--autocast {mode} cannot be combined with {' '.join(given)}: --autocast {mode} "
            "keeps fp32 weights and runs the forward passes in bfloat16 by itself, while "
            f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} fairseq's own mixed "
            "precision (a half-precision model or loss scaling; common.* in a hydra config). "
            f"Drop {' '.join(given)} (fairseq's --bf16 means TPU training), or drop --autocast."
        )


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


@contextlib.contextmanager
def forward_precision(mode: str, model: nn.Module, optimizer: Any = None) -> Iterator[None]:
    """The context of a forward pass: ``torch.autocast`` in bfloat16 on ``model``'s device for
    ``--autocast bf16``; fairseq's fp16 autocast on CUDA for ``--amp`` (its
    ``AMPOptimizer``); else nothing."""
    if mode in AUTOCAST_DTYPES:
        with torch.autocast(_device_type(model), dtype=AUTOCAST_DTYPES[mode]):
            yield
    elif isinstance(optimizer, AMPOptimizer):
        with torch.autocast("cuda"):
            yield
    else:
        yield


@contextlib.contextmanager
def full_precision(like: Tensor) -> Iterator[None]:
    """Autocast off on ``like``'s device: a loss computed inside runs in the dtype of its
    inputs (pass them ``.float()``). A no-op outside an autocast region."""
    with torch.autocast(like.device.type, enabled=False):
        yield
