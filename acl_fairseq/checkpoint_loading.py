"""Makes fairseq checkpoints load under torch >= 2.6 without turning weights_only off.

Since torch 2.6 ``torch.load`` defaults to ``weights_only=True``; fairseq checkpoints pickle an
``argparse.Namespace`` (``args``), so ``fairseq-validate --path``, ``--restore-file``, resuming
from ``checkpoint_last.pt`` and ``from_pretrained`` fail with "Weights only load failed".

:func:`install` wraps ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` (the one function
every fairseq entry point loads checkpoints through) so that, during that call only, the few
plain-data classes fairseq checkpoints hold are allow-listed for the weights-only unpickler.
Every other ``torch.load`` in the process keeps torch's default, and a checkpoint holding
anything else still fails, with a message that says what to do.
"""

import argparse
import functools
import pickle

import numpy as np
import torch
from fairseq import checkpoint_utils

__all__ = ["install", "SAFE_GLOBALS"]

#: Classes a fairseq checkpoint may hold besides tensors and builtins: ``args`` of old
#: checkpoints and of roberta.base, and numpy scalars that metrics sometimes leave behind.
SAFE_GLOBALS: list = [
    argparse.Namespace,
    np.dtype,
    np.dtypes.Float64DType,
    np.dtypes.Float32DType,
    np.dtypes.Int64DType,
    np._core.multiarray.scalar,
]


def _allow_fairseq_globals(load_fn):
    @functools.wraps(load_fn)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            try:
                return load_fn(path, *args, **kwargs)
            except pickle.UnpicklingError as e:
                raise pickle.UnpicklingError(
                    f"{path}: this checkpoint holds objects outside the set that acl_fairseq "
                    f"allows for fairseq checkpoints ({e}). If you trust the file, load it once "
                    "with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 and save it again."
                ) from e

    load_checkpoint_to_cpu._acl_fairseq_safe = True  # type: ignore[attr-defined]
    return load_checkpoint_to_cpu


def install() -> None:
    """Idempotent: wraps ``checkpoint_utils.load_checkpoint_to_cpu`` once."""
    current = checkpoint_utils.load_checkpoint_to_cpu
    if not getattr(current, "_acl_fairseq_safe", False):
        checkpoint_utils.load_checkpoint_to_cpu = _allow_fairseq_globals(current)
