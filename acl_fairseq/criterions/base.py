"""What the criterions share: config mixins, their one validator, the loss-terms criterion.

:class:`ContrastiveConfig` and :class:`~acl_fairseq.acl_grad.AclGradConfig` are mixed into
the criterions' configs, checked by :func:`validate_criterion_config`. A criterion returns its
loss as terms (:class:`LossTerms`) so ACL-Grad can compare their gradients; ``forward``
returns the sum. The contrastive term is ``lambda * N * mean``, so that after fairseq divides
by ``sample_size = N`` the objective is ``CE_mean + lambda * contrastive_mean``.
"""

import argparse
import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from fairseq.criterions.sentence_prediction import (
    SentencePredictionConfig,
    SentencePredictionCriterion,
)
from fairseq.dataclass import FairseqDataclass
from fairseq.logging import metrics
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from ..acl_grad.config import AclGradConfig, AclGradSettings, add_acl_grad_switch
from ..acl_grad.contract import AclGradTask, LossTerms
from ..autocast import full_precision
from ..errors import AclValueError
from ..fairseq_patches import mark_in_use

__all__ = [
    "ContrastiveConfig",
    "ContrastiveSentencePredictionConfig",
    "ContrastiveSentencePredictionCriterion",
    "config_type",
    "LossTerms",
    "LossTermsCriterion",
    "validate_criterion_config",
]


@dataclass
class ContrastiveConfig(FairseqDataclass):
    """The contrastive term's flags, mixed into the config of every contrastive criterion."""

    contrastive_lambda: float = field(
        default=0.5,
        metadata={
            "help": "weight lambda of the contrastive term: loss = CE + lambda * term (for "
            "acl_cross_layer, of ACL-Embed on the last exit)"
        },
    )
    temperature: float = field(
        default=0.3,
        metadata={"help": "temperature tau (> 0) of the supervised contrastive loss(es)"},
    )


@dataclass
class ContrastiveSentencePredictionConfig(
    SentencePredictionConfig, ContrastiveConfig, AclGradConfig
):
    """``acl_embed`` and ``ce_scl``: fairseq's sentence prediction, the term, ACL-Grad."""


def _finite_at_least_zero(x: float) -> bool:
    return math.isfinite(x) and x >= 0


# config field -> (test, the error message for a value that fails it)
_RULES = {
    "contrastive_lambda": (
        _finite_at_least_zero,
        "--contrastive-lambda must be a finite number >= 0, got {}",
    ),
    "cross_layer_lambda": (
        _finite_at_least_zero,
        "--cross-layer-lambda must be a finite number >= 0, got {}",
    ),
    "temperature": (
        lambda x: math.isfinite(x) and x > 0,
        "--temperature must be > 0 (e.g. 0.1 or 0.3), got {}",
    ),
    "self_distill_weight": (
        _finite_at_least_zero,
        "--self-distill-weight must be a finite number >= 0 (0: no self-distillation), got {}",
    ),
    "self_distill_temperature": (
        lambda x: math.isfinite(x) and x > 0,
        "--self-distill-temperature must be a finite number > 0 (e.g. 1 or 2), got {}",
    ),
    "acl_grad_threshold": (
        lambda x: 0.0 <= x <= 180.0,
        "--acl-grad-threshold is an angle in degrees in [0, 180], got {}",
    ),
}


def config_type(cfg: Any) -> type:
    """The dataclass of a criterion config: ``cfg`` itself or the one behind its hydra node."""
    return OmegaConf.get_type(cfg) if isinstance(cfg, DictConfig) else type(cfg)


def validate_criterion_config(cfg: Any, criterion_name: str) -> None:
    """Raises naming the flag when a hyper-parameter of ``cfg`` (a dataclass or hydra node)
    is out of range; each rule applies to the configs that have its field."""
    fields = {f.name for f in dataclasses.fields(config_type(cfg))}
    if cfg.regression_target:
        needs = "a contrastive loss needs" if "temperature" in fields else "it needs"
        raise AclValueError(
            f"--criterion {criterion_name} is for classification: {needs} class labels, but "
            "--regression-target is set (e.g. STS-B). Use --criterion sentence_prediction for "
            "regression tasks."
        )
    for key, (ok, message) in _RULES.items():
        if key in fields and not ok(float(getattr(cfg, key))):
            raise AclValueError(message.format(getattr(cfg, key)))


@contextlib.contextmanager
def capture_input(module: nn.Module) -> Iterator[list[Tensor]]:
    """Records the first positional input of ``module`` during the ``with`` block (a head's
    pooled feature ``h``, the input of ``out_proj``)."""
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
        raise AclValueError(
            f"the model has no classification head '{name}' (--classification-head-name); "
            "use a RoBERTa-style model and --task acl_sentence_prediction or sentence_prediction"
        )
    head = heads[name]
    if not isinstance(getattr(head, "out_proj", None), nn.Linear):
        raise AclValueError(
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
    Subclasses implement ``loss_terms``; metrics are fairseq's plus ``ce_loss`` and
    ``contrastive_loss``. ACL-Grad is off unless the config has ``acl_grad`` on."""

    name = "loss_terms"

    def __init__(self, cfg: SentencePredictionConfig, task):
        mark_in_use(f"criterion {self.name}")  # the guard rails act on this run
        validate_criterion_config(cfg, self.name)
        super().__init__(cfg, task)
        self.acl_grad: AclGradSettings | None = (
            AclGradSettings.from_config(cfg)
            if issubclass(config_type(cfg), AclGradConfig)
            else None
        )
        if self.acl_grad is not None and not isinstance(task, AclGradTask):
            raise AclValueError(
                f"--criterion {self.name} with ACL-Grad needs --task acl_sentence_prediction "
                f"(its train_step compares the gradients); got --task "
                f"{getattr(task.cfg, '_name', type(task).__name__)}. Switch the task, or pass "
                "--no-acl-grad."
            )

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        """fairseq's flags of the config, with ``--acl-grad`` / ``--no-acl-grad`` for ACL-Grad."""
        dc = getattr(cls, "__dataclass", None)  # set by fairseq's register_criterion
        if dc is not None and issubclass(dc, AclGradConfig):
            add_acl_grad_switch(parser, default=dc().acl_grad)
        super().add_args(parser)

    def check_model(self, model: nn.Module) -> None:
        """Raises ValueError when ``model`` cannot train with this criterion (at set-up)."""

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

    def __init__(self, cfg: ContrastiveSentencePredictionConfig, task):
        super().__init__(cfg, task)
        self.contrastive_lambda = cfg.contrastive_lambda
        self.temperature = cfg.temperature

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
            raise AclValueError(
                f"a target label id is outside [0, {num_classes}): --num-classes "
                f"{num_classes} does not match the label dictionary of the data"
            )
        sample_size = targets.numel()
        lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        ce_loss = F.nll_loss(lprobs, targets, reduction="sum")
        features = features.float()  # the losses in fp32, also under --autocast
        if self.contrastive_lambda > 0:
            with full_precision(features):
                term = self.contrastive_term(features, targets, head.out_proj.weight.float())
            contrastive_loss = self.contrastive_lambda * sample_size * term
        else:
            contrastive_loss = features.sum() * 0.0
        logging_output = self.terms_logging_output(
            model, sample, ce_loss, contrastive_loss, logits, targets
        )
        return LossTerms(ce_loss, contrastive_loss, sample_size, logging_output)
