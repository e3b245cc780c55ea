"""ACL-Grad's step: per micro-batch, and the decision of each optimizer update.

An update drops its contrastive term when the angle between the CE and the contrastive
gradient exceeds ``--acl-grad-threshold``. Exact scope (``all``, the default): each
micro-batch puts its contrastive gradient into a buffer beside ``.grad``
(:meth:`AclGrad.train_step`), and the update decides at the trainer's all-reduce
(:meth:`AclGrad.decide_update`). ``head`` / ``top:K`` decide per micro-batch on those
parameters only. The steps, loss scaling, and which all-reduce reduces what under each
``--ddp-backend``: docs/acl_grad.md.
"""

import weakref
from collections.abc import Callable
from typing import Any

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import metrics
from fairseq.optim.amp_optimizer import AMPOptimizer
from torch import Tensor, nn

from ..autocast import forward_precision
from ..distributed import check_static_graph
from ..errors import AclValueError
from .angle_log import AngleRecord, append_angle_record, check_log_path
from .angles import ContrastiveGradientBuffer, Decision, decide, gradient_angle
from .config import AclGradSettings
from .contract import AclGradCriterion
from .optimizer import AclGradOptimizer
from .scope import (
    check_k,
    check_scope_fits,
    encoder_layer_count,
    is_head_param,
    parse_log_top_k,
    scope_indices,
)

__all__ = ["AclGrad"]


class AclGrad:
    """ACL-Grad of one training run, owned by the task. ``log_path``: ``--acl-grad-log``.
    The buffer belongs to one model: rebuilt when ``train_step`` sees another one."""

    def __init__(
        self, log_path: str | None = None, log_top_k: str | None = None, autocast: str = "none"
    ):
        self.log_path = log_path
        self.log_top_k = parse_log_top_k(log_top_k)  # --acl-grad-log-top-k
        self.autocast = autocast  # the task's --autocast
        self.settings: AclGradSettings | None = None
        self.update_num = 0
        self._pending: list[tuple[Decision, AngleRecord | None]] = []  # until the step
        self._buffer: ContrastiveGradientBuffer | None = None
        self._head_indices: list[int] = []  # positions of the heads' parameters in the buffer
        self._top_indices: dict[int, list[int]] = {}  # K -> heads + top K layers, in the buffer
        self._optimizer: AclGradOptimizer | None = None
        self._scope_params: tuple[Any, int, list[nn.Parameter]] | None = None  # model, K, params

    def check_model(self, model: nn.Module, settings: AclGradSettings | None) -> None:
        """At set-up: a K of ``--acl-grad-scope top:K`` or ``--acl-grad-log-top-k`` that does
        not fit ``model``'s encoder layers is refused, naming the flag."""
        if settings is not None:
            check_scope_fits(model, settings.scope, self.log_top_k)

    def check_log_path(self) -> None:
        """At set-up: refuses an ``--acl-grad-log`` this worker cannot write (every worker
        checks, so all stop together)."""
        if self.log_path:
            path = self.log_path.replace("{rank}", str(_data_parallel_rank()))
            check_log_path(path, given=self.log_path)

    @property
    def holds_contrastive_gradient(self) -> bool:
        """Whether a contrastive gradient waits in the buffer for the update's decision."""
        return self._buffer is not None and not self._buffer.empty

    def train_step(
        self,
        sample: dict[str, Any],
        model: nn.Module,
        criterion: AclGradCriterion,
        optimizer: Any,
        update_num: int,
        ignore_grad: bool = False,
    ) -> tuple[Tensor, int, dict[str, Any]]:
        """One micro-batch with ACL-Grad on: the task's ``train_step``, same return value."""
        assert criterion.acl_grad is not None
        self.settings = criterion.acl_grad
        self.update_num = update_num
        check_static_graph(model)
        with forward_precision(self.autocast, model, optimizer):
            ce_loss, contrastive_loss, sample_size, logging_output = criterion.loss_terms(
                model, sample
            )
        if ignore_grad:
            ce_loss = ce_loss * 0.0
            contrastive_loss = contrastive_loss * 0.0
        self._hook_optimizer(model, criterion, optimizer)
        top_k = self.settings.top_k
        if top_k is not None:
            params = self._params_of_scope(model, top_k)
            keep = self._decide_on_subset(params, optimizer, ce_loss, contrastive_loss)
            optimizer.backward(ce_loss + contrastive_loss if keep else ce_loss)
        else:
            buffer = self._buffer_for(model)
            if contrastive_loss.requires_grad:
                grads = torch.autograd.grad(
                    _scale_like_optimizer(optimizer, contrastive_loss),
                    buffer.params,
                    retain_graph=True,
                    allow_unused=True,
                )
                buffer.accumulate(grads)
            optimizer.backward(ce_loss)
        return (ce_loss + contrastive_loss).detach(), sample_size, logging_output

    def _hook_optimizer(self, model: nn.Module, criterion: Any, optimizer: Any) -> None:
        """Wraps ``optimizer`` once for ``model`` (:class:`AclGradOptimizer`) so that the
        trainer's all-reduce reaches :meth:`decide_update` and its zeroing :meth:`reset`."""
        wrapper = self._optimizer
        if wrapper is None or not wrapper.wraps(optimizer, model):
            self._optimizer = AclGradOptimizer.install(optimizer, self, model, criterion)
            self._buffer = None

    def _buffer_for(self, model: nn.Module) -> ContrastiveGradientBuffer:
        """The contrastive-gradient buffer of ``model`` (built at its first micro-batch)."""
        if self._buffer is None:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            self._buffer = ContrastiveGradientBuffer([p for _, p in named])
            names = [n for n, _ in named]
            self._head_indices = [i for i, n in enumerate(names) if is_head_param(n)]
            num_layers = encoder_layer_count(model)
            self._top_indices = {
                k: scope_indices(names, k, num_layers) for k in self.log_top_k if k <= num_layers
            }
        return self._buffer

    def reset(self) -> None:
        """Drops the buffer and the decisions of an update not applied (``.grad`` zeroed: a new
        update, or an fp16 overflow)."""
        if self._buffer is not None:
            self._buffer.reset()
        self._pending = []

    def optimizer_step(self, optimizer: Any, step: Callable[[], None]) -> None:
        """The task's ``optimizer_step``: runs ``step``, then logs the update's decisions,
        unless ``--amp``'s scaler skipped it (fp16's skips before: :meth:`reset`)."""
        scaler = optimizer.scaler if isinstance(optimizer, AMPOptimizer) else None
        scale = scaler.get_scale() if scaler is not None else None
        step()
        pending, self._pending = self._pending, []
        if scaler is not None and scaler.get_scale() < scale:
            return  # AMP skipped the update: its decisions enter no statistic
        path = self._log_file()
        for decision, record in pending:
            metrics.log_scalar("acl_grad_angle", decision.angle, weight=1, round=1)
            metrics.log_scalar("acl_grad_drop", 0.0 if decision.keep else 1.0, weight=1, round=3)
            if path is not None and record is not None:
                append_angle_record(path, record)

    def decide_update(self) -> Decision | None:
        """``--acl-grad-scope all``: after the trainer's all-reduce of ``.grad``, all-reduces
        the buffer (no DDP hook saw it), decides on the global gradients, adds the buffer to
        ``.grad`` if kept."""
        buffer = self._buffer
        if buffer is None or buffer.empty or self.settings is None:
            return None
        world_size = distributed_utils.get_data_parallel_world_size()
        if world_size > 1:
            group = distributed_utils.get_data_parallel_group()

            def mean_all_reduce(t: Tensor) -> None:
                t.div_(world_size)
                distributed_utils.all_reduce(t, group)

            buffer.all_reduce(mean_all_reduce)
        angle = _rank0_value(buffer.angle_to_grad(), buffer.params[0].device)
        decision = decide(angle, self.settings.threshold)
        record = None
        if self._log_file() is not None and decision.finite:
            # the angles --acl-grad-scope head and top:K would measure (logged only)
            head_angle = buffer.angle_to_grad(self._head_indices)
            top = tuple((k, buffer.angle_to_grad(i)) for k, i in self._top_indices.items())
            record = AngleRecord(self.update_num, decision.angle, decision.keep, head_angle, top)
        if decision.keep:
            buffer.add_to_grad()
        else:
            buffer.reset()
        self._record(decision, record)
        return decision

    def _params_of_scope(self, model: nn.Module, k: int) -> list[nn.Parameter]:
        """The trainable parameters of ``top:k`` (``head`` for 0), in model order; cached."""
        cached = self._scope_params
        if cached is not None and cached[0]() is model and cached[1] == k:
            return cached[2]
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        num_layers = encoder_layer_count(model)
        check_k(k, num_layers, "--acl-grad-scope")
        params = [named[i][1] for i in scope_indices([n for n, _ in named], k, num_layers)]
        if not any(is_head_param(n) for n, _ in named):
            raise AclValueError(
                f"--acl-grad-scope {self.settings.scope if self.settings else 'head'} measures "
                "the angle on the classification heads, but the model has no trainable "
                "'classification_heads' parameters; use --acl-grad-scope all"
            )
        self._scope_params = (weakref.ref(model), k, params)
        return params

    def _decide_on_subset(
        self, params: list[nn.Parameter], optimizer: Any, ce_loss: Tensor, contrastive_loss: Tensor
    ) -> bool:
        """``--acl-grad-scope head`` / ``top:K``: whether to keep the term of this
        micro-batch, from the two gradients of ``params`` summed over the workers."""
        assert self.settings is not None
        g_ce = _grads_or_zeros(_scale_like_optimizer(optimizer, ce_loss), params)
        g_con = _grads_or_zeros(_scale_like_optimizer(optimizer, contrastive_loss), params)
        if distributed_utils.get_data_parallel_world_size() > 1:
            flat = torch.cat([g.reshape(-1).float() for g in g_ce + g_con])
            distributed_utils.all_reduce(flat, distributed_utils.get_data_parallel_group())
            sizes = [g.numel() for g in g_ce + g_con]
            parts = flat.split(sizes)
            g_ce, g_con = list(parts[: len(params)]), list(parts[len(params) :])
        angle = _rank0_value(gradient_angle(g_ce, g_con), params[0].device)
        decision = decide(angle, self.settings.threshold)
        self._record(decision, AngleRecord(self.update_num, angle, decision.keep, angle))
        return decision.keep

    def _record(self, decision: Decision, record: AngleRecord | None) -> None:
        """Keeps a finite decision for :meth:`optimizer_step`; an undefined angle enters no
        statistic."""
        if decision.finite:
            self._pending.append((decision, record))

    def _log_file(self) -> str | None:
        """The angle-log file this worker writes (``--acl-grad-log``); None: none."""
        path = self.log_path
        if not path:
            return None
        if "{rank}" in path:
            return path.replace("{rank}", str(_data_parallel_rank()))
        return path if _data_parallel_rank() == 0 else None


def _scale_like_optimizer(optimizer: Any, loss: Tensor) -> Tensor:
    """Scales ``loss`` as ``optimizer.backward`` would (fp16 / AMP loss scaling)."""
    scaler = getattr(optimizer, "scaler", None)
    return scaler.scale(loss) if scaler is not None else loss


def _grads_or_zeros(loss: Tensor, params: list[nn.Parameter]) -> list[Tensor]:
    """d loss / d params, keeping the graph; zeros where ``loss`` does not depend on one."""
    if not loss.requires_grad:
        return [torch.zeros_like(p) for p in params]
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _rank0_value(value: float, device: torch.device) -> float:
    """``value`` as computed on data-parallel rank 0 (broadcast), so every worker agrees."""
    if distributed_utils.get_data_parallel_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    distributed_utils.broadcast(t, src=0, group=distributed_utils.get_data_parallel_group())
    return t.item()


def _data_parallel_rank() -> int:
    if distributed_utils.get_data_parallel_world_size() == 1:
        return 0
    return distributed_utils.get_data_parallel_rank()
