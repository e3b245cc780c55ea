"""Shared fairseq glue of the single-exit contrastive criterions (ACL-Embed and CE+SCL).

A criterion here returns its loss as separate terms (:class:`LossTerms`), so the task's
``train_step`` can compare their gradients (ACL-Grad). ``forward`` returns their sum, which
is what validation and a plain ``train_step`` use.

Losses are summed over the batch like fairseq's ``sentence_prediction``: the contrastive term
is ``lambda * N * contrastive_mean`` so that, after the trainer divides by ``sample_size = N``,
the objective is ``CE_mean + lambda * contrastive_mean``.
"""

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from fairseq.criterions.sentence_prediction import (
    SentencePredictionConfig,
    SentencePredictionCriterion,
)
from fairseq.dataclass import ChoiceEnum
from fairseq.logging import metrics
from torch import Tensor, nn

ACL_GRAD_SCOPE = ChoiceEnum(["all", "head"])
ACL_GRAD_SCOPE_HELP = (
    "parameters the ACL-Grad angle is measured on. 'all': every trainable parameter, decided "
    "once per update on the exact gradients (a second backward pass, about 1.7-2x the cost of "
    "CE per update); 'head': only the classification heads' parameters, decided per "
    "micro-batch before its single backward pass (an approximation, about the cost of CE)"
)


class LossTerms(NamedTuple):
    """The loss of one batch as separate terms (both summed over the batch)."""

    ce_loss: Tensor
    contrastive_loss: Tensor
    sample_size: int
    logging_output: dict[str, Any]


@dataclass
class ContrastiveConfig(SentencePredictionConfig):
    contrastive_lambda: float = field(
        default=0.5,
        metadata={"help": "weight lambda of the contrastive term: loss = CE + lambda * term"},
    )
    temperature: float = field(
        default=0.3,
        metadata={"help": "temperature tau (> 0) of the supervised contrastive loss"},
    )
    acl_grad_threshold: float = field(
        default=90.0,
        metadata={
            "help": "ACL-Grad: drop the contrastive term for an update when the angle between "
            "the CE gradient and the contrastive gradient exceeds this many degrees (0..180)"
        },
    )
    acl_grad_scope: ACL_GRAD_SCOPE = field(  # type: ignore[valid-type]
        default="all", metadata={"help": ACL_GRAD_SCOPE_HELP}
    )


def validate_contrastive_config(cfg: ContrastiveConfig, criterion_name: str) -> None:
    """Raises ValueError naming the flag when a hyper-parameter is out of range."""
    if cfg.regression_target:
        raise ValueError(
            f"--criterion {criterion_name} is for classification: a contrastive loss needs "
            "class labels, but --regression-target is set (e.g. STS-B). Use --criterion "
            "sentence_prediction for regression tasks."
        )
    lam = cfg.contrastive_lambda
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"--contrastive-lambda must be a finite number >= 0, got {lam}")
    tau = cfg.temperature
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"--temperature must be > 0 (e.g. 0.1 or 0.3), got {tau}")
    thr = cfg.acl_grad_threshold
    if not (0.0 <= thr <= 180.0):
        raise ValueError(f"--acl-grad-threshold is an angle in degrees in [0, 180], got {thr}")


@contextlib.contextmanager
def capture_input(module: nn.Module) -> Iterator[list[Tensor]]:
    """Records the first positional input of ``module`` during the ``with`` block.

    Used to read a classification head's pooled feature ``h`` (the input of its
    ``out_proj``) without copying the head's forward.
    """
    seen: list[Tensor] = []

    def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
        seen.append(args[0])

    handle = module.register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def classification_head(model: nn.Module, name: str) -> nn.Module:
    heads = getattr(model, "classification_heads", None)
    if heads is None or name not in heads:
        raise ValueError(
            f"the model has no classification head '{name}' (--classification-head-name); "
            "use a RoBERTa-style model and --task acl_sentence_prediction or sentence_prediction"
        )
    head = heads[name]
    if not isinstance(getattr(head, "out_proj", None), nn.Linear):
        raise ValueError(
            f"classification head '{name}' has no nn.Linear 'out_proj': the contrastive "
            "criterions read the pooled feature and label embeddings from it"
        )
    return head


def add_predictions(
    criterion: SentencePredictionCriterion, logging_output: dict, preds: Tensor, targets: Tensor
) -> None:
    """Label strings of predictions and targets for MCC / F1 in validation, as fairseq does."""
    offset = criterion.label_dict.nspecial
    label_string = criterion.label_dict.string
    logging_output["pred"] = list(map(int, label_string(preds + offset).split()))
    logging_output["targ"] = list(map(int, label_string(targets + offset).split()))
    if criterion.report_mcc:
        logging_output["report_mcc"] = True
    if criterion.report_acc_and_f1:
        logging_output["report_acc_and_f1"] = True


class LossTermsCriterion(SentencePredictionCriterion):
    """A ``sentence_prediction`` criterion whose loss is CE + a contrastive term.

    Subclasses implement ``loss_terms``; ``forward`` returns the sum, and the metrics are
    fairseq's (accuracy, MCC / F1 when asked) plus ``ce_loss`` and ``contrastive_loss``.
    """

    def loss_terms(self, model: nn.Module, sample: dict[str, Any]) -> LossTerms:
        raise NotImplementedError

    def terms_logging_output(
        self, model, sample, ce_loss: Tensor, contrastive_loss: Tensor, logits: Tensor,
        targets: Tensor,
    ) -> dict[str, Any]:  # fmt: skip
        """fairseq's logging output for ``logits`` (N x K) plus the two terms."""
        sample_size = targets.numel()
        preds = logits.argmax(dim=1)
        logging_output: dict[str, Any] = {
            "loss": (ce_loss + contrastive_loss).data,
            "ce_loss": ce_loss.data,
            "contrastive_loss": contrastive_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample_size,
            "sample_size": sample_size,
            "ncorrect": (preds == targets).sum(),
        }
        if self.keep_pred_and_targ and not model.training:
            add_predictions(self, logging_output, preds, targets)
        return logging_output

    def forward(self, model, sample, reduce=True):
        ce_loss, contrastive_loss, sample_size, logging_output = self.loss_terms(model, sample)
        return ce_loss + contrastive_loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        SentencePredictionCriterion.reduce_metrics(logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        for key in ("ce_loss", "contrastive_loss"):
            total = sum(log.get(key, 0) for log in logging_outputs)
            metrics.log_scalar(key, total / (sample_size or 1) / math.log(2), sample_size, round=3)


class ContrastiveSentencePredictionCriterion(LossTermsCriterion):
    """CE plus a contrastive term on the head's pooled feature; subclasses pick the term."""

    name = "contrastive"

    def __init__(self, cfg: ContrastiveConfig, task, use_acl_grad: bool):
        validate_contrastive_config(cfg, self.name)
        super().__init__(cfg, task)
        self.contrastive_lambda = cfg.contrastive_lambda
        self.temperature = cfg.temperature
        self.acl_grad_threshold = cfg.acl_grad_threshold
        self.grad_align_scope = str(cfg.acl_grad_scope)
        self.use_acl_grad = use_acl_grad
        if use_acl_grad and not getattr(task, "supports_grad_align", False):
            raise ValueError(
                f"--criterion {self.name} with ACL-Grad needs --task acl_sentence_prediction "
                f"(its train_step compares the gradients); got --task "
                f"{getattr(task.cfg, '_name', type(task).__name__)}. Switch the task, or turn "
                "ACL-Grad off."
            )

    @property
    def grad_align_threshold(self) -> float | None:
        """Angle (degrees) for ACL-Grad in the task's ``train_step``; None when it is off."""
        return self.acl_grad_threshold if self.use_acl_grad else None

    def contrastive_term(
        self, features: Tensor, targets: Tensor, label_embeddings: Tensor
    ) -> Tensor:
        """Mean contrastive loss of the batch. features N x C, targets N, labels K x C."""
        raise NotImplementedError

    def loss_terms(self, model: nn.Module, sample: dict[str, Any]) -> LossTerms:
        head = classification_head(model, self.classification_head_name)
        with capture_input(head.out_proj) as pooled:
            logits, _ = model(
                **sample["net_input"],
                features_only=True,
                classification_head_name=self.classification_head_name,
            )
        features = pooled[-1]  # N x C
        targets = model.get_targets(sample, [logits]).view(-1)
        num_classes = logits.size(-1)
        if targets.numel() and (targets.min() < 0 or targets.max() >= num_classes):
            raise ValueError(
                f"a target label id is outside [0, {num_classes}): --num-classes "
                f"{num_classes} does not match the label dictionary of the data"
            )
        sample_size = targets.numel()
        lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        ce_loss = F.nll_loss(lprobs, targets, reduction="sum")
        if self.contrastive_lambda > 0:
            term = self.contrastive_term(features, targets, head.out_proj.weight)
            contrastive_loss = self.contrastive_lambda * sample_size * term
        else:
            contrastive_loss = features.sum() * 0.0
        logging_output = self.terms_logging_output(
            model, sample, ce_loss, contrastive_loss, logits, targets
        )
        return LossTerms(ce_loss, contrastive_loss, sample_size, logging_output)
