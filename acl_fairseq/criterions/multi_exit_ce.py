"""``--criterion multi_exit_ce``: joint weighted CE over every exit (the multi-exit baseline).

``loss = sum_l w_l * CE_l`` with ``w_l = l / sum(l)`` over the exit layers (PABEE's
``sum(i * CE_i) / sum(i)``), uniform weights, or PABEE's mirror (``reverse``: the first exit
weighs most). Uniform weights are also Li et al.'s (2019) gradient equilibrium under Adam:
equilibrium rescales the gradient reaching each layer by a constant, which Adam's
per-parameter normalisation cancels (docs/usage.md). Logs ``accuracy`` of the final exit (so
``--best-checkpoint-metric accuracy`` keeps meaning the full model) and ``accuracy_exit{l}`` /
``loss_exit{l}`` of every exit, in training and in validation, so ``fairseq-validate`` prints
the layer-score curve in one pass.

``--self-distill-weight W`` (here and in ``acl_cross_layer``) adds FastBERT's
self-distillation from the final exit to each shallow exit, logged as ``self_distill_loss``;
it is an auxiliary term beside the contrastive ones (ACL-Grad may drop it, never CE).

``--alternate-exits`` is BERxiT's alternating fine-tuning (Xin et al. 2021): the 1st, 3rd, 5th
... update trains the final exit alone (its CE and, in ``acl_cross_layer``, its ACL-Embed
term: stage 1's objective), the others every exit as above; the task passes the update number
(:meth:`MultiExitCeCriterion.set_num_updates`). Validation always scores every exit.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from fairseq.criterions import register_criterion
from fairseq.criterions.sentence_prediction import (
    SentencePredictionConfig,
)
from fairseq.dataclass import ChoiceEnum
from fairseq.logging import metrics
from torch import Tensor, nn

from ..autocast import full_precision
from ..distributed import call_through_wrappers
from ..errors import AclValueError
from .base import LossTerms, LossTermsCriterion
from .losses import self_distillation_loss

EXIT_WEIGHTING = ChoiceEnum(["layer", "uniform", "reverse"])


@dataclass
class MultiExitCeConfig(SentencePredictionConfig):
    exit_weighting: EXIT_WEIGHTING = field(
        default="layer",
        metadata={
            "help": "weights of the exits' losses: 'layer' (w_l proportional to the layer "
            "index, PABEE), 'uniform' (also gradient equilibrium under Adam), or 'reverse' (w_l "
            "proportional to last layer + 1 - l: the first exit weighs most); normalised to sum "
            "to 1"
        },
    )
    alternate_exits: bool = field(
        default=False,
        metadata={
            "help": "BERxiT's alternating fine-tuning: the 1st, 3rd, ... update trains the final "
            "exit only (its CE and contrastive term), the others every exit"
        },
    )
    self_distill_weight: float = field(
        default=0.0,
        metadata={
            "help": "weight W of self-distillation (FastBERT): loss += W * sum over shallow "
            "exits of T^2 * KL(final exit's softmax(z/T), detached || the exit's); 0: off"
        },
    )
    self_distill_temperature: float = field(
        default=1.0,
        metadata={"help": "temperature T (> 0) of --self-distill-weight's softened softmaxes"},
    )


def exit_weights(layers: list[int], weighting: str) -> list[float]:
    """Normalised loss weight of each exit layer (``layers`` ascending): ``layer`` ~ l,
    ``uniform`` ~ 1, ``reverse`` ~ last + 1 - l."""
    if weighting == "layer":
        raw = [float(layer) for layer in layers]
    elif weighting == "uniform":
        raw = [1.0] * len(layers)
    elif weighting == "reverse":
        raw = [float(layers[-1] + 1 - layer) for layer in layers]
    else:
        raise AclValueError(
            f"--exit-weighting must be one of layer, uniform, reverse; got {weighting!r}"
        )
    total = sum(raw)
    return [w / total for w in raw]


def final_only_update(num_updates: int) -> bool:
    """``--alternate-exits``: whether the update numbered ``num_updates`` (0-based, as the
    trainer counts) trains the final exit alone: BERxiT's odd iterations (the 1st, 3rd, ...)."""
    return num_updates % 2 == 0


@register_criterion("multi_exit_ce", dataclass=MultiExitCeConfig)
class MultiExitCeCriterion(LossTermsCriterion):
    """Weighted CE over the exits of a ``multi_exit_roberta`` model."""

    name = "multi_exit_ce"

    def __init__(self, cfg: MultiExitCeConfig, task):
        super().__init__(cfg, task)
        self.exit_weighting = cfg.exit_weighting
        self.self_distill_weight = float(cfg.self_distill_weight)
        self.self_distill_temperature = float(cfg.self_distill_temperature)
        self.alternate_exits = bool(getattr(cfg, "alternate_exits", False))
        self.num_updates = 0

    def set_num_updates(self, num_updates: int) -> None:
        """The update about to be trained (the task's ``train_step`` passes it)."""
        self.num_updates = int(num_updates)

    def trains_final_only(self, model: nn.Module) -> bool:
        """Whether this forward trains the final exit alone (``--alternate-exits``)."""
        return self.alternate_exits and model.training and final_only_update(self.num_updates)

    def check_model(self, model: nn.Module) -> None:
        """Raises ValueError unless ``model`` has exits (called by the task at set-up)."""
        if not hasattr(model, "exit_outputs"):
            raise AclValueError(
                f"--criterion {self.name} needs a multi-exit model (--arch multi_exit_roberta, "
                "multi_exit_roberta_base, ...); this model has no exits"
            )

    def exit_outputs(self, model: nn.Module, sample: dict[str, Any]):
        """Every exit's output; through the forward of fairseq's distributed wrappers, so
        that ``--ddp-backend pytorch_ddp`` reduces the gradients (``call_through_wrappers``)."""
        self.check_model(model)
        return call_through_wrappers(
            model,
            "exit_outputs",
            **sample["net_input"],
            classification_head_name=self.classification_head_name,
        )

    def contrastive_terms(
        self, model: nn.Module, sample: dict[str, Any], outputs, targets: Tensor
    ) -> list[Tensor] | None:
        """Per-exit mean contrastive losses, already weighted by their lambda; None if none."""
        return None

    def contrastive_weights(self, layers: list[int]) -> list[float]:
        """Normalised weight of each exit's contrastive term (those of the CE terms here)."""
        return exit_weights(layers, self.exit_weighting)

    def self_distill_term(self, outputs) -> Tensor | None:
        """``W * sum_{shallow l} T^2 * KL(p_final || p_l)`` summed over the batch, the final
        exit detached (the live one, also with ``--frozen-teacher``); None when W is 0."""
        if self.self_distill_weight == 0 or len(outputs) < 2:
            return None
        teacher = outputs[-1].logits
        t = self.self_distill_temperature
        return self.self_distill_weight * sum(
            self_distillation_loss(o.logits, teacher, t) for o in outputs[:-1]
        )

    def loss_terms(self, model: nn.Module, sample: dict[str, Any]) -> LossTerms:
        outputs = self.exit_outputs(model, sample)
        # the losses in fp32, also under --autocast: fp32 outputs, autocast off for the terms
        outputs = [
            o._replace(logits=o.logits.float(), features=o.features.float()) for o in outputs
        ]
        final_logits = outputs[-1].logits
        targets = model.get_targets(sample, [final_logits]).view(-1)
        sample_size = targets.numel()
        # the exits this update trains: every one, or the final one (--alternate-exits)
        trained = outputs[-1:] if self.trains_final_only(model) else outputs
        weights = exit_weights([o.layer for o in trained], self.exit_weighting)
        ce_per_exit = [
            F.nll_loss(F.log_softmax(o.logits, -1, dtype=torch.float32), targets, reduction="sum")
            for o in outputs
        ]
        ce_loss = sum(w * ce for w, ce in zip(weights, ce_per_exit[-len(trained) :]))
        with full_precision(final_logits):
            contrastive = self.contrastive_terms(model, sample, trained, targets)
            distill_loss = self.self_distill_term(trained)
        if contrastive is None:
            contrastive_loss = final_logits.sum() * 0.0
        else:
            c_weights = self.contrastive_weights([o.layer for o in trained])
            contrastive_loss = sample_size * sum(w * c for w, c in zip(c_weights, contrastive))
        logging_output = self.terms_logging_output(
            model, sample, ce_loss, contrastive_loss, final_logits, targets
        )
        if distill_loss is not None:
            # In the auxiliary group with the contrastive terms, not with CE: ACL-Grad keeps the
            # labelled CE and drops the teacher-driven terms when their gradient conflicts.
            contrastive_loss = contrastive_loss + distill_loss
            logging_output["loss"] = (ce_loss + contrastive_loss).data
            logging_output["self_distill_loss"] = distill_loss.data
        for o, ce in zip(outputs, ce_per_exit):
            logging_output[f"loss_exit{o.layer}"] = ce.data
            logging_output[f"ncorrect_exit{o.layer}"] = (o.logits.argmax(dim=1) == targets).sum()
        return LossTerms(ce_loss, contrastive_loss, sample_size, logging_output)

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        LossTermsCriterion.reduce_metrics(logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        if any("self_distill_loss" in log for log in logging_outputs):
            total = sum(log.get("self_distill_loss", 0) for log in logging_outputs)
            value = total / (sample_size or 1) / math.log(2)
            metrics.log_scalar("self_distill_loss", value, sample_size, round=3)
        nsentences = sum(log.get("nsentences", 0) for log in logging_outputs)
        keys = logging_outputs[0].keys() if logging_outputs else []
        prefix = "ncorrect_exit"
        layers = sorted(int(k[len(prefix) :]) for k in keys if k.startswith(prefix))
        for layer in layers:
            ncorrect = sum(log.get(f"ncorrect_exit{layer}", 0) for log in logging_outputs)
            loss = sum(log.get(f"loss_exit{layer}", 0) for log in logging_outputs)
            metrics.log_scalar(
                f"accuracy_exit{layer}", 100.0 * ncorrect / (nsentences or 1), nsentences, round=1
            )
            metrics.log_scalar(
                f"loss_exit{layer}", loss / (sample_size or 1) / math.log(2), sample_size, round=3
            )
