"""A fine-tuned checkpoint loaded for inference: its model, in eval mode, and its task on a
prepared data folder.

The one loader of the tools (``acl-fairseq-sweep``, ``acl-fairseq-predict``,
``acl-fairseq-plots``) and the benchmarks. ``read_checkpoint`` reads the file once (through
the safe loading of ``safe_loading``), ``checkpoint_data`` finds its data folder (the one given,
else the one it was trained on, wherever the command runs) and ``load_for_inference`` checks
that folder against what the checkpoint recorded (``training_data``), then builds the model
and the task. Every problem is a ``CheckpointError`` whose message names the file or folder.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..checkpoint.training_data import DataMismatch, check_folder, describe_folder, recorded
from ..data.splits import raw_files

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

    from ..checkpoint.safe_loading import named_as

    try:
        with named_as("checkpoint"):
            return checkpoint_utils.load_checkpoint_to_cpu(str(path), arg_overrides)
    except (ValueError, EOFError, pickle.UnpicklingError, RuntimeError) as e:
        message = str(e)  # the safe loading names the file and says what it is
        raise CheckpointError(message if str(path) in message else f"{path}: {message}") from None


def checkpoint_data(state: dict[str, Any], checkpoint: str | Path) -> str:
    """The data folder ``checkpoint`` (read into ``state``) was trained on: the absolute path
    it recorded (``training_data``), else ``cfg.task.data`` (relative to where it trained, so
    tried from here), whichever exists."""
    cfg = state.get("cfg")
    data = getattr(getattr(cfg, "task", None), "data", None) if cfg is not None else None
    record = recorded(state)
    candidates = [record["data"]] if record else []
    candidates += [data] if data else []
    for candidate in candidates:
        if Path(candidate).is_dir():
            return str(candidate)
    shown = " or ".join(repr(c) for c in dict.fromkeys(candidates)) or "(none recorded)"
    raise CheckpointError(
        f"{checkpoint} was trained on data folder {shown}, which does not exist here: give the "
        "prepared folder with --data"
    )


def check_data_folder(data: str | Path, flag: str = "--data") -> None:
    """Raises ``CheckpointError`` unless ``data`` is a prepared (binarized) folder."""
    data = Path(data)
    if not data.is_dir():
        raise CheckpointError(f"{flag} {data}: no such folder")
    if (data / "input0" / "dict.txt").is_file():
        return
    raw = raw_files(data)
    what = f"raw files ({raw}), not binarized data" if raw else "no input0/dict.txt"
    raise CheckpointError(
        f"{flag} {data} holds {what}: give the folder acl-fairseq-prepare wrote (OUT/TASK-bin, "
        "with input0/, label/ and prepare_glue.json), or prepare it first: acl-fairseq-prepare "
        "--task custom --train ... (own TSV files) or --glue-dir ... (GLUE)"
    )


def load_for_inference(
    path: str | Path,
    data: str | Path | None = None,
    device: torch.device | str = "cpu",
    multi_exit: bool = False,
    dtype: str | None = None,
    label_order: bool = True,
) -> Loaded:
    """The model of checkpoint ``path`` in eval mode on ``device``, and its task on ``data``
    (default: the folder it was trained on).

    Args:
        multi_exit: refuse a model without shallow exits (not a multi-exit model, or a
            stage-1 one trained with ``--exit-layers none``).
        label_order: refuse a folder whose labels are the checkpoint's in another order (its
            binarized targets would not be the model's classes); ``False`` when only the
            names are used (``training_data.check_folder`` gives the checkpoint's order).
        dtype: ``fp32``, ``bf16`` or ``int8``: the precision to run at
            (``inference_precision.prepare_for_inference``); None: as stored.
    Raises:
        CheckpointError: no such file or folder, not a prepared folder, a folder the checkpoint
            was not trained on (``training_data.check_folder``), a file that is not a fairseq
            checkpoint, not a multi-exit model when one is needed, or a precision this device
            cannot run.
    """
    from fairseq import checkpoint_utils

    if data is not None:
        check_data_folder(data)
    overrides = None if data is None else {"data": str(data)}
    state = read_checkpoint(path, overrides)
    cfg = state.get("cfg")
    if data is None:
        data = checkpoint_data(state, path)
        check_data_folder(data, "the checkpoint's data folder")
        cfg.task.data = str(data)  # the task reads the folder found (cfg's may be relative)
    num_classes = getattr(getattr(cfg, "task", None), "num_classes", None)
    folder = describe_folder(data)
    try:
        found = check_folder(recorded(state), folder, path, num_classes=num_classes)
    except DataMismatch as e:
        raise CheckpointError(str(e)) from None
    if label_order and found.labels != folder["labels"]:
        raise CheckpointError(
            f"{data}/label/dict.txt lists the labels of {path} in another order: its binarized "
            "targets are not the model's classes. Give the prepared folder it was trained on"
        )
    try:
        models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], state=state)
    except ValueError as e:  # e.g. acl_fairseq.checkpoint.fits: another vocabulary
        raise CheckpointError(f"{path} with data folder {data}: {e}") from None
    model = models[0]
    if multi_exit and not hasattr(model, "early_exit"):
        raise CheckpointError(
            f"{path} holds a {type(model).__name__}, not a multi-exit model "
            "(train it with --arch multi_exit_roberta*)"
        )
    if multi_exit and not model.shallow_exit_layers:
        raise CheckpointError(
            f"{path} has no shallow exit (a stage-1 checkpoint, trained with --exit-layers "
            "none): early exit needs the multi-exit stage 2: fairseq-train --arch "
            f"multi_exit_roberta* --criterion acl_cross_layer --restore-file {path} (exits "
            "after every layer by default; docs/usage.md, Methods)"
        )
    model = model.to(device).eval()
    if dtype is not None:
        from .precision import prepare_for_inference

        try:
            prepare_for_inference(model, dtype)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return Loaded(model, task, str(data))
