"""ACL-Grad's step: per micro-batch, and the decision of each optimizer update.

ACL-Grad drops the contrastive term of an optimizer update when its gradient conflicts with
the CE gradient: when the angle between the two exceeds ``--acl-grad-threshold`` degrees.

One optimizer update with ``--acl-grad-scope all`` (the exact decision, the default):

1. :meth:`AclGrad.train_step`, once per micro-batch: one forward; the contrastive gradient is
   taken with ``torch.autograd.grad`` (scaled like the optimizer scales losses for fp16/AMP)
   and added to a :class:`ContrastiveGradientBuffer` beside ``.grad``; then the CE loss goes
   through the ordinary ``optimizer.backward``, so ``.grad`` accumulates the CE gradient.
   Two backward passes per micro-batch.
2. :meth:`AclGrad.decide_update`, once per update, when the trainer all-reduces the gradients
   (``optimizer.all_reduce_grads(model)``, after the last micro-batch and before
   normalisation and clipping; :class:`~.optimizer.AclGradOptimizer` is how it gets there):
   the buffer is all-reduced with the trainer's convention (mean over workers), the angle
   between the two global gradients is taken, rank 0's decision is broadcast, and the buffer
   is added to ``.grad`` if kept. The trainer then normalises, clips and steps as usual.

So the decision is made on the gradients of the whole update (every micro-batch of every
worker): it is the same on all workers, and 1 worker with ``--update-freq k`` decides exactly
like k workers. The buffer is dropped whenever the trainer zeroes the gradients.

The decisions of an update enter the statistics (``acl_grad_angle``, ``acl_grad_drop``, the
angle log) when the optimizer steps (:meth:`AclGrad.optimizer_step`, the task's
``optimizer_step``): an update that fp16's loss scaler skips (overflow: the trainer zeroes the
gradients instead) or that ``--amp``'s scaler skips enters none. An undefined angle (inf/nan
gradients, a zero gradient) keeps the term, so the scaler sees the overflow, and enters none
either.

``--autocast bf16`` (the task's): the forward pass of :meth:`AclGrad.train_step` runs under
autocast, both backward passes outside it; the gradients, the buffer and the angle are fp32.

``--acl-grad-scope head`` is the cheap approximation: for each micro-batch, the CE and
contrastive gradients of the classification heads' parameters only are taken (a backward pass
through the heads, not the encoder), summed over the workers, and the decision is made before
the micro-batch's single ``optimizer.backward`` of ``CE + term`` or ``CE``. It decides per
micro-batch rather than per update, and agrees with the exact decision only as far as the
heads' gradients represent the encoder's (``benchmarks/acl_grad_agreement.py``). With the
exact scope the log's fourth column gives that heads-only angle of the same update.
``--acl-grad-scope top:K`` does the same on the heads plus the top K encoder layers
(``scope.py``; ``top:0`` is ``head``): autograd walks only the graph above layer
``L - K``, so K trades cost for agreement.

Data-parallel training: which all-reduce reduces what. Every gradient is reduced exactly once
per update, as the mean over the workers (the trainer then multiplies ``.grad`` by
``world_size / sample_size``, so the sum over workers divided by the update's sample size):

* ``.grad`` (the CE gradient, or ``CE + term`` for ``head`` / ``top:K``): under
  ``--ddp-backend legacy_ddp`` / ``no_c10d`` by the trainer's
  ``optimizer.all_reduce_grads(model)`` after the last micro-batch; under ``pytorch_ddp`` /
  ``c10d`` by torch's DDP reducer during the last micro-batch's ``optimizer.backward``
  (earlier micro-batches of ``--update-freq`` run under ``no_sync()`` and accumulate
  locally), and ``all_reduce_grads`` leaves it alone. ``torch.autograd.grad`` does not run
  the parameters' gradient accumulators, so it fires none of the reducer's hooks and marks
  no variable ready (with or without ``--find-unused-parameters``): the one ordinary
  backward per micro-batch is the only one DDP sees.
* the contrastive buffer (``all``): by :meth:`AclGrad.decide_update`'s own all-reduce, for
  every backend (the optimizer's ``all_reduce_grads`` never sees it). It runs once per update,
  after the trainer's, so ``.grad`` is already global when the angle is taken.
* the ``head`` / ``top:K`` decision: the scope's two gradients are summed over the workers
  for the angle only (one collective per micro-batch, not under ``no_sync``); what reaches
  ``.grad`` goes through the backward above.

torch's ``static_graph=True`` (not a fairseq option) is refused: its first backward's delayed
all-reduce would be queued by the contrastive ``torch.autograd.grad`` instead.

The angle log (``--acl-grad-log FILE``, one line per decision) is ``angle_log.py``.
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
    """ACL-Grad of one training run (owned by the task; see the module docstring).

    ``log_path`` is ``--acl-grad-log`` (None: no file). The contrastive-gradient buffer
    belongs to one model: it is rebuilt when ``train_step`` sees another model or optimizer.
    """

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
        """At set-up: raises ValueError naming the flag when a K of ``--acl-grad-scope top:K``
        or ``--acl-grad-log-top-k`` does not fit ``model``'s encoder layers."""
        if settings is not None:
            check_scope_fits(model, settings.scope, self.log_top_k)

    def check_log_path(self) -> None:
        """At set-up of a training: raises naming ``--acl-grad-log`` when this worker's angle
        log cannot be written (every worker checks the folder, so all stop together)."""
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
        """Wraps ``optimizer`` once for ``model`` (:class:`AclGradOptimizer`), for every scope:
        the trainer's all-reduce reaches :meth:`decide_update`, its zeroing :meth:`reset`. Another
        model or optimizer gets a new wrapper and, for the exact scope, a new buffer."""
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
        """Drops the buffered contrastive gradient and the statistics of decisions whose update
        was not applied (the trainer zeroed ``.grad``: a new update, or an fp16 overflow)."""
        if self._buffer is not None:
            self._buffer.reset()
        self._pending = []

    def optimizer_step(self, optimizer: Any, step: Callable[[], None]) -> None:
        """The task's ``optimizer_step``: runs ``step`` (the optimizer's), then logs the update's
        decisions (``acl_grad_angle`` / ``acl_grad_drop`` and the angle log), unless the update
        was skipped. fp16's loss scaler skips an overflowing update before this point (the
        trainer zeroes the gradients instead, :meth:`reset`); ``--amp``'s scaler skips it inside
        ``step``, lowering its scale."""
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
        """``--acl-grad-scope all``: decides on the update's exact global gradients, after the
        trainer's all-reduce of ``.grad``, and adds the buffer to ``.grad`` if kept.

        Under ``--ddp-backend pytorch_ddp`` DDP's hooks reduce the CE gradient during the real
        backward; ``torch.autograd.grad`` does not fire them, so the contrastive gradient was
        never reduced: the buffer has its own all-reduce here, with the trainer's convention
        for ``.grad`` (the mean over the workers).
        """
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
        """``--acl-grad-scope head`` / ``top:K``: decides on this micro-batch before its
        backward pass.

        The CE and contrastive gradients of ``params`` only (the heads, plus for ``top:K`` the
        top K encoder layers: autograd walks the graph above them only), summed over the
        data-parallel workers, so every worker decides alike. Returns whether to keep the
        contrastive term.
        """
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
        """Keeps a finite decision (and its angle-log line) for :meth:`optimizer_step`; an
        undefined angle (overflow, a zero gradient) enters no statistic."""
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
