"""Numeric precision for inference: ``fp32``, ``bf16`` or ``int8`` (RoBERTa / multi-exit).

``prepare_for_inference(model, dtype)`` turns a fairseq ``RobertaModel`` (plain or
``MultiExitRobertaModel``) into an inference model of that precision, in place, in eval mode;
the exit heads go with the encoder and every head returns float32 logits, so the exit
decisions are float32 at every precision.

* ``fp32``: the model as trained.
* ``bf16``: every weight stored in bfloat16 (not autocast, which re-casts weights per call);
  each head's tiny ``out_proj`` stays float32 (``Float32Logits``).
* ``int8``: torch's dynamic quantization (FBGEMM) of every encoder ``nn.Linear`` and every
  head's ``dense``; CPU only. fairseq's attention fast path, which reads the float weights
  directly, is switched off so the quantized projections run (``quantized_linears``).

Why these choices, and the int8 caveats: docs/inference.md, "Precisions". No fairseq import.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cpu_features import has_vnni

__all__ = [
    "PRECISIONS",
    "Float32Logits",
    "check_precision",
    "model_precision",
    "prepare_for_inference",
    "quantized_linears",
]

PRECISIONS = ("fp32", "bf16", "int8")
_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "qint8": "int8"}
_ATTRIBUTE = "inference_precision"


def check_precision(dtype: str) -> str:
    """The canonical name (``fp32``, ``bf16``, ``int8``) of ``dtype``, or a ``ValueError``
    naming ``--dtype`` (also accepts ``float32``, ``bfloat16``)."""
    name = str(dtype).strip().lower()
    name = _ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(f"--dtype must be one of {', '.join(PRECISIONS)}, got {dtype!r}")
    return name


def model_precision(model: nn.Module) -> str:
    """The precision ``prepare_for_inference`` gave ``model`` (``fp32`` when never prepared)."""
    return str(getattr(model, _ATTRIBUTE, "fp32"))


class Float32Logits(nn.Linear):
    """A head's ``out_proj`` kept in float32 in a low-precision model: its input (B x C, any
    float dtype) is cast to float32, so the logits (B x K) are float32."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float32Logits:
        """A float32 copy of ``linear`` (same weights)."""
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        with torch.no_grad():
            out.weight.copy_(linear.weight.float())
            if linear.bias is not None:
                out.bias.copy_(linear.bias.float())
        return out.to(linear.weight.device)


def _dynamic_linear_class(full_range: bool) -> type:
    """torch's dynamically quantized ``Linear``, or a subclass that quantizes activations to
    all 8 bits. torch's module asks FBGEMM for 7-bit activations (``reduce_range=True``), which
    keeps ``VPMADDUBSW``'s 16-bit sums from saturating on CPUs without VNNI; with VNNI the
    products accumulate in 32 bits and the full range is exact (docs/inference.md has the
    effect on predictions)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    if not full_range:
        return DynamicQuantizedLinear

    class FullRangeDynamicLinear(DynamicQuantizedLinear):
        """Dynamic int8 linear with 8-bit (not 7-bit) activations."""

        reduce_range = False

        def forward(self, x: Tensor) -> Tensor:
            packed = self._packed_params._packed_params
            return torch.ops.quantized.linear_dynamic(x, packed, reduce_range=False).to(x.dtype)

    return FullRangeDynamicLinear


def _sentence_encoder(model: nn.Module) -> nn.Module:
    encoder = getattr(getattr(model, "encoder", None), "sentence_encoder", None)
    if encoder is None or not hasattr(encoder, "layers"):
        raise TypeError(
            f"--dtype: expected a fairseq RoBERTa model (model.encoder.sentence_encoder.layers), "
            f"got a {type(model).__name__}"
        )
    return encoder


def _heads(model: nn.Module) -> dict[str, nn.Module]:
    return dict(getattr(model, "classification_heads", {}) or {})


def _int8_targets(model: nn.Module) -> list[str]:
    """Qualified names of the ``nn.Linear`` modules int8 quantizes: every Linear inside the
    encoder layers, and each classification head's ``dense``."""
    encoder = _sentence_encoder(model)
    names = []
    prefix = {id(m): n for n, m in model.named_modules()}
    for layer in encoder.layers:
        base = prefix[id(layer)]
        names += [f"{base}.{n}" for n, m in layer.named_modules() if type(m) is nn.Linear and n]
    for head in _heads(model).values():
        if isinstance(getattr(head, "dense", None), nn.Linear):
            names.append(f"{prefix[id(head)]}.dense")
    return names


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in _sentence_encoder(model).modules() if hasattr(m, "skip_embed_dim_check")]


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: module}`` of the dynamically quantized linear layers of ``model``."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, DynamicQuantizedLinear)}


def _float32_heads(model: nn.Module) -> None:
    for head in _heads(model).values():
        out_proj = getattr(head, "out_proj", None)
        if isinstance(out_proj, nn.Linear) and not isinstance(out_proj, Float32Logits):
            head.out_proj = Float32Logits.from_linear(out_proj)


def _quantize(model: nn.Module, spec: dict[str, Any], full_range: bool | None) -> None:
    """``quantize_dynamic`` of the named linear layers, in place (8-bit activations when the
    CPU has VNNI, unless ``full_range`` says otherwise)."""
    from torch.ao.quantization import quantize_dynamic

    full_range = has_vnni() if full_range is None else full_range
    mapping = {nn.Linear: _dynamic_linear_class(full_range)}
    with warnings.catch_warnings():  # the deprecation notice, stated in the module docstring
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantize_dynamic(model, spec, dtype=torch.qint8, mapping=mapping, inplace=True)


def _select_engine() -> None:
    """The x86 quantized engine (FBGEMM / oneDNN kernels), or an error naming ``--dtype``."""
    engines = torch.backends.quantized.supported_engines
    engine = next((e for e in ("x86", "fbgemm", "onednn") if e in engines), None)
    if engine is None:
        raise ValueError(
            f"--dtype int8: this torch has no x86 quantized engine (supported: {engines}); "
            "use --dtype bf16"
        )
    torch.backends.quantized.engine = engine


def _quantize_int8(model: nn.Module, full_range: bool | None = None) -> None:
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(
            f"--dtype int8 runs on the CPU only (torch's dynamic quantization); the model is on "
            f"{device}: use --cpu, or --dtype bf16 on {device.type}"
        )
    try:
        from torch.ao.quantization import per_channel_dynamic_qconfig
    except ImportError as e:  # removed from a future torch
        raise ValueError(
            f"--dtype int8 needs torch.ao.quantization.quantize_dynamic, which this torch "
            f"({torch.__version__}) no longer has ({e}); use --dtype bf16"
        ) from None
    _select_engine()
    spec = {name: per_channel_dynamic_qconfig for name in _int8_targets(model)}
    _quantize(model, spec, full_range)
    missing = set(spec) - set(quantized_linears(model))
    if missing:
        raise RuntimeError(f"--dtype int8: these layers were not quantized: {sorted(missing)}")
    for attention in _attention_modules(model):
        attention.skip_embed_dim_check = True  # module path: the quantized projections run


def prepare_for_inference(model: Any, dtype: str, int8_full_range: bool | None = None) -> Any:
    """Make ``model`` an inference model of precision ``dtype``, in place; returns it.

    Args:
        model: a fairseq ``RobertaModel`` or ``MultiExitRobertaModel`` (float32, as loaded).
        dtype: ``fp32``, ``bf16`` or ``int8`` (``check_precision``).
        int8_full_range: int8 activations on 8 bits (True) or torch's default 7 (False);
            default: 8 when the CPU has VNNI (``cpu_features.has_vnni``).
    Returns:
        ``model`` in eval mode; ``model_precision(model)`` is ``dtype``. Its forwards
        (``model(tokens, classification_head_name=...)``, ``exit_outputs``, ``early_exit``)
        return float32 logits (B x K). The model is for inference only: do not train or save it.
    Raises:
        ValueError: an unknown ``dtype``, int8 off the CPU, or a model already prepared at
        another precision (load it again instead).
    """
    dtype = check_precision(dtype)
    current = model_precision(model)
    if hasattr(model, _ATTRIBUTE) and current != dtype:
        raise ValueError(
            f"--dtype {dtype}: the model was already prepared for {current}; load the "
            "checkpoint again to change the precision"
        )
    _sentence_encoder(model)
    model.eval()
    if current == dtype and hasattr(model, _ATTRIBUTE):
        return model
    if dtype == "bf16":
        model.to(torch.bfloat16)
        _float32_heads(model)
    elif dtype == "int8":
        model.float()
        _quantize_int8(model, int8_full_range)
    else:
        model.float()
    setattr(model, _ATTRIBUTE, dtype)
    return model
