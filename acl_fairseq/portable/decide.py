"""The early-exit decision, written once: each policy kind as a rule table and one decision on
numpy host arrays, for any number of rows.

Every loop takes an exit's logits to the host (B x K float32) and calls ``Decision.decide``:
the torch loops (``runtime.torch_loop``, ``runtime.torch_row``), the ONNX Runtime loop
(``ort_loop``) and the bundle's runner. The policy classes of ``acl_fairseq.early_exit`` parse,
name and calibrate the kinds and hand their rule here (``ExitPolicy.rule``); calibration scores
a split with the same functions (``entropy``, ``maxprob``, ``features``, ``learned_logit``).

A rule is a JSON-able dict (numbers are floats, or ``"inf"``)::

    {"kind": "entropy", "threshold": T}       leaves when the entropy (nats) is < T
    {"kind": "maxprob", "threshold": T}       leaves when the top probability is >= T
    {"kind": "patience", "patience": P}       PABEE: P exits in a row repeated the argmax
    {"kind": "per_exit_entropy" | "per_exit_maxprob", "layers": [...], "thresholds": [...],
     "patience": P or null}                   a threshold per policy exit, or patience
    {"kind": "learned", "threshold": p, "weights": [6 numbers], "bias": b}
                                              the logistic model's logit >= logit(p)

Arithmetic is float32, element by element; sums over the classes are taken class by class (no
reduction whose order could depend on the batch), so a row's decision is the same at any batch
size. Thresholds are compared in float32. A row with a non-finite score never leaves by it.

State per row (int64; only the keys a kind uses): ``counter`` (PABEE's), ``prev_pred`` (the
previous exit's argmax, -1 before the first) and ``step`` (the policy's exits passed).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "FEATURES",
    "KINDS",
    "Decision",
    "State",
    "entropy",
    "feature_state",
    "features",
    "json_number",
    "learned_logit",
    "maxprob",
    "probability_logit",
]

State = dict[str, np.ndarray]
KINDS = ("entropy", "maxprob", "patience", "per_exit_entropy", "per_exit_maxprob", "learned")
FEATURES = ("maxprob", "margin", "entropy", "agree", "run", "exit")
"""The learned kind's features, in the order of ``features``' columns and of its weights."""
_CONFIDENCE = ("entropy", "maxprob")
_ONE = np.float32(1.0)


def json_number(value: float) -> float | str:
    """``value`` as a rule holds it: a float, or ``"inf"`` / ``"-inf"``."""
    value = float(value)
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def _matrix(logits: Any) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"logits must be B x K, got shape {tuple(x.shape)}")
    return x


def _classes_sum(columns: np.ndarray) -> np.ndarray:
    """The sum over the last axis of B x K, class by class (the same order at any B)."""
    if columns.shape[1] == 1:
        return columns[:, 0].copy()
    total = columns[:, 0] + columns[:, 1]
    for k in range(2, columns.shape[1]):
        total += columns[:, k]
    return total


def _softmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(shifted, exp, total)``: the logits minus their row maximum, its exponential and the
    row sums (B x K, B x K, B; float32). Call it under ``np.errstate``: non-finite logits give
    nan, silently."""
    shifted = x - x.max(axis=1)[:, None]
    e = np.exp(shifted)
    return shifted, e, _classes_sum(e)


def _entropy(shifted: np.ndarray, e: np.ndarray, total: np.ndarray) -> np.ndarray:
    """``log(total) - sum_k e_k shifted_k / total`` (``-sum_k p_k log p_k``; each term and the
    sum are ``<= 0``, so the entropy is ``>= 0``)."""
    return np.log(total) - _classes_sum(e * shifted) / total


def _top_margin(e: np.ndarray, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The top probability (the top class's exp is exp(0) = 1) and it minus the second (the
    top one for one class)."""
    top = _ONE / total
    if e.shape[1] == 1:
        return top, top
    return top, top - np.sort(e, axis=1)[:, -2] / total


def entropy(logits: Any) -> np.ndarray:
    """Entropy in nats of ``softmax(logits)`` per row (B x K -> B float32, ``>= 0``)."""
    x = _matrix(logits)
    with np.errstate(all="ignore"):
        return _entropy(*_softmax(x))


def maxprob(logits: Any) -> np.ndarray:
    """The top probability of ``softmax(logits)`` per row (B x K -> B float32)."""
    x = _matrix(logits)
    with np.errstate(all="ignore"):
        return _ONE / _softmax(x)[2]


def probability_logit(threshold: float) -> float:
    """The logit of a probability threshold, rounded to float32 (what ``z >=`` compares):
    ``-inf`` for 0, ``inf`` from 1 on."""
    if threshold <= 0:
        return -math.inf
    if threshold >= 1:
        return math.inf
    return float(np.float32(math.log(threshold) - math.log1p(-threshold)))


def _columns(x: np.ndarray, state: State) -> tuple[list[np.ndarray], State]:
    """The learned kind's feature columns (``FEATURES``' order, float32) and the new state;
    under ``np.errstate``."""
    shifted, e, total = _softmax(x)
    top, margin = _top_margin(e, total)
    pred = x.argmax(axis=1)
    same = pred == state["prev_pred"]
    counter = (state["counter"] + 1) * same
    step = state["step"] + 1
    f32 = np.float32
    columns = [top, margin, _entropy(shifted, e, total), same.astype(f32), counter.astype(f32)]
    return [*columns, step.astype(f32)], {"prev_pred": pred, "counter": counter, "step": step}


def _logit(columns: Any, weights: np.ndarray, bias: np.float32) -> np.ndarray:
    """``bias + sum_f columns[f] * weights[f]`` in float32, feature by feature."""
    z = bias + columns[0] * weights[0]
    for f in range(1, len(weights)):
        z = z + columns[f] * weights[f]
    return z


def features(logits: Any, state: State) -> tuple[np.ndarray, State]:
    """The learned kind's ``FEATURES`` at one exit (B x K logits, the rows' ``prev_pred`` /
    ``counter`` / ``step``) -> ``(B x 6 float32, new state)``: the top probability, it minus
    the second (the top one for one class), the entropy, whether the argmax repeats the previous
    exit's, PABEE's counter, and the exit's position among the policy's exits (from 1)."""
    x = _matrix(logits)
    with np.errstate(all="ignore"):
        columns, new = _columns(x, state)
    return np.stack(columns, axis=1), new


def feature_state(rows: int) -> State:
    """The learned kind's state of ``rows`` rows before the first exit."""
    return {
        "prev_pred": np.full(rows, -1, dtype=np.int64),
        "counter": np.zeros(rows, dtype=np.int64),
        "step": np.zeros(rows, dtype=np.int64),
    }


def learned_logit(table: np.ndarray, weights: np.ndarray, bias: np.float32) -> np.ndarray:
    """``bias + sum_f table[..., f] * weights[f]`` in float32 for ``... x F`` features, feature
    by feature (a row's number does not depend on the batch): the decision's logit."""
    flat = np.asarray(table, dtype=np.float32).reshape(-1, table.shape[-1])
    w = np.asarray(weights, dtype=np.float32)
    z = _logit([flat[:, f] for f in range(flat.shape[1])], w, np.float32(bias))
    return np.asarray(z, dtype=np.float32).reshape(table.shape[:-1])


def _numbers(rule: dict[str, Any], key: str, count: int | None = None) -> list[float]:
    values = rule.get(key)
    if not isinstance(values, list) or (count is not None and len(values) != count):
        size = f"{count} numbers" if count is not None else "a list of numbers"
        raise ValueError(f"exit rule {rule.get('kind')!r}: {key!r} must be {size}, got {values!r}")
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"exit rule {rule.get('kind')!r}: {key!r} holds {values!r}") from None


def _number(rule: dict[str, Any], key: str) -> float:
    return _numbers({"kind": rule.get("kind"), key: [rule.get(key)]}, key, 1)[0]


def _patience(rule: dict[str, Any]) -> int | None:
    value = rule.get("patience")
    if value is None and rule["kind"] != "patience":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"exit rule {rule['kind']!r}: patience must be an integer >= 0")
    return value


class Decision:
    """A rule made ready to run (``rule``: the module docstring's dict): ``init_state`` for a
    batch, then ``decide`` at each of the policy's exits, in order. ``ValueError`` for a rule
    that is not one of ``KINDS`` or holds a bad value."""

    def __init__(self, rule: dict[str, Any]) -> None:
        kind = rule.get("kind") if isinstance(rule, dict) else None
        if kind not in KINDS:
            raise ValueError(f"exit rule: kind must be one of {', '.join(KINDS)}, got {rule!r}")
        self.rule, self.kind = rule, kind
        score = kind.removeprefix("per_exit_")
        self.score = score if score in _CONFIDENCE else None  # entropy or maxprob
        self.patience = _patience(rule)
        self.per_exit = kind.startswith("per_exit_")
        self.thresholds = np.zeros(0, dtype=np.float32)
        if self.per_exit:
            layers = _numbers(rule, "layers")
            self.thresholds = np.asarray(_numbers(rule, "thresholds", len(layers)), np.float32)
        elif kind in _CONFIDENCE:
            self.thresholds = np.asarray([_number(rule, "threshold")], dtype=np.float32)
        elif kind == "learned":
            self.weights = np.asarray(_numbers(rule, "weights", len(FEATURES)), np.float32)
            self.bias = np.float32(_number(rule, "bias"))
            self.cut = np.float32(probability_logit(_number(rule, "threshold")))
        self.keys = (
            ("prev_pred", "counter", "step")
            if kind == "learned"
            else ("step",) * self.per_exit + ("counter", "prev_pred") * (self.patience is not None)
        )

    def init_state(self, rows: int) -> State:
        """The state of ``rows`` rows before the first exit."""
        start = {"prev_pred": -1, "counter": 0, "step": 0}
        return {key: np.full(rows, start[key], dtype=np.int64) for key in self.keys}

    def decide(self, logits: Any, state: State) -> tuple[np.ndarray, State]:
        """``(leave, new state)`` at the current exit: ``logits`` B x K of the rows still
        running, ``state`` theirs; ``leave``: B bool."""
        x = _matrix(logits)
        new: State = {}
        if self.kind == "learned":
            with np.errstate(all="ignore"):
                columns, new = _columns(x, state)
                return _logit(columns, self.weights, self.bias) >= self.cut, new
        leave = np.zeros(x.shape[0], dtype=bool)
        if self.score is not None:
            limit = self.thresholds[0]
            if self.per_exit:
                step = state["step"]
                if step.size and int(step.max()) >= self.thresholds.size:
                    raise ValueError(
                        f"exit rule {self.kind} has {self.thresholds.size} exit(s) but was "
                        "asked to decide at more: evaluate only its exits (ExitPolicy.exits)"
                    )
                limit, new["step"] = self.thresholds[step], step + 1
            with np.errstate(all="ignore"):
                shifted, e, total = _softmax(x)
                if self.score == "entropy":
                    leave = _entropy(shifted, e, total) < limit
                else:
                    leave = _ONE / total >= limit
        if self.patience is not None:
            pred = x.argmax(axis=1)
            counter = (state["counter"] + 1) * (pred == state["prev_pred"])
            leave |= counter >= self.patience
            new["counter"], new["prev_pred"] = counter, pred
        return leave, new
