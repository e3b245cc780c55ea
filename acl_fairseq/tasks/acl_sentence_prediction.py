"""``--task acl_sentence_prediction``: fairseq's ``sentence_prediction`` plus ACL-Grad.

With ACL-Grad on, ``train_step`` hands the micro-batch to the task's
:class:`~acl_fairseq.acl_grad.AclGrad`; otherwise fairseq's own ``train_step`` runs.
``--acl-grad-log`` is a task flag, so it works for every criterion. At set-up and load the
task checks what fairseq would fail on late or not at all (the data: ``input_checks``; the
checkpoint; the criterion against the model and ``--batch-size``), naming the flag or file.
``--group-by-length`` batches examples of similar length (less padding).
"""

import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from fairseq.data import SortDataset
from fairseq.tasks import register_task
from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask
from omegaconf import II

from ..acl_grad import AclGrad, AclGradCriterion, AclGradLogConfig
from ..autocast import AutocastConfig, check_autocast, forward_precision
from ..checkpoint.fits import load_state_dict_checked
from ..checkpoint.training_data import record_training_data
from ..distributed import DataParallelConfig, check_unused_parameters
from ..errors import AclValueError
from ..fairseq_patches import mark_in_use
from .input_checks import check_dictionaries, check_lengths, check_num_classes, check_split_files


@dataclass
class AclSentencePredictionConfig(
    SentencePredictionConfig, AclGradLogConfig, AutocastConfig, DataParallelConfig
):
    group_by_length: bool = field(
        default=False,
        metadata={
            "help": "batch examples of similar length together: each split is ordered by length "
            "(ties in the seeded shuffled order), cut into batches, and fairseq shuffles the "
            "batches' order every epoch. Less padding, so faster training on inputs of uneven "
            "length (sentence pairs); the batches' composition is then fixed for the run"
        },
    )
    batch_size: Optional[int] = II("dataset.batch_size")  # for the criterion's set-up check


@register_task("acl_sentence_prediction", dataclass=AclSentencePredictionConfig)
class AclSentencePredictionTask(SentencePredictionTask):
    """Sentence(-pair) classification whose ``train_step`` applies ACL-Grad."""

    def __init__(self, cfg: AclSentencePredictionConfig, data_dictionary, label_dictionary):
        super().__init__(cfg, data_dictionary, label_dictionary)
        self.autocast = str(cfg.autocast)
        self.acl_grad = AclGrad(
            log_path=cfg.acl_grad_log, log_top_k=cfg.acl_grad_log_top_k, autocast=self.autocast
        )
        self._last_model: weakref.ref | None = None  # for build_criterion's check
        self.training = True  # False: set up to load a checkpoint (setup_task)

    def train_step(
        self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs
    ):
        model.train()
        model.set_num_updates(update_num)
        if hasattr(criterion, "set_num_updates"):  # a criterion scheduled by update (BERxiT's)
            criterion.set_num_updates(update_num)
        if isinstance(criterion, AclGradCriterion) and criterion.acl_grad is not None:
            return self.acl_grad.train_step(
                sample, model, criterion, optimizer, update_num, ignore_grad
            )
        if self.autocast == "none":
            return super().train_step(
                sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs
            )
        # fairseq's train_step, with the forward pass (only) under --autocast
        with forward_precision(self.autocast, model, optimizer):
            loss, sample_size, logging_output = criterion(model, sample)
        if ignore_grad:
            loss *= 0
        optimizer.backward(loss)
        return loss, sample_size, logging_output

    def valid_step(self, sample, model, criterion):
        with forward_precision(self.autocast, model):
            return super().valid_step(sample, model, criterion)

    def optimizer_step(self, optimizer, model, update_num):
        """fairseq's step; then the update's ACL-Grad statistics, unless it was skipped."""
        step = super().optimizer_step
        self.acl_grad.optimizer_step(optimizer, lambda: step(optimizer, model, update_num))

    # ------------------------------------------------------------------ set-up checks
    @classmethod
    def setup_task(cls, cfg, **kwargs: Any):
        mark_in_use("task acl_sentence_prediction")  # the guard rails act on this run
        check_autocast(cfg)
        check_dictionaries(cfg)
        task = super().setup_task(cfg, **kwargs)
        loading = bool(kwargs.get("from_checkpoint"))  # loading a checkpoint, not training
        task.training = not loading
        if not cfg.regression_target:
            check_num_classes(cfg.num_classes, task.label_dictionary, cfg.data, loading)
        record_training_data(task, loading)  # the data folder and labels, in the checkpoint
        if not loading:
            task.acl_grad.check_log_path()  # --acl-grad-log's folder, before the first update
        return task

    def load_dataset(self, split, combine=False, **kwargs):
        """fairseq's ``load_dataset``, with the data checked at load time (see
        :func:`check_split_files` and :func:`check_lengths`) rather than failing mid-training."""
        check_split_files(self.cfg, split, self.source_dictionary, self.label_dictionary, combine)
        dataset = super().load_dataset(split, combine=combine, **kwargs)
        check_lengths(self.cfg, split, dataset.sizes)
        if self.cfg.group_by_length:
            self.datasets[split] = dataset = group_by_length(dataset)
        return dataset

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        # explain a checkpoint that does not fit before torch's size-mismatch error; a bound
        # method, so that copies of the model (EMA) load into themselves
        model.load_state_dict = types.MethodType(load_state_dict_checked, model)
        self._last_model = weakref.ref(model)
        if not from_checkpoint and hasattr(model, "use_frozen_cache"):
            model.use_frozen_cache()  # --freeze-backbone: the frozen part once per sentence
        if not from_checkpoint:  # RoBERTa's LM head is no part of sentence classification
            lm_head = [n for n, p in model.named_parameters() if p.requires_grad and "lm_head" in n]
            check_unused_parameters(self.cfg, lm_head)
        return model

    def build_criterion(self, cfg, from_checkpoint=False):
        """fairseq's ``build_criterion``; an :class:`AclGradCriterion` checks the model just
        built (fairseq builds the model first), so a criterion/model mismatch stops at set-up
        instead of at the first training step."""
        criterion = super().build_criterion(cfg, from_checkpoint)
        model = self._last_model() if self._last_model is not None else None
        if model is not None and isinstance(criterion, AclGradCriterion):
            criterion.check_model(model)
            self.acl_grad.check_model(model, criterion.acl_grad)
        training = self.training and not from_checkpoint
        check_batch_size = getattr(criterion, "check_batch_size", None)
        if training and check_batch_size is not None:
            check_batch_size(getattr(self.cfg, "batch_size", None), self.cfg.num_classes)
        if training and model is not None:
            check_frozen_backbone(model, criterion, getattr(cfg, "_name", type(criterion).__name__))
        return criterion


def check_frozen_backbone(model: Any, criterion: Any, name: str) -> None:
    """``--freeze-backbone`` leaves only the shallow exits' heads trainable: a criterion that
    trains the final exit only would have nothing to train (torch's "element 0 of tensors does
    not require grad" at the first update)."""
    frozen = getattr(getattr(model, "args", None), "freeze_backbone", False)
    if frozen and not hasattr(criterion, "exit_outputs"):
        raise AclValueError(
            f"--freeze-backbone trains only the shallow exits' heads, but --criterion {name} "
            "trains the final exit only, so nothing would train. Use --criterion multi_exit_ce "
            "or acl_cross_layer (a stage that refits the exits, docs/usage.md), or drop "
            "--freeze-backbone"
        )


def group_by_length(dataset):
    """``dataset`` ordered by length (its examples' token counts; ties keep the order
    ``dataset`` had, e.g. fairseq's seeded shuffle), for batches of similar length."""
    sizes = dataset.sizes  # sentence_prediction's: a list holding one array (src_tokens)
    if isinstance(sizes, (list, tuple)):
        sizes = np.max(np.stack([np.asarray(s) for s in sizes]), axis=0)
    if isinstance(dataset, SortDataset):  # sentence_prediction's shuffle: length goes last,
        dataset.sort_order = [*dataset.sort_order, sizes]  # np.lexsort's primary key
        return dataset
    return SortDataset(dataset, sort_order=[dataset.ordered_indices().argsort(), sizes])
