"""A learned exit decision: a logistic model on what the exits give, one registry kind.

At each shallow exit the policy computes ``FEATURES`` from the exit's logits and what the
previous exits said, and a logistic model predicts the probability that this exit's answer
equals the final exit's; a row leaves when that probability is ``>= threshold``. Features per
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
threshold on out-of-fold scores. Pure torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .policies import ExitPolicy, PolicyState, register_policy, softmax_entropy

__all__ = [
    "FEATURES",
    "LearnedPolicy",
    "exit_features",
    "feature_state",
    "fit_logistic",
    "logistic_probability",
    "split_features",
]

FEATURES = ("maxprob", "margin", "entropy", "agree", "run", "exit")
"""The features, in the order of ``exit_features``' columns and of the weights."""


def feature_state(batch_size: int, device: torch.device | str | None = None) -> PolicyState:
    """The features' per-row state before the first exit: ``prev_pred`` (B long, -1: none),
    ``counter`` (B long, PABEE's) and ``step`` (B long, exits passed)."""
    return {
        "prev_pred": torch.full((batch_size,), -1, dtype=torch.long, device=device),
        "counter": torch.zeros(batch_size, dtype=torch.long, device=device),
        "step": torch.zeros(batch_size, dtype=torch.long, device=device),
    }


def exit_features(logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
    """The features of one exit (module docstring).

    Args:
        logits: B x K logits of the exit for the rows still running.
        state: ``feature_state`` or the previous call's, for those B rows.
    Returns:
        ``(B x len(FEATURES) float32, new state)``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be B x K, got shape {tuple(logits.shape)}")
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(min(2, probs.size(-1)), dim=-1).values
    margin = top[:, 0] - top[:, 1] if top.size(-1) > 1 else top[:, 0]
    pred = logits.argmax(dim=-1)
    same = pred.eq(state["prev_pred"])
    counter = torch.where(same, state["counter"] + 1, torch.zeros_like(state["counter"]))
    step = state["step"] + 1
    features = torch.stack(
        [top[:, 0], margin, softmax_entropy(logits), same.float(), counter.float(), step.float()],
        dim=1,
    )
    return features, {"prev_pred": pred, "counter": counter, "step": step}


def split_features(shallow: Sequence[Tensor]) -> Tensor:
    """N x E x F features of every row at each of E shallow exits (``[N x K]`` by layer), the
    same numbers as the policy computes at those exits."""
    if not shallow:
        raise ValueError("features need at least one shallow exit")
    state = feature_state(shallow[0].size(0), shallow[0].device)
    columns = []
    for logits in shallow:
        features, state = exit_features(logits, state)
        columns.append(features)
    return torch.stack(columns, dim=1)


def logistic_probability(features: Tensor, weights: Tensor, bias: float) -> Tensor:
    """``sigmoid(bias + sum_f features[..., f] * weights[f])`` in float32, accumulated feature
    by feature (the same number for a row whatever the batch).

    Args:
        features: ... x F.
        weights: F.
    """
    features = features.float()
    weights = weights.to(device=features.device, dtype=torch.float32)
    z = torch.full(features.shape[:-1], float(bias), dtype=torch.float32, device=features.device)
    for f in range(features.size(-1)):
        z = z + features[..., f] * weights[f]
    return torch.sigmoid(z)


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
        """A probability is at most 1: a threshold above it never lets a row out."""
        return self.threshold > 1.0 or num_shallow_exits == 0

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> PolicyState:
        return feature_state(batch_size, device)

    def _weights(self, device: torch.device) -> Tensor:
        """The weights as float32 on ``device`` (cached)."""
        cache = self.__dict__.setdefault("_tables", {})
        if device not in cache:
            cache[device] = torch.tensor(self.weights, dtype=torch.float32, device=device)
        return cache[device]

    def probability(self, features: Tensor) -> Tensor:
        """The model's probability for ``... x F`` features (float32)."""
        return logistic_probability(features, self._weights(features.device), self.bias)

    def decide(self, logits: Tensor, state: PolicyState) -> tuple[Tensor, PolicyState]:
        features, new_state = exit_features(logits, state)
        return self.probability(features) >= self.threshold, new_state
