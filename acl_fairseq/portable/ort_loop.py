"""The early-exit loop on ONNX Runtime sessions of a model's segments, on numpy: what
``runtime.onnx_runtime.OrtEarlyExit`` and the bundle's runner both run.

A segment runs the encoder layers after the previous exit up to its exit's layer and that
exit's head (``runtime.onnx_runtime`` exports them). Inputs ``x`` (tokens B x T int64 for the
first segment, else the hidden states T x B x C float32) and ``padding_mask`` (B x T bool);
outputs ``hidden`` (the next segment's ``x``) and ``logits`` (B x K float32), the last segment
``logits`` only. ``run_early_exit`` walks the segments, deciding at each shallow exit
(``decide.Decision``) with ``rows.RunningRows``; one unpadded row, or full depth (one
segment), runs without row bookkeeping.

Sessions (``session``): on the CPU, every graph optimization but those named, one inter-op
thread; on their own intra-op threads (sleeping when idle: segments run one after the other and
spinning threads would take the next session's cores), or on the process's global thread pool
(``global_pool``), which segments run one after the other use without waking each other's
threads. onnxruntime is imported when a session is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from .rows import Decider, ExitResult, RunningRows, row_result

__all__ = ["INT8_DISABLED", "global_pool", "import_onnxruntime", "run_early_exit", "session"]

INT8_DISABLED = ("SkipLayerNormFusion",)
"""Graph optimizations left out of the int8 sessions: fusing the residual add into the layer
norm made the int8 encoder slower on x86 CPUs (docs/results.md, "Inference against its
anchors")."""

_GLOBAL_POOL: list[int] = []
"""The intra-op threads of this process's global ONNX Runtime thread pool once made (0: made
by another caller, size unknown)."""


def import_onnxruntime() -> ModuleType:
    """The ``onnxruntime`` module; ``ImportError`` naming the install command."""
    try:
        import onnxruntime
    except ImportError as e:
        raise ImportError(f"the early-exit segments run on onnxruntime ({e}): pip install "
                          "onnxruntime") from None  # fmt: skip
    return onnxruntime


def global_pool(threads: int | None = None) -> int | None:
    """The intra-op threads of this process's global ONNX Runtime thread pool, or None while it
    is not made; ``threads``: make it with that many if not yet made. One pool per process, its
    size fixed once made, and every session made after it runs on it (ONNX Runtime's rule)."""
    if threads is not None and not _GLOBAL_POOL:
        ort = import_onnxruntime()
        try:
            ort.capi._pybind_state.set_global_thread_pool_sizes(threads, 1)
            _GLOBAL_POOL.append(threads)
        except AttributeError:  # an ONNX Runtime without the call: per-session threads
            pass
        except RuntimeError:  # already made by another caller
            _GLOBAL_POOL.append(0)
    return _GLOBAL_POOL[0] if _GLOBAL_POOL else None


def session(
    path: Any,
    threads: int,
    spinning: bool = True,
    shared: bool = False,
    disabled_optimizers: Sequence[str] = (),
) -> Any:
    """An ``InferenceSession`` of ``path`` on the CPU: ``threads`` intra-op threads, one
    inter-op thread, every graph optimization but ``disabled_optimizers`` (ONNX Runtime's
    names, e.g. ``INT8_DISABLED``); ``spinning=False``: its idle threads sleep.

    ``shared``: on the process's global thread pool (``global_pool``, made with ``threads``
    threads on first use). Once the pool is made, every session runs on it, at its size."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    if global_pool(threads if shared else None) is not None:
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    extra = {"disabled_optimizers": list(disabled_optimizers)} if disabled_optimizers else {}
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"], **extra)


def run_early_exit(
    segments: Sequence[tuple[int, Any]],
    tokens: np.ndarray,
    pad: int,
    decider: Decider | None,
    num_layers: int,
) -> ExitResult:
    """The early exit of ``tokens`` (B x T int64, ``pad`` at padding) on ``segments``
    (``[(exit layer, session)]``: the policy's shallow exits in order, then the last layer;
    one segment: full depth, ``decider`` unused) -> ``ExitResult`` (numpy)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    mask = tokens == pad  # B x T
    x: np.ndarray = tokens
    if len(segments) == 1 or (tokens.shape[0] == 1 and not mask.any()):  # no row bookkeeping
        assert decider is not None or len(segments) == 1
        state = decider.init_state(1) if decider is not None else {}
        for layer, segment in segments:
            *hidden, logits = segment.run(None, {"x": x, "padding_mask": mask})
            if layer == num_layers:
                break
            leave, state = decider.decide(logits, state)  # type: ignore[union-attr]
            if leave[0]:
                break
            x = hidden[0]
        return row_result(logits, layer)
    assert decider is not None
    running = RunningRows(decider, mask, num_layers)
    for layer, segment in segments:
        outs = segment.run(None, {"x": x, "padding_mask": mask})
        keep = running.at_exit(layer, outs[-1])
        if running.done:
            break
        x = outs[0]
        if keep is not None:  # some rows left: keep the others (and their width)
            x = np.ascontiguousarray(x[: running.width, keep])
            mask = np.ascontiguousarray(running.padding_mask)
    return running.result()
