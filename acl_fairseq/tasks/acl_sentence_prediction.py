"""``--task acl_sentence_prediction``: fairseq's ``sentence_prediction`` plus ACL-Grad.

One optimizer update with a criterion that returns separate loss terms (``loss_terms``) and
has ACL-Grad on:

1. ``train_step`` (once per micro-batch): one forward; the contrastive gradient is taken with
   ``torch.autograd.grad`` (scaled like the optimizer scales losses for fp16/AMP) and added to
   a side buffer; then the CE loss goes through the ordinary ``optimizer.backward``, so ``.grad``
   accumulates the CE gradient. Two backward passes per micro-batch.
2. When the trainer all-reduces gradients (``optimizer.all_reduce_grads``, once per update,
   after the last micro-batch and before normalisation and clipping) the buffer is all-reduced
   with the same convention (mean over workers), the angle between the two global gradients is
   computed, rank 0's decision is broadcast, and the buffer is added to ``.grad`` if kept.
   The trainer then normalises, clips and steps as usual.

So the decision is made on the gradients of the whole update (every micro-batch of every
worker): it is the same on all workers, and 1 worker with ``--update-freq k`` decides exactly
like k workers. Under ``--ddp-backend pytorch_ddp`` DDP's hooks reduce the CE gradient during
the real backward; ``autograd.grad`` does not fire them, which is why the buffer has its own
all-reduce. The buffer is dropped whenever the trainer zeroes the gradients.

``--acl-grad-scope head`` (a criterion option) is the cheap approximation: for each
micro-batch, the CE and contrastive gradients of the classification heads' parameters only are
taken (a backward pass through the heads, not the encoder), summed over the workers, and the
decision is made before the micro-batch's single ``optimizer.backward`` of ``CE + term`` or
``CE``. It costs about what CE costs, decides per micro-batch rather than per update, and
agrees with the exact decision only as far as the heads' gradients represent the encoder's
(``benchmarks/acl_grad_agreement.py`` measures how often). With the exact scope the log's
fourth column gives that heads-only angle of the same update, for comparison.

A criterion without separate terms, or with ACL-Grad off, runs fairseq's own ``train_step``.

The task also checks its input where fairseq would fail late or not at all: ``--num-classes``
against ``label/dict.txt``; each split's files (a missing ``label/`` split, ``input1/`` missing
for one split of a pair task, different example counts, empty or multi-token label lines);
examples longer than ``--max-positions`` without ``--shorten-method`` (fairseq would drop them
from training and stop at validation); and a checkpoint of another vocabulary or architecture
(``--restore-file``), each with a message that names the flag or file and the fix; the
checks themselves live in ``acl_fairseq.input_checks``.
"""

import contextlib
import logging
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import metrics
from fairseq.optim.amp_optimizer import AMPOptimizer
from fairseq.tasks import register_task
from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask

from ..grad_align import ContrastiveGradientBuffer, Decision, decide, gradient_angle
from ..input_checks import (
    check_dictionaries,
    check_lengths,
    check_num_classes,
    check_split_files,
    load_state_dict_checked,
)

logger = logging.getLogger(__name__)


@dataclass
class AclSentencePredictionConfig(SentencePredictionConfig):
    acl_grad_log: Optional[str] = field(
        default=None,
        metadata={
            "help": "append one line per decision (update, angle in degrees, kept 0/1, angle "
            "on the classification heads alone) to this TSV file (rank 0 only), e.g. for the "
            "angle histogram; a '{rank}' in the path writes one file per data-parallel worker"
        },
    )


def _scale_like_optimizer(optimizer, loss: torch.Tensor) -> torch.Tensor:
    """Scales ``loss`` as ``optimizer.backward`` would (fp16 / AMP loss scaling)."""
    scaler = getattr(optimizer, "scaler", None)
    return scaler.scale(loss) if scaler is not None else loss


@register_task("acl_sentence_prediction", dataclass=AclSentencePredictionConfig)
class AclSentencePredictionTask(SentencePredictionTask):
    """Sentence(-pair) classification whose ``train_step`` applies ACL-Grad."""

    supports_grad_align = True

    def __init__(self, cfg: AclSentencePredictionConfig, data_dictionary, label_dictionary):
        super().__init__(cfg, data_dictionary, label_dictionary)
        self._buffer: ContrastiveGradientBuffer | None = None
        self._head_indices: list[int] = []  # positions of the heads' parameters in the buffer
        self._threshold = 90.0  # the criterion's --acl-grad-threshold, set in train_step
        self._update_num = 0
        self._last_model: weakref.ref | None = None  # for build_criterion's check

    # ------------------------------------------------------------------ training step
    def train_step(
        self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs
    ):
        threshold = getattr(criterion, "grad_align_threshold", None)
        if threshold is None or not hasattr(criterion, "loss_terms"):
            return super().train_step(
                sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs
            )
        model.train()
        model.set_num_updates(update_num)
        self._update_num = update_num
        self._threshold = threshold
        amp = isinstance(optimizer, AMPOptimizer)
        with torch.autocast("cuda") if amp else contextlib.nullcontext():
            ce_loss, contrastive_loss, sample_size, logging_output = criterion.loss_terms(
                model, sample
            )
        if ignore_grad:
            ce_loss = ce_loss * 0.0
            contrastive_loss = contrastive_loss * 0.0
        if getattr(criterion, "grad_align_scope", "all") == "head":
            keep = self._decide_on_heads(model, optimizer, ce_loss, contrastive_loss)
            optimizer.backward(ce_loss + contrastive_loss if keep else ce_loss)
        else:
            buffer = self._grad_buffer(model, optimizer)
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

    def _grad_buffer(self, model, optimizer) -> ContrastiveGradientBuffer:
        """The side buffer for ``model``; hooks the optimizer once (see module docstring)."""
        if self._buffer is None or getattr(optimizer, "_acl_grad_task", None) is not self:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            self._buffer = ContrastiveGradientBuffer([p for _, p in named])
            self._head_indices = [i for i, (n, _) in enumerate(named) if _is_head_param(n)]
            self._hook_optimizer(optimizer, model)
        return self._buffer

    def _hook_optimizer(self, optimizer, model) -> None:
        all_reduce_grads = optimizer.all_reduce_grads
        zero_grad = optimizer.zero_grad

        def all_reduce_grads_then_decide(module):
            all_reduce_grads(module)
            if module is model:
                self._decide_and_apply()

        def zero_grad_and_buffer():
            zero_grad()
            if self._buffer is not None:
                self._buffer.reset()

        optimizer.all_reduce_grads = all_reduce_grads_then_decide
        optimizer.zero_grad = zero_grad_and_buffer
        optimizer._acl_grad_task = self

    def _decide_and_apply(self) -> Decision | None:
        """``--acl-grad-scope all``: decides on the update's exact global gradients."""
        buffer = self._buffer
        if buffer is None or buffer.empty:
            return None
        world_size = distributed_utils.get_data_parallel_world_size()
        if world_size > 1:
            group = distributed_utils.get_data_parallel_group()

            def mean_all_reduce(t: torch.Tensor) -> None:
                t.div_(world_size)
                distributed_utils.all_reduce(t, group)

            buffer.all_reduce(mean_all_reduce)
        angle = _rank0_value(buffer.angle_to_grad(), buffer.params[0].device)
        decision = decide(angle, self._threshold)
        # the angle on the heads alone, as --acl-grad-scope head would measure it (logged only)
        head_angle = buffer.angle_to_grad(self._head_indices)
        if decision.keep:
            buffer.add_to_grad()
        else:
            buffer.reset()
        self._log_decision(decision, head_angle)
        return decision

    def _decide_on_heads(self, model, optimizer, ce_loss, contrastive_loss) -> bool:
        """``--acl-grad-scope head``: decides on this micro-batch before its backward pass.

        The CE and contrastive gradients of the classification heads' parameters only (a
        backward pass through the heads, not the encoder), summed over the data-parallel
        workers, so every worker decides alike. Returns whether to keep the contrastive term.
        """
        params = [p for n, p in model.named_parameters() if p.requires_grad and _is_head_param(n)]
        if not params:
            raise ValueError(
                "--acl-grad-scope head measures the angle on the classification heads, but "
                "the model has no trainable 'classification_heads' parameters; use "
                "--acl-grad-scope all"
            )
        g_ce = _grads_or_zeros(_scale_like_optimizer(optimizer, ce_loss), params)
        g_con = _grads_or_zeros(_scale_like_optimizer(optimizer, contrastive_loss), params)
        if distributed_utils.get_data_parallel_world_size() > 1:
            flat = torch.cat([g.reshape(-1).float() for g in g_ce + g_con])
            distributed_utils.all_reduce(flat, distributed_utils.get_data_parallel_group())
            sizes = [g.numel() for g in g_ce + g_con]
            parts = flat.split(sizes)
            g_ce, g_con = list(parts[: len(params)]), list(parts[len(params) :])
        angle = _rank0_value(gradient_angle(g_ce, g_con), params[0].device)
        decision = decide(angle, self._threshold)
        self._log_decision(decision, angle)
        return decision.keep

    def _log_decision(self, decision: Decision, head_angle: float) -> None:
        if not decision.finite:
            return  # overflow or zero gradient: no statistic, the trainer handles overflow
        metrics.log_scalar("acl_grad_angle", decision.angle, weight=1, round=1)
        metrics.log_scalar("acl_grad_drop", 0.0 if decision.keep else 1.0, weight=1, round=3)
        path = self.cfg.acl_grad_log
        if not path:
            return
        if "{rank}" in path:
            path = path.replace("{rank}", str(_data_parallel_rank()))
        elif not _is_first_worker():
            return
        with open(path, "a", encoding="utf-8") as f:
            f.write(
                f"{self._update_num}\t{decision.angle:.4f}\t{int(decision.keep)}"
                f"\t{head_angle:.4f}\n"
            )

    # ------------------------------------------------------------------ set-up checks
    @classmethod
    def setup_task(cls, cfg, **kwargs: Any):
        check_dictionaries(cfg)
        task = super().setup_task(cfg, **kwargs)
        if not cfg.regression_target:
            check_num_classes(cfg.num_classes, task.label_dictionary, cfg.data)
        return task

    def load_dataset(self, split, combine=False, **kwargs):
        """fairseq's ``load_dataset``, with the data checked at load time (see
        :func:`check_split_files` and :func:`check_lengths`) rather than failing mid-training."""
        check_split_files(self.cfg, split, self.source_dictionary, self.label_dictionary, combine)
        dataset = super().load_dataset(split, combine=combine, **kwargs)
        check_lengths(self.cfg, split, dataset.sizes)
        return dataset

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        # explain a checkpoint that does not fit before torch's size-mismatch error; a bound
        # method, so that copies of the model (EMA) load into themselves
        model.load_state_dict = types.MethodType(load_state_dict_checked, model)
        self._last_model = weakref.ref(model)
        return model

    def build_criterion(self, cfg, from_checkpoint=False):
        """fairseq's ``build_criterion``; a criterion with a ``check_model`` method checks the
        model just built (fairseq builds the model first), so a criterion/model mismatch
        stops at set-up instead of at the first training step."""
        criterion = super().build_criterion(cfg, from_checkpoint)
        model = self._last_model() if self._last_model is not None else None
        check_model = getattr(criterion, "check_model", None)
        if model is not None and check_model is not None:
            check_model(model)
        return criterion


def _is_head_param(name: str) -> bool:
    return "classification_heads" in name.split(".")


def _grads_or_zeros(loss: torch.Tensor, params: list) -> list[torch.Tensor]:
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


def _is_first_worker() -> bool:
    return _data_parallel_rank() == 0
