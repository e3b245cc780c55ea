"""A fine-tuned checkpoint loaded for inference: its model, in eval mode, and its task on a
prepared data folder.

The one loader of the tools (``acl-fairseq-sweep``, ``acl-fairseq-predict``,
``acl-fairseq-plots``) and the benchmarks. ``read_checkpoint`` reads the file once (through
the safe loading of ``safe_loading``), ``checkpoint_data`` finds its data folder (the one given,
else the one it was trained on) and ``load_for_inference`` builds the model and the task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["CheckpointError", "Loaded", "checkpoint_data", "load_for_inference", "read_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint or data folder that cannot be used; the message names it and the fix."""


class Loaded(NamedTuple):
    """What ``load_for_inference`` returns."""

    model: Any  # in eval mode, on the device asked for
    task: Any  # the checkpoint's task, set up on ``data``
    data: str  # the prepared data folder the task reads


def read_checkpoint(path: str | Path, arg_overrides: dict[str, Any] | None = None) -> dict:
    """The checkpoint ``path`` read to CPU (``checkpoint_utils.load_checkpoint_to_cpu``)."""
    if not Path(path).is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    from fairseq import checkpoint_utils

    return checkpoint_utils.load_checkpoint_to_cpu(str(path), arg_overrides)


def checkpoint_data(state: dict[str, Any], checkpoint: str | Path) -> str:
    """The data folder ``checkpoint`` (read into ``state``) was trained on (``cfg.task.data``),
    when it exists here."""
    cfg = state.get("cfg")
    data = getattr(getattr(cfg, "task", None), "data", None) if cfg is not None else None
    if not data or not Path(data).is_dir():
        raise CheckpointError(
            f"{checkpoint} was trained on data folder {data!r}, which does not exist here: "
            "give the prepared folder with --data"
        )
    return str(data)


def load_for_inference(
    path: str | Path,
    data: str | Path | None = None,
    device: torch.device | str = "cpu",
    multi_exit: bool = False,
) -> Loaded:
    """The model of checkpoint ``path`` in eval mode on ``device``, and its task on ``data``
    (default: the folder it was trained on).

    Args:
        multi_exit: refuse a model without ``early_exit`` (not a multi-exit model).
    Raises:
        CheckpointError: no such file or folder, or not a multi-exit model when one is needed.
    """
    from fairseq import checkpoint_utils

    if data is not None and not Path(data).is_dir():
        raise CheckpointError(f"--data {data}: no such folder")
    overrides = None if data is None else {"data": str(data)}
    state = read_checkpoint(path, overrides)
    if data is None:
        data = checkpoint_data(state, path)
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], state=state)
    model = models[0]
    if multi_exit and not hasattr(model, "early_exit"):
        raise CheckpointError(
            f"{path} holds a {type(model).__name__}, not a multi-exit model "
            "(train it with --arch multi_exit_roberta*)"
        )
    return Loaded(model.to(device).eval(), task, str(data))
