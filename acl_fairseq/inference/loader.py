"""A fine-tuned checkpoint loaded for inference, in one call: what every tool, the hub and the
benchmarks need, in one ``Loaded``.

``load_for_inference`` is the library's one path to fairseq's model loading
(``acl-fairseq-predict``, ``-sweep``, ``-plots``, ``-compare``, ``from_pretrained``, the
benchmarks). Cheap checks come first: the precision asked for and the device (int8 runs on the
CPU only), the data folder given, the saved policy's file. Then the checkpoint is read once
(``read_checkpoint``, through ``safe_loading``), its data folder found (``checkpoint_data``: the
one given, else the one it was trained on, wherever the command runs), ``prepare_glue.json``
read once, the folder checked against what the checkpoint recorded (``training_data``), the
saved policy kept only for the weights it was chosen on (``saved_policy``), and only then the
model built, moved, put in eval mode at its precision. Every problem is a ``CheckpointError``
whose message names the file, folder or flag.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ..checkpoint.fingerprint import model_fingerprint
from ..checkpoint.training_data import DataMismatch, check_folder, describe_folder, recorded
from ..data.prepared import META_FILE, read_meta
from ..data.splits import raw_files
from ..data.task_specs import DataError
from ..data.text_encoder import ExampleEncoder, TextEncoder
from ..errors import AclValueError
from ..fairseq_patches import mark_in_use
from ..runtime.onnx_runtime import require_onnxruntime
from ..runtime.precision import check_precision, prepare_for_inference
from .plan import ONNXRUNTIME, SAVED, Plan, PlanError, Request, decide
from .saved_policy import SavedPolicy, read_policy

__all__ = [
    "CheckpointError",
    "Loaded",
    "check_data_folder",
    "check_device",
    "checkpoint_data",
    "load_for_inference",
    "read_checkpoint",
]


class CheckpointError(AclValueError):
    """A checkpoint or data folder that cannot be used; the message names it and the fix."""


@dataclass
class Loaded:
    """What ``load_for_inference`` returns."""

    model: Any  # in eval mode, on the device asked for, at ``dtype``
    task: Any  # the checkpoint's task, set up on ``data``
    data: str  # the prepared data folder the task reads
    cfg: Any  # the checkpoint's whole configuration (overrides applied)
    checkpoint: str
    labels: list[str] | None  # class names in the model's class order; None: regression
    notes: list[str]  # what the user should know about the folder (``check_folder``)
    num_inputs: int  # 2 for sentence pairs
    meta: dict[str, Any] | None  # the folder's prepare_glue.json; None without one
    dtype: str  # the precision the model runs at
    text: TextEncoder | None = None  # raw text -> token line (``text=...``)
    examples: ExampleEncoder | None = None  # raw text -> the model's input (``text=...``)
    saved: SavedPolicy | None = None  # the saved policy, chosen on these weights
    saved_note: str = ""  # why early_exit_policy.json is not used ("" when it is or is absent)
    fingerprint: str | None = None  # ``model_fingerprint`` of the checkpoint
    plan: Plan | None = None  # what runs (``request=...``): backend, precision, policy, why

    def runner(self, head: str, onnx_cache: str | Path | None = None, shared_pool: bool = False):
        """What runs the plan: the model itself (fairseq backend, or no plan), or its ONNX
        Runtime segments (``OrtEarlyExit`` at the plan's precision, exported once into
        ``onnx_cache``, default ``onnx_runtime/`` next to the checkpoint). Both offer
        ``early_exit``, ``exit_outputs`` and ``runner(tokens)[0]``."""
        if self.plan is None or not self.plan.onnxruntime:
            return self.model
        from ..runtime.onnx_runtime import ONNX_CACHE, OrtEarlyExit

        cache = onnx_cache or Path(self.checkpoint).parent / ONNX_CACHE
        return OrtEarlyExit(
            self.model, head, cache, self.plan.dtype, None, self.fingerprint,
            shared_pool=shared_pool,
        )  # fmt: skip

    @property
    def regression(self) -> bool:
        return bool(getattr(self.task.cfg, "regression_target", False))

    @property
    def max_positions(self) -> int:
        """The longest input (tokens) the task and the model take."""
        from fairseq import utils

        return int(
            utils.resolve_max_positions(self.task.max_positions(), self.model.max_positions())
        )


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


def checkpoint_data(state: dict[str, Any], checkpoint: str | Path, flag: str = "--data") -> str:
    """The data folder ``checkpoint`` (read into ``state``) was trained on: the absolute path
    it recorded (``training_data``), else ``cfg.task.data`` (relative to where it trained, so
    tried from here), whichever exists; else an error naming ``flag``."""
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
        f"prepared folder with {flag}"
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


def check_device(
    dtype: str, device: torch.device | str, what: str, fix: str = "add --cpu, or use --dtype bf16"
) -> None:
    """``CheckpointError`` when precision ``dtype`` (asked for as ``what``, e.g. ``--dtype
    int8``) cannot run on ``device``: int8 is torch's dynamic quantization, CPU only."""
    device = torch.device(device)
    if dtype == "int8" and device.type != "cpu":
        raise CheckpointError(
            f"{what} runs on the CPU only (torch's dynamic quantization), not on "
            f"{device.type}: {fix}"
        )


def _flag(flag: str, value: str) -> str:
    """``--dtype int8`` for a command's flag, ``dtype='int8'`` for a keyword argument."""
    return f"{flag} {value}" if flag.startswith("-") else f"{flag}={value!r}"


def _read_meta(data: str, flag: str) -> dict[str, Any] | None:
    """The folder's ``prepare_glue.json`` (read once), None without one."""
    if not (Path(data) / META_FILE).is_file():
        return None
    try:
        return read_meta(data)
    except DataError as e:  # a tokenizer file it names is missing
        raise CheckpointError(f"{flag} {data}: {e}") from None
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(
            f"{Path(data) / META_FILE}: not the file acl-fairseq-prepare writes ({e}); "
            "prepare the folder again"
        ) from None


def _text_encoder(meta: dict[str, Any] | None, data: str, flag: str, required: bool):
    if meta is None:
        if not required:
            return None
        raise CheckpointError(
            f"{flag} {data}: no {META_FILE}, so new text cannot be encoded as the training "
            "data was: give the folder acl-fairseq-prepare wrote (it records the tokenizer)"
        )
    try:
        return TextEncoder.from_meta(meta)
    except (DataError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{flag} {data}: {e} (new text is encoded with the tokenizer recorded at preparation)"
        ) from None


def load_for_inference(
    path: str | Path,
    data: str | Path | None = None,
    device: torch.device | str = "cpu",
    multi_exit: bool = False,
    dtype: str | None = None,
    label_order: bool = True,
    *,
    request: Request | None = None,
    text: Literal["required", "optional"] | None = None,
    fingerprint: bool = False,
    arg_overrides: dict[str, Any] | None = None,
    data_flag: str = "--data",
    dtype_flag: str = "--dtype",
) -> Loaded:
    """Checkpoint ``path`` loaded for inference on ``device``, its task on ``data`` (default:
    the folder it was trained on).

    Args:
        multi_exit: refuse a model without shallow exits (not a multi-exit model, or a
            stage-1 one trained with ``--exit-layers none``).
        dtype: ``fp32``, ``bf16`` or ``int8``: the precision to run at
            (``precision.prepare_for_inference``); None: as stored (fp32). Not with
            ``request``, which has its own.
        label_order: refuse a folder whose labels are the checkpoint's in another order (its
            binarized targets would not be the model's classes); ``False`` when only the
            names are used (``Loaded.labels`` is the checkpoint's order).
        request: what the user asked to run (``plan.Request``): ``early_exit_policy.json``
            next to the checkpoint is read once (``Loaded.saved`` when it was chosen on these
            weights, else ``Loaded.saved_note`` says why not), ``plan.decide`` makes
            ``Loaded.plan``, and the model is prepared for it (kept fp32 on the CPU for the
            ONNX Runtime backend, which exports it).
        text: build the raw-text encoders from the folder's ``prepare_glue.json``
            (``"required"``: an error without one; ``"optional"``: None then).
        fingerprint: compute ``Loaded.fingerprint`` (also computed for a saved policy and the
            ONNX Runtime backend).
        arg_overrides: fairseq config overrides (``{"bpe": ...}``); ``data`` is set here.
        data_flag, dtype_flag: how the caller's user gave the folder and the precision.
    Raises:
        CheckpointError: a precision the device cannot run, no such file or folder, not a
            prepared folder, a folder the checkpoint was not trained on
            (``training_data.check_folder``), a file that is not a fairseq checkpoint, a bad
            policy file, not a multi-exit model when one is needed, a plan that cannot run.
    """
    mark_in_use("inference loader")
    device = torch.device(device)
    bf16 = _flag(dtype_flag, "bf16")
    if request is not None:
        if dtype is not None:
            raise TypeError("load_for_inference: give the precision in request, not dtype")
        request = _checked(request)
        dtype = request.dtype
    if dtype is not None:
        try:
            dtype = check_precision(dtype)
        except ValueError:
            raise CheckpointError(
                f"{_flag(dtype_flag, str(dtype))}: must be one of fp32, bf16, int8"
            ) from None
        check_device(dtype, device, _flag(dtype_flag, dtype), f"add --cpu, or use {bf16}")
    if data is not None:
        check_data_folder(data, data_flag)
    saved = None
    if request is not None and request.reads_saved:
        try:
            saved = read_policy(path)  # the one read of the file
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if saved is None and request.policy == SAVED:
            _plan(request, None, "", None, None, path)  # no file: says so before loading

    overrides = dict(arg_overrides or {})
    if data is not None:
        overrides["data"] = str(data)
    state = read_checkpoint(path, overrides or None)
    weights = None
    if fingerprint or saved is not None or (request is not None and request.backend == ONNXRUNTIME):
        weights = model_fingerprint(state["model"])
    saved_note = ""
    if saved is not None and (saved_note := saved.mismatch(weights, path)):
        saved = None

    cfg = state.get("cfg")
    if data is None:
        data = checkpoint_data(state, path, data_flag)
        check_data_folder(data, "the checkpoint's data folder")
        cfg.task.data = str(data)  # the task reads the folder found (cfg's may be relative)
    data = str(data)
    meta = _read_meta(data, data_flag)
    num_classes = getattr(getattr(cfg, "task", None), "num_classes", None)
    folder = describe_folder(data, meta=meta)
    record = recorded(state)
    try:
        found = check_folder(record, folder, path, data_flag, num_classes)
    except DataMismatch as e:
        raise CheckpointError(str(e)) from None
    if label_order and found.labels != folder["labels"]:
        raise CheckpointError(
            f"{data}/label/dict.txt lists the labels of {path} in another order: its binarized "
            "targets are not the model's classes. Give the prepared folder it was trained on"
        )
    text_encoder = _text_encoder(meta, data, data_flag, text == "required") if text else None

    model, cfg, task = _build(path, state, data, data_flag, record)
    if multi_exit:
        _check_multi_exit(model, path)
    plan = None
    if request is not None:
        plan = _plan(request, saved, saved_note, model, task, path)
        dtype = plan.dtype
        if plan.onnxruntime:
            require_onnxruntime()  # its error names the install command
            device, dtype = torch.device("cpu"), None  # the fp32 model is exported
            weights = weights or model_fingerprint(state["model"])
        elif request.dtype is None and saved is not None:
            what = f"{dtype_flag} (default: {plan.dtype}, from {saved.path})"
            check_device(plan.dtype, device, what, f"add --cpu, or give {bf16}")
    model = model.to(device).eval()
    if dtype is not None:
        try:
            prepare_for_inference(model, dtype)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    loaded = Loaded(
        model=model, task=task, data=data, cfg=cfg, checkpoint=str(path), labels=found.labels,
        notes=found.notes, num_inputs=folder["num_inputs"], meta=meta,
        dtype=plan.dtype if plan is not None else dtype or "fp32", text=text_encoder,
        saved=saved, saved_note=saved_note, fingerprint=weights, plan=plan,
    )  # fmt: skip
    if text_encoder is not None:
        loaded.examples = ExampleEncoder.from_task(task, data, loaded.max_positions, text_encoder)
    return loaded


def _checked(request: Request) -> Request:
    try:
        return request.checked()
    except PlanError as e:
        raise CheckpointError(str(e)) from None


def _plan(
    request: Request, saved: Any, saved_note: str, model: Any, task: Any, path: str | Path
) -> Plan:
    """``plan.decide`` with what the built model can do; its errors as ``CheckpointError``."""
    shallow = bool(getattr(model, "shallow_exit_layers", ())) and hasattr(model, "early_exit")
    regression = bool(getattr(getattr(task, "cfg", None), "regression_target", False))
    kind = (
        f"a {type(model).__name__} with one exit"
        if not hasattr(model, "early_exit")
        else "a multi-exit model without shallow exits (trained with --exit-layers none, as "
        "stage 1 is)"
    )
    try:
        return decide(
            request, saved, saved_note, shallow_exits=shallow, regression=regression,
            what=str(path), model_kind=kind,
        )  # fmt: skip
    except PlanError as e:
        raise CheckpointError(str(e)) from None


def _build(path: str | Path, state: dict, data: str, flag: str, record: dict | None):
    """``(model, cfg, task)`` from the checkpoint read into ``state``: fairseq's model loading,
    called from this one place in the library."""
    from fairseq import checkpoint_utils

    from ..checkpoint.fits import loading_as

    trained_on = f" ({record['data']})" if record else ""
    fix = (
        "That folder was binarized with another dictionary than the checkpoint's: give the "
        f"prepared folder it was trained on{trained_on}"
    )
    try:
        with loading_as(f"cannot use {path} with {flag} {data}", fix):
            models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
                [str(path)], state=state
            )
    except ValueError as e:  # e.g. acl_fairseq.checkpoint.fits: another vocabulary
        message = str(e)
        raise CheckpointError(
            message if str(path) in message else f"{path} with {flag} {data}: {message}"
        ) from None
    return models[0], cfg, task


def _check_multi_exit(model: Any, path: str | Path) -> None:
    if not hasattr(model, "early_exit"):
        raise CheckpointError(
            f"{path} holds a {type(model).__name__}, not a multi-exit model "
            "(train it with --arch multi_exit_roberta*)"
        )
    if not model.shallow_exit_layers:
        raise CheckpointError(
            f"{path} has no shallow exit (a stage-1 checkpoint, trained with --exit-layers "
            "none): early exit needs the multi-exit stage 2: fairseq-train --arch "
            f"multi_exit_roberta* --criterion acl_cross_layer --restore-file {path} (exits "
            "after every layer by default; docs/usage.md, Methods)"
        )
