"""Which parameters an ACL-Grad angle is measured on: ``--acl-grad-scope`` and
``--acl-grad-log-top-k``.

``all``: every trainable parameter; ``head``: every ``classification_heads`` module;
``top:K``: the heads plus the last ``K`` encoder layers (autograd walks only the graph above
them, so ``K`` sets the cost). Pure Python on parameter names.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..errors import AclValueError

__all__ = [
    "check_k",
    "check_scope_fits",
    "encoder_layer_count",
    "is_head_param",
    "parse_log_top_k",
    "parse_scope",
    "scope_indices",
]

LAYERS_PREFIX = ("encoder", "sentence_encoder", "layers")  # where RoBERTa keeps its layers


def is_head_param(name: str) -> bool:
    """Whether parameter ``name`` belongs to a classification head (or a shallow exit)."""
    return "classification_heads" in name.split(".")


def layer_of(name: str) -> int | None:
    """The 0-based encoder layer of parameter ``name``; None outside the layers."""
    parts = name.split(".")
    for start in range(len(parts) - len(LAYERS_PREFIX)):
        if tuple(parts[start : start + len(LAYERS_PREFIX)]) == LAYERS_PREFIX:
            index = parts[start + len(LAYERS_PREFIX)]
            return int(index) if index.isdigit() else None
    return None


def encoder_layer_count(model: nn.Module) -> int:
    """L: the number of encoder layers of ``model`` (0 when it has none we recognise)."""
    layers = {layer_of(n) for n, _ in model.named_parameters()} - {None}
    return max(layers) + 1 if layers else 0  # type: ignore[type-var]


def parse_scope(value: str) -> int | None:
    """``--acl-grad-scope``: None for ``all``, K for ``top:K`` (``head`` is 0); the form only
    (:func:`check_k` checks K against the model)."""
    value = str(value).strip()
    if value == "all":
        return None
    if value == "head":
        return 0
    if value.startswith("top:"):
        k = value[len("top:") :]
        if k.isdigit():
            return int(k)
    raise AclValueError(
        f"--acl-grad-scope must be 'all', 'head' or 'top:K' with K a whole number of encoder "
        f"layers (e.g. top:2), got {value!r}"
    )


def parse_log_top_k(value: str | None) -> tuple[int, ...]:
    """``--acl-grad-log-top-k``: a comma list of K (e.g. ``1,2,3``), sorted, no duplicates;
    empty or None: none."""
    if value is None or not str(value).strip():
        return ()
    ks = []
    for item in str(value).split(","):
        item = item.strip()
        if not item.isdigit():
            raise AclValueError(
                "--acl-grad-log-top-k is a comma list of whole numbers of encoder layers "
                f"(e.g. 1,2,3), got {value!r}"
            )
        ks.append(int(item))
    return tuple(sorted(set(ks)))


def check_k(k: int, num_layers: int, flag: str) -> None:
    """Raises ValueError naming ``flag`` unless ``0 <= k <= num_layers``."""
    if not 0 <= k <= num_layers:
        raise AclValueError(
            f"{flag}: K={k} is outside 0..{num_layers}; the model has {num_layers} encoder "
            f"layers (use a K between 0 and {num_layers}, or --acl-grad-scope all)"
        )


def scope_indices(names: Sequence[str], k: int, num_layers: int) -> list[int]:
    """Positions in ``names`` of the parameters of scope ``top:k``: the classification heads
    and encoder layers ``num_layers - k .. num_layers - 1``, in ``names`` order."""
    lowest = num_layers - k
    out = []
    for i, name in enumerate(names):
        layer = layer_of(name)
        if is_head_param(name) or (layer is not None and layer >= lowest):
            out.append(i)
    return out


def check_scope_fits(model: nn.Module, scope: str, log_top_k: Sequence[int]) -> None:
    """Raises ValueError naming the flag when ``--acl-grad-scope top:K`` or a K of
    ``--acl-grad-log-top-k`` does not fit ``model``'s encoder layers (at set-up)."""
    num_layers = encoder_layer_count(model)
    k = parse_scope(scope)
    if k is not None:
        check_k(k, num_layers, "--acl-grad-scope")
        if log_top_k:
            raise AclValueError(
                "--acl-grad-log-top-k logs the top-K angles of the exact decision: it needs "
                f"--acl-grad-scope all, got --acl-grad-scope {scope}"
            )
    for k in log_top_k:
        check_k(k, num_layers, "--acl-grad-log-top-k")
