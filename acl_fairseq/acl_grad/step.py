"""ACL-Grad in fairseq's training loop: its flags, the task/criterion contract, the step.

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
   normalisation and clipping; :class:`AclGradOptimizer` is how it gets there): the buffer is
   all-reduced with the trainer's convention (mean over workers), the angle between the two
   global gradients is taken, rank 0's decision is broadcast, and the buffer is added to
   ``.grad`` if kept. The trainer then normalises, clips and steps as usual.

So the decision is made on the gradients of the whole update (every micro-batch of every
worker): it is the same on all workers, and 1 worker with ``--update-freq k`` decides exactly
like k workers. The buffer is dropped whenever the trainer zeroes the gradients.

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

The angle log (``--acl-grad-log FILE``, one line per decision) is ``angle_log.py``.
"""

import argparse
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Protocol, runtime_checkable

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import metrics
from fairseq.optim.amp_optimizer import AMPOptimizer
from torch import Tensor, nn

from .angle_log import AngleRecord, append_angle_record
from .angles import ContrastiveGradientBuffer, Decision, decide, gradient_angle
from .scope import (
    check_k,
    check_scope_fits,
    encoder_layer_count,
    is_head_param,
    parse_log_top_k,
    parse_scope,
    scope_indices,
)

# ----------------------------------------------------------------------------- flags
_SWITCH_HELP = (
    "ACL-Grad on (--acl-grad) or off (--no-acl-grad; in a hydra config acl_grad: false): "
    "drop the contrastive term of an update whose gradient conflicts with the CE gradient"
)


def acl_grad_switch(default: bool) -> Any:
    """The dataclass field of the ACL-Grad on/off switch, with ``default``."""
    return field(default=default, metadata={"help": _SWITCH_HELP})


@dataclass
class AclGradConfig(FairseqDataclass):
    """ACL-Grad's criterion flags, mixed into the config of every criterion that has it.

    One bool, ``acl_grad``: ``--acl-grad`` turns it on, ``--no-acl-grad`` off (both spellings
    exist for every criterion, see :func:`add_acl_grad_switch`); on by default here, a config
    may override the default with :func:`acl_grad_switch`.
    """

    acl_grad: bool = acl_grad_switch(default=True)
    acl_grad_threshold: float = field(
        default=90.0,
        metadata={
            "help": "ACL-Grad: drop the contrastive term(s) of an update when the angle between "
            "the (total) CE gradient and the (total) contrastive gradient exceeds this many "
            "degrees (0..180)"
        },
    )
    acl_grad_scope: str = field(
        default="all",
        metadata={
            "help": "parameters the ACL-Grad angle is measured on. 'all': every trainable "
            "parameter, decided once per update on the exact gradients (a second backward "
            "pass, about 1.7-2x the cost of CE per update); 'head': only the classification "
            "heads' parameters, decided per micro-batch before its single backward pass (an "
            "approximation, about the cost of CE); 'top:K': the heads plus the top K encoder "
            "layers, likewise per micro-batch (top:0 is head; cost grows with K)"
        },
    )


@dataclass
class AclGradLogConfig(FairseqDataclass):
    """ACL-Grad's task flag: the angle log is written by the task, for any criterion."""

    acl_grad_log: Optional[str] = field(
        default=None,
        metadata={
            "help": "append one line per ACL-Grad decision (update, angle in degrees, kept 0/1, "
            "angle on the classification heads alone) to this TSV file (rank 0 only), e.g. for "
            "the angle histogram; a '{rank}' in the path writes one file per data-parallel worker"
        },
    )
    acl_grad_log_top_k: Optional[str] = field(
        default=None,
        metadata={
            "help": "with --acl-grad-scope all and --acl-grad-log: also log, per K of this comma "
            "list (e.g. 1,2,3), the angle of the same update on the classification heads plus "
            "the top K encoder layers (what --acl-grad-scope top:K would measure)"
        },
    )


def add_acl_grad_switch(parser: argparse.ArgumentParser, default: bool) -> None:
    """Registers ``--acl-grad`` / ``--no-acl-grad`` on ``parser`` (one bool, ``acl_grad``).

    fairseq's ``gen_parser_from_dataclass`` would register a bool field as a single flag that
    *flips* its default (``--acl-grad`` would turn ACL-Grad off where it is on by default);
    called first, this registers both spellings, and fairseq skips the field's own flag as a
    duplicate.
    """
    parser.add_argument(
        "--acl-grad", action=argparse.BooleanOptionalAction, default=default, help=_SWITCH_HELP
    )


@dataclass(frozen=True)
class AclGradSettings:
    """What the training step needs of a criterion's ACL-Grad flags (checked beforehand by
    the criterion's validator, ``criterions.base.validate_criterion_config``)."""

    threshold: float  # degrees
    scope: str  # "all", "head" or "top:K"

    @property
    def top_k(self) -> int | None:
        """K of ``top:K`` (0 for ``head``); None for the exact scope ``all``."""
        return parse_scope(self.scope)

    @classmethod
    def from_config(cls, cfg: Any) -> "AclGradSettings | None":
        """The settings of an :class:`AclGradConfig` (or its hydra node); None when off.
        Raises ValueError naming ``--acl-grad-scope`` for a value of the wrong form."""
        parse_scope(str(cfg.acl_grad_scope))  # the form, at set-up (even when off)
        if not cfg.acl_grad:
            return None
        return cls(threshold=float(cfg.acl_grad_threshold), scope=str(cfg.acl_grad_scope))


# ----------------------------------------------------------------------------- contract
class LossTerms(NamedTuple):
    """The loss of one batch as separate terms (both summed over the batch)."""

    ce_loss: Tensor
    contrastive_loss: Tensor
    sample_size: int
    logging_output: dict[str, Any]


@runtime_checkable
class AclGradCriterion(Protocol):
    """What ``--task acl_sentence_prediction`` needs of a criterion.

    ``acl_grad`` is None when ACL-Grad is off (the task then runs fairseq's own
    ``train_step``); ``check_model`` raises ValueError, naming the flag to change, when the
    model just built cannot train with this criterion.
    """

    acl_grad: AclGradSettings | None

    def loss_terms(self, model: nn.Module, sample: dict[str, Any]) -> LossTerms: ...

    def check_model(self, model: nn.Module) -> None: ...


@runtime_checkable
class AclGradTask(Protocol):
    """A task whose ``train_step`` runs ACL-Grad (``--task acl_sentence_prediction``)."""

    acl_grad: "AclGrad"


# ----------------------------------------------------------------------------- the unit
class AclGrad:
    """ACL-Grad of one training run (owned by the task; see the module docstring).

    ``log_path`` is ``--acl-grad-log`` (None: no file). The contrastive-gradient buffer
    belongs to one model: it is rebuilt when ``train_step`` sees another model or optimizer.
    """

    def __init__(self, log_path: str | None = None, log_top_k: str | None = None):
        self.log_path = log_path
        self.log_top_k = parse_log_top_k(log_top_k)  # --acl-grad-log-top-k
        self.settings: AclGradSettings | None = None
        self.update_num = 0
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
        amp = isinstance(optimizer, AMPOptimizer)
        with torch.autocast("cuda") if amp else contextlib.nullcontext():
            ce_loss, contrastive_loss, sample_size, logging_output = criterion.loss_terms(
                model, sample
            )
        if ignore_grad:
            ce_loss = ce_loss * 0.0
            contrastive_loss = contrastive_loss * 0.0
        top_k = self.settings.top_k
        if top_k is not None:
            params = self._params_of_scope(model, top_k)
            keep = self._decide_on_subset(params, optimizer, ce_loss, contrastive_loss)
            optimizer.backward(ce_loss + contrastive_loss if keep else ce_loss)
        else:
            buffer = self._buffer_for(model, criterion, optimizer)
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

    def _buffer_for(
        self, model: nn.Module, criterion: Any, optimizer: Any
    ) -> ContrastiveGradientBuffer:
        """The side buffer of ``model``; wraps ``optimizer`` once (:class:`AclGradOptimizer`)."""
        wrapper = self._optimizer
        if self._buffer is None or wrapper is None or not wrapper.wraps(optimizer, model):
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            self._buffer = ContrastiveGradientBuffer([p for _, p in named])
            names = [n for n, _ in named]
            self._head_indices = [i for i, n in enumerate(names) if is_head_param(n)]
            num_layers = encoder_layer_count(model)
            self._top_indices = {
                k: scope_indices(names, k, num_layers) for k in self.log_top_k if k <= num_layers
            }
            self._optimizer = AclGradOptimizer.install(optimizer, self, model, criterion)
        return self._buffer

    def reset(self) -> None:
        """Drops the buffered contrastive gradient (the trainer zeroed ``.grad``)."""
        if self._buffer is not None:
            self._buffer.reset()

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
        path = self._log_file()
        if path is not None and decision.finite:
            # the angles --acl-grad-scope head and top:K would measure (logged only)
            head_angle = buffer.angle_to_grad(self._head_indices)
            top = tuple((k, buffer.angle_to_grad(i)) for k, i in self._top_indices.items())
        if decision.keep:
            buffer.add_to_grad()
        else:
            buffer.reset()
        self._log_metrics(decision)
        if path is not None and decision.finite:
            record = AngleRecord(self.update_num, decision.angle, decision.keep, head_angle, top)
            append_angle_record(path, record)
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
            raise ValueError(
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
        self._log_metrics(decision)
        path = self._log_file()
        if path is not None and decision.finite:
            append_angle_record(path, AngleRecord(self.update_num, angle, decision.keep, angle))
        return decision.keep

    @staticmethod
    def _log_metrics(decision: Decision) -> None:
        """The ``acl_grad_angle`` / ``acl_grad_drop`` metrics of a finite decision (overflow or
        a zero gradient: no statistic, the trainer handles overflow)."""
        if decision.finite:
            metrics.log_scalar("acl_grad_angle", decision.angle, weight=1, round=1)
            metrics.log_scalar("acl_grad_drop", 0.0 if decision.keep else 1.0, weight=1, round=3)

    def _log_file(self) -> str | None:
        """The angle-log file this worker writes (``--acl-grad-log``); None: none."""
        path = self.log_path
        if not path:
            return None
        if "{rank}" in path:
            return path.replace("{rank}", str(_data_parallel_rank()))
        return path if _data_parallel_rank() == 0 else None


class AclGradOptimizer:
    """The trainer's optimizer, seen by ACL-Grad at the two points of an update that a task's
    ``train_step`` does not see: the all-reduce of the gradients and their zeroing.

    fairseq gives a task no hook to build or replace the trainer's optimizer, so
    :meth:`install` shadows two methods of that optimizer *instance* with this object's
    (everything else of the optimizer is untouched):

    * ``all_reduce_grads(module)``: the optimizer's own, then, for the model the buffer
      belongs to, :meth:`AclGrad.decide_update`. The trainer also calls it on its criterion
      when that has parameters (they are not in the buffer: passed through). Any other
      module is an error: the contrastive gradient of the update would be lost silently.
    * ``zero_grad()``: the optimizer's own, then :meth:`AclGrad.reset` (e.g. after an OOM, the
      trainer zeroes the gradients and starts the update again).
    """

    _ATTRIBUTE = "_acl_grad_optimizer"  # where the installed wrapper is kept on the optimizer

    def __init__(self, optimizer: Any, unit: AclGrad, model: nn.Module, criterion: Any):
        self._all_reduce_grads = optimizer.all_reduce_grads  # the optimizer's own methods
        self._zero_grad = optimizer.zero_grad
        self._optimizer = weakref.ref(optimizer)
        self._model = weakref.ref(model)
        self._criterion = weakref.ref(criterion) if isinstance(criterion, nn.Module) else None
        self.unit = unit

    @classmethod
    def of(cls, optimizer: Any) -> "AclGradOptimizer | None":
        """The wrapper installed on ``optimizer``, if any."""
        return vars(optimizer).get(cls._ATTRIBUTE)

    @classmethod
    def install(
        cls, optimizer: Any, unit: AclGrad, model: nn.Module, criterion: Any
    ) -> "AclGradOptimizer":
        """Wraps ``optimizer`` for ``unit`` and ``model`` (replacing an earlier wrapper)."""
        previous = cls.of(optimizer)
        if previous is not None:
            previous.uninstall()
        wrapper = cls(optimizer, unit, model, criterion)
        optimizer.all_reduce_grads = wrapper.all_reduce_grads
        optimizer.zero_grad = wrapper.zero_grad
        setattr(optimizer, cls._ATTRIBUTE, wrapper)
        return wrapper

    def uninstall(self) -> None:
        """Gives the optimizer its own two methods back."""
        optimizer = self._optimizer()
        if optimizer is not None and self.of(optimizer) is self:
            for name in ("all_reduce_grads", "zero_grad", self._ATTRIBUTE):
                delattr(optimizer, name)

    def wraps(self, optimizer: Any, model: nn.Module) -> bool:
        return self._optimizer() is optimizer and self._model() is model

    def all_reduce_grads(self, module: nn.Module) -> None:
        self._all_reduce_grads(module)
        if module is self._model():
            self.unit.decide_update()
        elif self._criterion is None or module is not self._criterion():
            raise RuntimeError(
                f"ACL-Grad: the optimizer's all_reduce_grads was called on a "
                f"{type(module).__name__}, not on the model whose contrastive gradient is "
                "buffered; that gradient would be dropped without a decision. The trainer "
                "must pass task.train_step and optimizer.all_reduce_grads the same model; or "
                "turn ACL-Grad off (--no-acl-grad) or use --acl-grad-scope head (no buffer)."
            )

    def zero_grad(self) -> None:
        self._zero_grad()
        self.unit.reset()


# ----------------------------------------------------------------------------- helpers
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
