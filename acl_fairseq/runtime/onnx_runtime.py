"""Early exit on ONNX Runtime: the multi-exit model exported segment by segment, the same loop.

For the exits a policy decides at, the model is cut into segments: segment ``i`` runs the
encoder layers after the previous exit up to and including its exit's layer (the first one
starts with the embedding) and that exit's head (``exit_hidden``, ``pool``, ``classify``), in one
ONNX graph. Inputs: ``x`` (tokens B x T int64 for the first segment, else the hidden states
T x B x C float32) and ``padding_mask`` (B x T bool, True at padding; all False without
padding: a masked position gets no attention, so an all-False mask is the unmasked layer).
Outputs: ``hidden`` (T x B x C, the next segment's ``x``) and ``logits`` (B x K float32); the
last segment ends at the final layer with the final head and outputs ``logits`` only. Batch and
time are dynamic axes.

``OrtEarlyExit`` exports the segments and runs them with ``portable.ort_loop`` (one
``onnxruntime.InferenceSession`` per segment, ``fp32``, or ``int8``: ``quantize_dynamic`` with
int8 weights per channel, its sessions without ``INT8_DISABLED``'s fusion): the loop, the
decision (``portable.decide``) and the row bookkeeping (``portable.rows``) on numpy, the same
code the bundle's runner runs without torch. A policy that never exits runs one full-depth
session; one unpadded row runs without row bookkeeping. The fairseq model is the reference the
tests compare it with.

Exported files are cached under the folder given, in a folder named by the model's content
fingerprint (``checkpoint.fingerprint``), its head and the export format; one file per
segment and precision (``layers{FIRST}-{LAST}.{TAG}.onnx``, ``segment_tag``: int8 with 7-bit
weights on a CPU without VNNI is its own file), so exit sets that share a segment
share its file and a second load exports nothing. A cached file that ONNX Runtime cannot load
(cut short, emptied, overwritten) is exported again, once; the cache folder is checked before
anything is exported (``check_cache_folder``: one line naming ``--onnx-cache``).
onnxruntime is optional and imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..atomic_write import describe_failure, write_text, write_with
from ..checkpoint.fingerprint import model_fingerprint
from ..cpu_features import has_vnni
from ..early_exit.policies import ExitPolicy, as_policy
from ..errors import AclFairseqError, AclOSError, AclRuntimeError, AclValueError
from ..portable import ort_loop
from ..portable.ort_loop import INT8_DISABLED, global_pool
from ..portable.ort_loop import session as ort_session
from .precision import model_precision
from .rows import EarlyExitResult, host_decider, to_torch

__all__ = [
    "BACKENDS",
    "INSTALL",
    "INT8_DISABLED",
    "ONNX_CACHE",
    "ORT_DTYPES",
    "ExitLogits",
    "OnnxRuntimeMissing",
    "OrtEarlyExit",
    "check_cache_folder",
    "export_onnx",
    "export_segment",
    "global_pool",
    "ort_session",
    "quantize_int8",
    "require_onnxruntime",
]

INSTALL = "pip install onnxruntime onnx onnxscript"
ORT_DTYPES = ("fp32", "int8")
BACKENDS = ("fairseq", "onnxruntime")
"""What runs a model in the tools' ``--backend``: torch (fairseq), or this module."""
ONNX_CACHE = "onnx_runtime"
"""The tools' default cache of exported segments, a folder next to the checkpoint."""
OPSET = 17
FORMAT = 2
"""The segments' graph format: cached files of another format are not reused (2: each file has
its checksum beside it, ``NAME.sha256``)."""
CHECKSUM = ".sha256"


class OnnxRuntimeMissing(AclFairseqError, ImportError):
    """onnxruntime or onnx is not installed; the message names the install command."""


def require_onnxruntime() -> ModuleType:
    """The ``onnxruntime`` module (``onnx`` is needed too: the exporter and the quantizer)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime
    except ImportError as e:
        raise OnnxRuntimeMissing(
            f"the ONNX Runtime backend needs onnxruntime and onnx ({e}): {INSTALL} "
            "(or pip install -e .[bench])"
        ) from None
    return onnxruntime


def export_onnx(
    module: nn.Module,
    args: tuple[Tensor, ...],
    path: Path,
    inputs: Sequence[str],
    outputs: Sequence[str],
    axes: dict[str, dict[int, str]],
) -> None:
    """``module`` (eval mode) traced on ``args`` into the ONNX file ``path`` (TorchScript
    exporter, opset 17); ``axes``: the dynamic axes of each input and output by name."""
    require_onnxruntime()
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notice, tracer warnings
        torch.onnx.export(
            module, args, str(path), input_names=list(inputs), output_names=list(outputs),
            dynamic_axes=axes, opset_version=OPSET, dynamo=False,
        )  # fmt: skip
    module.eval()  # the exporter restores the module's mode: keep it in eval mode


def check_cache_folder(folder: str | Path, flag: str = "--onnx-cache") -> Path:
    """``folder``, created (with its parents) and writable, for the exported segments; else an
    ``AclOSError`` naming ``flag`` and the fix (a file in the way, a folder that cannot be
    created or written)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        in_way = isinstance(e, (FileExistsError, NotADirectoryError))
        reason = "a file is in the way" if in_way else (e.strerror or str(e)).lower()
        raise AclOSError(
            f"{flag} {folder}: cannot create the folder of the exported ONNX segments "
            f"({reason}): give {flag} a folder you may write to"
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AclOSError(
            f"{flag} {folder}: the folder of the exported ONNX segments is not writable: give "
            f"{flag} a folder you may write to"
        )
    return folder


def weight_bits() -> int:
    """The bits of the int8 segments' weights on this CPU: 8 with 8-bit dot-product
    instructions (``cpu_features.has_vnni``), else 7: without them the u8 x s8 products are
    summed in pairs into 16 bits, which saturate with full-range weights (ONNX Runtime's
    ``reduce_range``; on an AVX2 CPU full-range int8 changed a quarter of a tiny model's
    predictions)."""
    return 8 if has_vnni() else 7


def segment_tag(dtype: str) -> str:
    """A segment file's precision tag: ``fp32``, ``int8`` (8-bit weights) or ``int8w7``."""
    return "int8w7" if dtype == "int8" and weight_bits() == 7 else dtype


def quantize_int8(source: Path, target: Path, bits: int | None = None) -> None:
    """ONNX Runtime's dynamic quantization of ``source`` into ``target``: int8 weights per
    channel with ``bits`` of range (default: ``weight_bits()``), activations quantized at run
    time."""
    require_onnxruntime()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    reduce_range = (bits or weight_bits()) == 7
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the quantizer's notes on every tensor, to the root logger
    try:
        quantize_dynamic(
            str(source), str(target), weight_type=QuantType.QInt8, per_channel=True,
            reduce_range=reduce_range,
        )  # fmt: skip
    finally:
        logging.disable(previous)


class _Segment(nn.Module):
    """Layers ``first..last`` (1-based) of ``model`` and ``head`` on them (the module
    docstring's graph); ``first == 1`` starts from the tokens, with the embedding."""

    def __init__(self, model: Any, head: nn.Module, first: int, last: int) -> None:
        super().__init__()
        self.model, self.head = model, head  # the graph holds only the weights that run
        self.layers = model.encoder.sentence_encoder.layers[first - 1 : last]
        self.first, self.final = first, last == int(model.num_layers)

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if self.first == 1:  # B x T tokens -> T x B x C, as TransformerEncoder.forward
            x, _ = self.model.encoder.sentence_encoder.forward_embedding(x)
            x = (x * (1 - padding_mask.unsqueeze(-1).type_as(x))).transpose(0, 1)
        for layer in self.layers:
            out = layer(x, encoder_padding_mask=padding_mask)
            x = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        seen = x[:1] if self.head.pooling == "first" else x
        features = self.model.exit_hidden(seen).transpose(0, 1)  # B x T' x C
        logits = self.head.classify(self.head.pool(features, padding_mask=padding_mask))[0]
        return logits if self.final else (x, logits)


def export_segment(model: Any, head: nn.Module, first: int, last: int, path: Path) -> None:
    """The segment of layers ``first..last`` of ``model`` (fp32, eval mode) and ``head`` (the
    exit at ``last``) as the ONNX file ``path``."""
    segment = _Segment(model, head, first, last).eval()
    encoder = model.encoder.sentence_encoder
    pad = int(encoder.padding_idx)
    with torch.inference_mode(False):  # sample inputs the tracer may keep
        mask = torch.zeros(2, 5, dtype=torch.bool)
        mask[1, 3:] = True  # the trace sees a padded row; the graph takes any mask
        if first == 1:
            x = torch.full((2, 5), pad + 1, dtype=torch.long).masked_fill(mask, pad)
        else:
            x = torch.zeros(5, 2, encoder.embed_tokens.embedding_dim)
    x_axes = {0: "batch", 1: "time"} if first == 1 else {0: "time", 1: "batch"}
    outputs = ["logits"] if segment.final else ["hidden", "logits"]
    axes = {"x": x_axes, "padding_mask": {0: "batch", 1: "time"}, "logits": {0: "batch"}}
    if not segment.final:
        axes["hidden"] = {0: "time", 1: "batch"}
    export_onnx(segment, (x, mask), path, ["x", "padding_mask"], outputs, axes)


def _checksum(path: Path) -> str:
    """sha256 of the file ``path`` (a cached segment)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _recorded_checksum(path: Path) -> str | None:
    """The checksum written beside ``path`` when it was exported; None if there is none."""
    try:
        return path.with_name(path.name + CHECKSUM).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


class ExitLogits(NamedTuple):
    """One exit's logits (``exit_outputs``; what ``thresholds.collect_exits`` reads)."""

    layer: int
    logits: Tensor  # B x K float32


class OrtEarlyExit:
    """The early-exit loop of ``model`` (a ``MultiExitRobertaModel``, fp32, eval mode, CPU) on
    ONNX Runtime sessions of its segments at ``dtype`` (``fp32`` or ``int8``), head group
    ``head``; files cached under ``folder``; ``threads``: each session's intra-op threads
    (default ``torch.get_num_threads()``); ``fingerprint``: the checkpoint's
    ``model_fingerprint`` (``Loaded.fingerprint``; default: that of ``model.state_dict()``);
    ``shared_pool``: the sessions on the process's global thread pool (``ort_session``):
    faster at batch 1 on several threads, but every ONNX Runtime session made in the process
    afterwards runs on that pool (a command's own process, not a library call's).

    It offers the model's inference calls: ``early_exit``, ``exit_outputs`` and
    ``runner(tokens)[0]`` (full-depth logits). Segments are exported and their sessions made
    on first use (``prepare``); ``model`` must stay fp32 until then.
    """

    def __init__(
        self,
        model: Any,
        head: str,
        folder: str | Path,
        dtype: str = "fp32",
        threads: int | None = None,
        fingerprint: str | None = None,
        shared_pool: bool = False,
    ) -> None:
        require_onnxruntime()
        if dtype not in ORT_DTYPES:
            raise AclValueError(f"ONNX Runtime backend: dtype must be fp32 or int8, got {dtype!r}")
        if not hasattr(model, "exit_heads"):
            raise AclValueError(
                f"ONNX Runtime backend: needs a multi-exit model (--arch multi_exit_roberta*), "
                f"not a {type(model).__name__}"
            )
        if model_precision(model) != "fp32" or model.training:
            raise AclValueError(
                "ONNX Runtime backend: export needs the fp32 model in eval mode (load it "
                f"without --dtype); got {model_precision(model)}"
            )
        self.model, self.head, self.dtype = model, head, dtype
        self.heads = dict(model.exit_heads(head))  # {layer: exit head}, the final included
        self.num_layers = int(model.num_layers)
        self.shallow_exit_layers: tuple[int, ...] = tuple(model.shallow_exit_layers)
        self.pad = int(model.encoder.sentence_encoder.padding_idx)
        self.threads = threads or torch.get_num_threads()
        self.shared_pool = shared_pool
        fingerprint = fingerprint or model_fingerprint(model.state_dict())
        pooling = self.heads[self.num_layers].pooling
        key = json.dumps([fingerprint, head, pooling, FORMAT, OPSET])
        tag = hashlib.sha256(key.encode()).hexdigest()[:8]
        self.folder = check_cache_folder(folder) / f"onnx-{fingerprint[:16]}-{tag}"
        self._sessions: dict[tuple[int, int], Any] = {}

    def segment_file(self, first: int, last: int, dtype: str | None = None) -> Path:
        """The ONNX file of layers ``first..last`` at ``dtype`` (default: the runner's),
        exported (int8: quantized from the fp32 file) unless already cached. Written beside
        and renamed: a full disk leaves no partial file (one line naming the disk)."""
        dtype = dtype or self.dtype
        path = self.folder / f"layers{first}-{last}.{segment_tag(dtype)}.onnx"
        if path.is_file():
            if _checksum(path) == _recorded_checksum(path):
                return path
            # a file that is not the one exported here (cut, overwritten, another segment's)
            self._reexport(path, ValueError("not the file exported here: its checksum differs"))
        check_cache_folder(self.folder)
        source = self.segment_file(first, last, "fp32") if dtype == "int8" else None

        def write(tmp: str) -> None:
            if source is not None:
                quantize_int8(source, Path(tmp))
            else:
                export_segment(self.model, self.heads[last], first, last, Path(tmp))

        try:
            write_with(path, write)
        except AclFairseqError:
            raise
        except Exception as e:
            if source is None or not self._unreadable(source, e):
                raise
            self._reexport(source, e)  # a damaged cached fp32 file: made again, then quantized
            self.segment_file(first, last, "fp32")
            write_with(path, write)
        write_text(path.with_name(path.name + CHECKSUM), _checksum(path) + "\n")
        return path

    @staticmethod
    def _unreadable(path: Path, error: Exception) -> bool:
        """Whether ``error`` (of ONNX Runtime or onnx reading ``path``) says the file is not a
        model: cut short, emptied or overwritten."""
        return path.is_file() and not isinstance(error, (AclFairseqError, MemoryError))

    def _reexport(self, path: Path, error: Exception) -> None:
        """Removes the cached ``path`` that could not be loaded (``error``), with a note; the
        next ``segment_file`` exports it again."""
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        logging.getLogger(__name__).warning(
            "%s: the cached ONNX segment could not be loaded (%s): exported again", path,
            first_line,
        )  # fmt: skip
        try:
            path.unlink()
        except OSError as e:
            raise AclOSError(describe_failure(path, e, True)) from None

    def _session(self, first: int, last: int) -> Any:
        """The session of layers ``first..last`` at the runner's precision; a cached file that
        does not load is exported again once (then, still failing, named with the command that
        clears the cache)."""
        path = self.segment_file(first, last)
        options = {"spinning": False, "shared": self.shared_pool}
        options["disabled_optimizers"] = INT8_DISABLED if self.dtype == "int8" else ()
        try:
            return ort_session(path, self.threads, **options)
        except AclFairseqError:
            raise
        except Exception as e:
            if not self._unreadable(path, e):
                raise
            self._reexport(path, e)
            if self.dtype == "int8":  # its fp32 source may be the damaged one
                fp32 = self.folder / f"layers{first}-{last}.fp32.onnx"
                if fp32.is_file():
                    fp32.unlink()
            path = self.segment_file(first, last)
        try:
            return ort_session(path, self.threads, **options)
        except Exception as e:
            raise AclRuntimeError(
                f"{path}: ONNX Runtime cannot load the segment, exported again just now "
                f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}): "
                f"clear the cache (rm -r {self.folder}) and run again"
            ) from None

    def spans(self, exits: Sequence[int]) -> list[tuple[int, int]]:
        """``[(first, last)]`` layers of the segments ending at ``exits`` (shallow, in order)
        and at the last layer."""
        lasts = [*exits, self.num_layers]
        return list(zip([1, *(last + 1 for last in lasts[:-1])], lasts))

    def segments(self, exits: Sequence[int]) -> list[tuple[int, Any]]:
        """``[(exit layer, session)]`` of the segments ``spans(exits)``."""
        out = []
        for first, last in self.spans(exits):
            if (first, last) not in self._sessions:
                self._sessions[first, last] = self._session(first, last)
            out.append((last, self._sessions[first, last]))
        return out

    def exits_of(self, policy: ExitPolicy) -> tuple[int, ...]:
        """The shallow exits ``policy`` runs at: none when it never exits (full depth)."""
        exits = tuple(policy.exits(self.shallow_exit_layers))
        return () if policy.never_exits(len(exits)) else exits

    def prepare(self, policy: ExitPolicy | str) -> None:
        """Exports (or loads) the segments of ``policy`` now, not at its first batch."""
        self.segments(self.exits_of(as_policy(policy)))

    def _check_head(self, name: str | None) -> None:
        if name is not None and name != self.head:
            raise AclValueError(f"ONNX Runtime backend: built for head {self.head!r}, not {name!r}")

    def __call__(self, src_tokens: Tensor, classification_head_name: str | None = None):
        """``(logits B x K, None)`` of the full-depth model (one session)."""
        self._check_head(classification_head_name)
        tokens = src_tokens.cpu().numpy()
        result = ort_loop.run_early_exit(self.segments(()), tokens, self.pad, None, self.num_layers)
        return torch.from_numpy(result.logits), None

    def exit_outputs(
        self, src_tokens: Tensor, classification_head_name: str | None = None, **unused: Any
    ) -> list[ExitLogits]:
        """Every exit's logits on every row (B x T ``src_tokens``), by layer, the final last."""
        self._check_head(classification_head_name)
        tokens = src_tokens.cpu()
        x, mask, out = tokens.numpy(), tokens.eq(self.pad).numpy(), []
        for layer, session in self.segments(self.shallow_exit_layers):
            *hidden, logits = session.run(None, {"x": x, "padding_mask": mask})
            out.append(ExitLogits(layer, torch.from_numpy(logits)))
            x = hidden[0] if hidden else x
        return out

    def early_exit(
        self,
        src_tokens: Tensor,
        policy: ExitPolicy | str,
        classification_head_name: str | None = None,
        **unused: Any,
    ) -> EarlyExitResult:
        """``run_early_exit`` on the sessions (``portable.ort_loop``, numpy): ``src_tokens``
        B x T -> ``EarlyExitResult(predictions B, exit_layers B, logits B x K)``."""
        self._check_head(classification_head_name)
        policy = as_policy(policy)
        segments = self.segments(self.exits_of(policy))
        tokens = src_tokens.cpu().numpy()
        decider = host_decider(policy)
        return to_torch(
            ort_loop.run_early_exit(segments, tokens, self.pad, decider, self.num_layers)
        )
