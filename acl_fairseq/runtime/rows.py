"""What the torch side of the early-exit loops shares: ``EarlyExitResult`` (the result in
tensors) and the decider of a policy on host arrays (``host_decider``).

The decision and the row bookkeeping themselves are ``portable.decide`` and ``portable.rows``
(numpy), which the ONNX Runtime loop and the bundle's runner run too: a torch loop takes each
exit's logits to the host (it synchronises once per exit anyway, to know whether a row leaves)
and turns the kept rows' indices back into a tensor on its device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..early_exit.policies import ExitPolicy, host_state, tensor_state
from ..portable import decide as host
from ..portable.rows import Decider, ExitResult

__all__ = ["EarlyExitResult", "TensorDecider", "host_decider", "to_torch"]


class EarlyExitResult(NamedTuple):
    """Result of ``MultiExitRobertaModel.early_exit`` for B examples, K classes."""

    predictions: Tensor  # B, long: argmax of the exit's logits
    exit_layers: Tensor  # B, long: 1-based layer of the exit each example left at
    logits: Tensor  # B x K: logits of that exit
    labels: list[str] | None = None  # B label names (the hub's ``predict_early_exit``)


class TensorDecider:
    """A policy without a rule (a registered extension that overrides ``decide``) as a decider
    on host arrays: its own ``decide`` on tensors on ``device``."""

    def __init__(self, policy: ExitPolicy, device: torch.device | str) -> None:
        self.policy, self.device = policy, torch.device(device)

    def init_state(self, rows: int) -> host.State:
        return host_state(self.policy.init_state(rows, self.device))

    def decide(self, logits: np.ndarray, state: host.State) -> tuple[np.ndarray, host.State]:
        mask, new = self.policy.decide(
            torch.from_numpy(logits).to(self.device), tensor_state(state, self.device)
        )
        return mask.cpu().numpy().astype(bool), host_state(new)


def host_decider(policy: ExitPolicy, device: torch.device | str = "cpu") -> Decider:
    """What decides for ``policy`` on host arrays: its rule's ``portable.decide.Decision``, or
    its own ``decide`` on tensors (``TensorDecider``, on ``device``) for a kind without one."""
    decision = policy.decision()
    return decision if decision is not None else TensorDecider(policy, device)


def to_torch(result: ExitResult, device: Any = "cpu") -> EarlyExitResult:
    """A numpy ``ExitResult`` as tensors on ``device``."""
    return EarlyExitResult(
        *(torch.from_numpy(np.ascontiguousarray(part)).to(device) for part in result)
    )
