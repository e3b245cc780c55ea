"""Loads fairseq checkpoints under torch >= 2.6 and stops early on the wrong checkpoint.

torch >= 2.6 loads with ``weights_only=True``, which refuses the ``argparse.Namespace`` in
fairseq checkpoints. :func:`install` wraps ``checkpoint_utils.load_checkpoint_to_cpu`` (every
fairseq entry point's load) to allow-list, during that call only, the plain-data classes they
hold (in every run: ``acl_fairseq.fairseq_patches``); where the guard rails act, a file that is
no fairseq checkpoint also gets a message saying what to do (elsewhere fairseq's error).
:func:`check_restore_file`: a missing explicit ``--restore-file`` stops the run (fairseq would
train from random weights).
"""

import argparse
import contextlib
import contextvars
import functools
import logging
import os
import pickle
import zipfile

import numpy as np
import torch
from fairseq import checkpoint_utils
from fairseq.file_io import PathManager

from ..errors import AclFileNotFoundError, AclIsADirectoryError, AclValueError

__all__ = ["install", "SAFE_GLOBALS", "check_restore_file", "damaged", "named_as"]

logger = logging.getLogger(__name__)

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

DEFAULT_RESTORE_FILE = "checkpoint_last.pt"
CONVERTER = "acl-fairseq-convert-bert HF_DIR OUTDIR"
FAIRSEQ_CHECKPOINT = (
    "A fairseq checkpoint is a torch file holding a dict with 'model' (the state dict) and "
    "'args' or 'cfg' (the model's configuration), as fairseq-train writes (checkpoint_*.pt) "
    "and as released fairseq models come (roberta.base/model.pt)"
)
# How the file being loaded was named; load_checkpoint sets it to the --restore-file flag.
_SOURCE = contextvars.ContextVar(
    "acl_fairseq_checkpoint_source",
    default="the checkpoint (--restore-file, --finetune-from-model, --path or from_pretrained)",
)


@contextlib.contextmanager
def named_as(source: str):
    """Within the block, loading errors name the file as ``source`` (e.g. ``the checkpoint``)."""
    token = _SOURCE.set(source)
    try:
        yield
    finally:
        _SOURCE.reset(token)


_HF_BERT_PREFIXES = ("bert.", "embeddings.", "encoder.layer.", "pooler.", "cls.")


# ----------------------------------------------------------------- what a file is
def _is_safetensors(path: str) -> bool:
    if str(path).endswith(".safetensors"):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(10)
    except OSError:
        return False
    return len(head) == 10 and head[8:10] == b'{"'  # u64 header length, then a JSON header


def _hf_message(path: str, kind: str) -> str:
    return (
        f"{_SOURCE.get()}: {path} is a Hugging Face BERT checkpoint ({kind}), not a fairseq "
        f"one. Convert its folder (config.json, vocab.txt and the weights) with `{CONVERTER}`, "
        "then pass --restore-file OUTDIR/model.pt with the model flags in "
        "OUTDIR/fairseq_args.txt, and binarize the data with --srcdict OUTDIR/dict.txt"
    )


def _not_fairseq_message(path: str, found: str) -> str:
    return f"{_SOURCE.get()}: {path} is not a fairseq checkpoint ({found}). {FAIRSEQ_CHECKPOINT}"


def diagnose(path: str) -> str | None:
    """Why ``path`` is not a fairseq checkpoint, or None if it may be one (or cannot be read);
    read with ``weights_only=True``, which runs no code from the file."""
    if _is_safetensors(path):
        return _hf_message(path, "a .safetensors file")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return None
    if not isinstance(state, dict):
        return _not_fairseq_message(path, f"it holds a {type(state).__name__}, not a dict")
    if "model" in state:
        return None
    keys = [str(k) for k in state]
    if any(k.startswith(_HF_BERT_PREFIXES) for k in keys):
        example = next(k for k in keys if k.startswith(_HF_BERT_PREFIXES))
        return _hf_message(path, f"a state dict with keys such as '{example}'")
    shown = ", ".join(repr(k) for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
    return _not_fairseq_message(path, f"a dict without a 'model' key; its keys: {shown or 'none'}")


def damaged(path: str) -> str | None:
    """Why ``path`` cannot be a torch file at all (empty, truncated, other bytes), or None."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return None
    if size == 0:
        return "is empty (0 bytes)"
    if head.startswith(b"PK\x03\x04"):  # torch's zip format
        if not zipfile.is_zipfile(path):
            return f"is truncated: an incomplete torch archive of {size:,} bytes"
        return None  # a whole archive: what failed is inside (torch's message says what)
    if head.startswith(b"\x80"):  # a pickle: the legacy torch format
        return None
    if all(32 <= b < 127 or b in b"\t\r\n" for b in head):  # printable: an error page?
        return f"is a text file ({size:,} bytes; a failed download?), not a torch file"
    return f"is not a torch file ({size:,} bytes that are neither a torch archive nor a pickle)"


def _damaged_message(path: str, what: str) -> str:
    return (
        f"{_SOURCE.get()}: {path} {what}, so it cannot be loaded: copy or download it again "
        "(or train it again)"
    )


def _check_loadable(load_fn):
    @functools.wraps(load_fn)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        named = _named()  # else fairseq's own errors, unchanged
        if named and PathManager.isfile(path) and _is_safetensors(path):
            raise AclValueError(diagnose(path))
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            try:
                return load_fn(path, *args, **kwargs)
            except Exception as e:
                if not named or not PathManager.isfile(path):
                    raise
                what = damaged(path)
                if what is not None:
                    raise AclValueError(_damaged_message(path, what)) from None
                why = diagnose(path)
                if why is not None:
                    raise AclValueError(why) from e
                if isinstance(e, pickle.UnpicklingError) and "Unsupported global" in str(e):
                    raise pickle.UnpicklingError(
                        f"{path}: this checkpoint holds objects outside the set that "
                        f"acl_fairseq allows for fairseq checkpoints ({e}). If you trust the "
                        "file, load it once with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 and save "
                        "it again."
                    ) from e
                raise

    load_checkpoint_to_cpu._acl_fairseq_safe = True  # type: ignore[attr-defined]
    return load_checkpoint_to_cpu


# ----------------------------------------------------------------- --restore-file
def check_restore_file(cfg, suffix: str | None = "") -> str | None:
    """Raises when an explicit ``--restore-file`` (``cfg``: fairseq's checkpoint config)
    names no file; the path fairseq will restore, None for the default (may be missing)."""
    restore = cfg.restore_file
    last = os.path.join(cfg.save_dir, f"checkpoint_last{suffix or ''}.pt")
    if restore == DEFAULT_RESTORE_FILE:
        return None
    path = restore.replace(".pt", suffix + ".pt") if suffix is not None else restore
    if PathManager.isfile(path):
        if PathManager.isfile(last) and os.path.abspath(path) != os.path.abspath(last):
            logger.warning(
                f"--restore-file {path} is given, so fairseq restores it and not {last}: this "
                f"run starts over from {path}. To resume instead, pass --restore-file {last} "
                "(or leave --restore-file at its default)"
            )
        return path
    if os.path.abspath(path) == os.path.abspath(last):
        return path  # the default's file, named explicitly: nothing to resume yet
    named = restore if path == restore else f"{restore} (read as {path})"
    if PathManager.exists(path):
        fix = _folder_fix(path)
        raise AclIsADirectoryError(
            f"--restore-file (checkpoint.restore_file) {named} is a folder: {fix}"
        )
    raise AclFileNotFoundError(
        f"--restore-file (checkpoint.restore_file) {named}: no such file, and fairseq would "
        "train from randomly initialised weights. Pass the path of a fairseq checkpoint (e.g. "
        f"roberta.base/model.pt), or leave --restore-file at its default ({DEFAULT_RESTORE_FILE}"
        f": resume from {last} if it exists, else start from scratch)"
    )


def _folder_fix(path: str) -> str:
    """What to pass instead of the folder ``path`` as ``--restore-file``."""
    names = ("model.pt", "checkpoint_best.pt", "checkpoint_last.pt")
    inside = [os.path.join(path, f) for f in names if PathManager.isfile(os.path.join(path, f))]
    if inside:
        flags = os.path.join(path, "fairseq_args.txt")
        with_flags = f" with the model flags in {flags}" if PathManager.isfile(flags) else ""
        return f"pass the checkpoint file inside it, --restore-file {inside[0]}{with_flags}"
    hf = any(PathManager.exists(os.path.join(path, f)) for f in ("config.json", "vocab.txt"))
    if hf:
        return (
            f"it holds a Hugging Face model: convert it with `{CONVERTER}` and pass "
            "--restore-file OUTDIR/model.pt"
        )
    return "pass the checkpoint file inside it (e.g. model.pt or checkpoint_best.pt)"


#: Whether a file that is no fairseq checkpoint is named, with the fix (the guard rails act).
_named = bool


def install(named) -> None:
    """Idempotent: wraps ``checkpoint_utils.load_checkpoint_to_cpu``; ``named()``: whether a
    file that is no fairseq checkpoint is named, with the fix (else fairseq's error)."""
    global _named
    _named = named
    current = checkpoint_utils.load_checkpoint_to_cpu
    if not getattr(current, "_acl_fairseq_safe", False):
        checkpoint_utils.load_checkpoint_to_cpu = _check_loadable(current)
