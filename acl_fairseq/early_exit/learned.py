"""A learned exit decision: a logistic model on what the exits give, one registry kind.

At each shallow exit the policy computes ``FEATURES`` from the exit's logits and what the
previous exits said, and a logistic model predicts the probability that this exit's answer
equals the final exit's; a row leaves when that probability is ``>= threshold`` (compared as
logits, which float32 computes the same way at any batch size). Features per
row (``exit_features``), float32:

* ``maxprob``: the top probability of ``softmax(logits)``;
* ``margin``: the top probability minus the second (the top one for a single class);
* ``entropy``: the entropy (nats) of ``softmax(logits)``;
* ``agree``: 1 when the argmax equals the previous exit's (0 at the first exit);
* ``run``: PABEE's counter, how many exits in a row repeated the previous argmax;
* ``exit``: the exit's position among the policy's exits, from 1.

The spec names every weight, so the file is self-describing and a model with other features
is refused: ``learned:0.91;bias=-2.5;maxprob=3.1;margin=1.2;entropy=-0.4;agree=0.8;run=0.3;
exit=0.05``. ``fit_logistic`` fits the weights (L2-regularised, Newton's method, float64,
deterministic); ``early_exit.learned_calibration`` fits them to a split and calibrates the
threshold on out-of-fold scores. The features and the decision are ``portable.decide``'s (numpy,
float32), which every loop runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..portable import decide as host
from ..portable.decide import FEATURES, probability_logit
from .policies import (
    ExitPolicy,
    PolicyState,
    host_state,
    on_host,
    register_policy,
    tensor_state,
)

__all__ = [
    "FEATURES",
    "LearnedPolicy",
    "exit_features",
    "feature_state",
    "fit_logistic",
    "logistic_logit",
    "probability_logit",
    "split_features",
]


def feature_state(batch_size: int, device: torch.device | str | None = None) -> PolicyState:
    """The features' per-row state before the first exit: ``prev_pred`` (B long, -1: none),
    ``counter`` (B long, PABEE's) and ``step`` (B long, exits passed)."""
    return tensor_state(host.feature_state(batch_size), device)


def exit_features(logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
    """The features of one exit (``portable.decide.features``, which the policy runs).

    Args:
        logits: B x K logits of the exit for the rows still running.
        state: ``feature_state`` or the previous call's, for those B rows.
    Returns:
        ``(B x len(FEATURES) float32, new state)``.
    """
    table, new = host.features(on_host(logits), host_state(state))
    return torch.from_numpy(table).to(logits.device), tensor_state(new, logits.device)


def split_features(shallow: Sequence[Tensor]) -> Tensor:
    """N x E x F features of every row at each of E shallow exits (``[N x K]`` by layer), the
    same numbers as the policy computes at those exits."""
    if not shallow:
        raise ValueError("features need at least one shallow exit")
    state = host.feature_state(shallow[0].size(0))
    columns = []
    for logits in shallow:
        table, state = host.features(on_host(logits), state)
        columns.append(table)
    return torch.from_numpy(np.stack(columns, axis=1)).to(shallow[0].device)


def logistic_logit(features: Tensor, weights: Tensor | Sequence[float], bias: float) -> Tensor:
    """``bias + sum_f features[..., f] * weights[f]`` in float32, as the policy computes it
    (``portable.decide.learned_logit``; its probability is the sigmoid of this).

    Args:
        features: ... x F.
        weights: F.
    """
    w = np.asarray(torch.as_tensor(weights, dtype=torch.float32).cpu().numpy(), np.float32)
    table = features.detach().float().cpu().numpy()
    z = host.learned_logit(table, w, np.float32(bias))
    return torch.from_numpy(np.asarray(z, dtype=np.float32)).to(features.device)


def _objective(x: Tensor, y: Tensor, theta: Tensor, l2: float) -> Tensor:
    z = x @ theta
    return torch.nn.functional.softplus(z).mean() - (y * z).mean() + 0.5 * l2 * theta.pow(2).sum()


def fit_logistic(
    features: Tensor, labels: Tensor, l2: float = 1e-3, max_iter: int = 100
) -> tuple[Tensor, float]:
    """L2-regularised logistic regression, deterministic.

    Minimises ``mean(log(1 + e^z) - y z) + l2 / 2 * |theta|^2`` with ``z = bias + x . w`` over
    the standardised features (a constant feature gets weight 0; the penalty covers the bias
    too, so the fit is finite when every label is the same), by Newton's method with
    backtracking in float64, then maps the weights back to the raw features.

    Args:
        features: M x F.
        labels: M, 0/1 (bool or numbers).
    Returns:
        ``(weights F float64, bias)`` on the raw features.
    """
    if features.dim() != 2 or labels.shape != features.shape[:1]:
        raise ValueError(
            f"features must be M x F and labels M, got {tuple(features.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if not l2 > 0:
        raise ValueError(f"l2 must be > 0, got {l2}")
    x = features.detach().double().cpu()
    y = labels.detach().double().cpu()
    mean = x.mean(dim=0) if x.size(0) else torch.zeros(x.size(1), dtype=torch.float64)
    std = x.std(dim=0, unbiased=False) if x.size(0) else torch.ones_like(mean)
    scale = torch.where(std > 1e-12, std, torch.ones_like(std))
    constant = std <= 1e-12
    xs = (x - mean) / scale
    xs[:, constant] = 0.0
    xs = torch.cat([torch.ones(x.size(0), 1, dtype=torch.float64), xs], dim=1)
    theta = torch.zeros(xs.size(1), dtype=torch.float64)
    eye = torch.eye(xs.size(1), dtype=torch.float64)
    m = max(x.size(0), 1)
    loss = _objective(xs, y, theta, l2)
    for _ in range(max_iter):
        p = torch.sigmoid(xs @ theta)
        grad = xs.T @ (p - y) / m + l2 * theta
        hess = (xs * (p * (1 - p)).unsqueeze(1)).T @ xs / m + l2 * eye
        step = torch.linalg.solve(hess, grad)
        size = 1.0
        while True:  # backtracking: the objective never increases
            new = theta - size * step
            new_loss = _objective(xs, y, new, l2)
            if new_loss <= loss or size < 1e-10:
                break
            size /= 2
        if new_loss > loss:
            break
        done = float((new - theta).abs().max()) < 1e-12
        theta, loss = new, new_loss
        if done:
            break
    weights = torch.where(constant, torch.zeros_like(scale), theta[1:] / scale)
    bias = float(theta[0] - (weights * mean).sum())
    return weights, bias


def _number(value: float) -> str:
    return "inf" if math.isinf(value) else repr(float(value))


@register_policy
@dataclass(frozen=True)
class LearnedPolicy(ExitPolicy):
    """Exit when the logistic model's probability that this exit agrees with the final one is
    ``>= threshold`` (module docstring); ``weights`` in ``FEATURES`` order."""

    threshold: float
    weights: tuple[float, ...]
    bias: float
    kind: ClassVar[str] = "learned"
    calibrated: ClassVar[bool] = True
    value_range: ClassVar[str] = (
        "THRESHOLD;bias=B;" + ";".join(f"{f}=W" for f in FEATURES) + " with a probability "
        "threshold >= 0 (above 1 never exits) and one weight per feature (fitted by "
        "acl-fairseq-sweep --policy learned)"
    )

    def __post_init__(self) -> None:
        t = self.threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0:
            raise ValueError(f"learned: the threshold must be a number >= 0, got {t!r}")
        weights = tuple(float(w) for w in self.weights)
        if len(weights) != len(FEATURES):
            raise ValueError(
                f"learned: {len(weights)} weights for the {len(FEATURES)} features "
                f"{', '.join(FEATURES)}"
            )
        values = (*weights, float(self.bias))
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"learned: the weights and bias must be finite, got {values}")
        object.__setattr__(self, "threshold", float(t))
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "bias", float(self.bias))

    @property
    def value(self) -> str:
        """``THRESHOLD;bias=B;maxprob=W;...`` at full precision."""
        named = ";".join(f"{f}={_number(w)}" for f, w in zip(FEATURES, self.weights))
        return f"{_number(self.threshold)};bias={_number(self.bias)};{named}"

    @classmethod
    def from_value(cls, value: Any) -> LearnedPolicy:
        text = str(value).strip()
        head, *items = [part.strip() for part in text.split(";")]
        try:
            threshold = float(head)
        except ValueError:
            raise ValueError(
                f"learned: expected {cls.value_range}; {head!r} is not a threshold"
            ) from None
        named: dict[str, float] = {}
        for item in items:
            name, eq, number = (s.strip() for s in item.partition("="))
            if name not in ("bias", *FEATURES):
                raise ValueError(
                    f"learned: unknown feature {name!r} (this version has bias and "
                    f"{', '.join(FEATURES)}): fit the policy again with acl-fairseq-sweep "
                    "--policy learned"
                )
            try:
                weight = float(number) if eq and name not in named else None
            except ValueError:
                weight = None
            if weight is None:
                raise ValueError(f"learned: bad weight {item!r}: expected NAME=NUMBER, once")
            named[name] = weight
        missing = [name for name in ("bias", *FEATURES) if name not in named]
        if missing:
            raise ValueError(
                f"learned: no weight for {', '.join(missing)}; expected {cls.value_range}"
            )
        return cls(threshold, tuple(named[f] for f in FEATURES), named["bias"])

    @staticmethod
    def default_grid(num_classes: int, num_shallow_exits: int) -> list[float]:
        """None: the weights and threshold are fitted to a split (``learned_calibration``)."""
        return []

    def with_threshold(self, threshold: float) -> LearnedPolicy:
        """The same model at another threshold."""
        return LearnedPolicy(threshold, self.weights, self.bias)

    def never_exits(self, num_shallow_exits: int) -> bool:
        """A probability is below 1: a threshold of 1 or more never lets a row out."""
        return self.threshold >= 1.0 or num_shallow_exits == 0

    def rule(self) -> dict[str, Any]:
        return {
            "kind": "learned",
            "threshold": host.json_number(self.threshold),
            "weights": list(self.weights),
            "bias": self.bias,
        }

    def logit(self, features: Tensor) -> Tensor:
        """The model's logit for ``... x F`` features (float32); a row leaves where it is at
        least ``probability_logit(threshold)`` (its probability at least the threshold)."""
        return logistic_logit(features, self.weights, self.bias)
