"""``--criterion acl_cross_layer``: ACL-CL for multi-exit models.

For every shallow exit ``m``: ``CE_m + lambda_cl * ACL-CL_m`` with the last exit ``M`` as
teacher (SupCon over the student's N features and K label embeddings plus the teacher's,
teacher detached: 2N + 2K vectors). For the last exit: ``CE_M + lambda * ACL-Embed_M``. The
per-exit losses are weighted as in ``multi_exit_ce`` (``--exit-weighting``).

ACL-Grad (on by default) decides once per update on the *total* CE gradient versus the
*total* contrastive gradient: deciding per exit would cost one extra backward pass per exit
(M + 1 instead of 2), and the exits share the backbone, whose gradient is where the terms
conflict.
"""

from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from torch import Tensor

from ..losses import acl_embed_loss, cross_layer_loss
from .contrastive_sentence_prediction import (
    ACL_GRAD_SCOPE,
    ACL_GRAD_SCOPE_HELP,
    validate_contrastive_config,
)
from .multi_exit_ce import MultiExitCeConfig, MultiExitCeCriterion


@dataclass
class AclCrossLayerConfig(MultiExitCeConfig):
    contrastive_lambda: float = field(
        default=0.5,
        metadata={"help": "weight lambda of ACL-Embed on the last exit"},
    )
    cross_layer_lambda: float = field(
        default=0.5,
        metadata={"help": "weight lambda_cl of ACL-CL on every shallow exit"},
    )
    temperature: float = field(
        default=0.3,
        metadata={"help": "temperature tau (> 0) of the contrastive losses"},
    )
    acl_grad_threshold: float = field(
        default=90.0,
        metadata={
            "help": "ACL-Grad: drop the contrastive terms for an update when the angle between "
            "the total CE gradient and the total contrastive gradient exceeds this (degrees)"
        },
    )
    acl_grad_scope: ACL_GRAD_SCOPE = field(  # type: ignore[valid-type]
        default="all", metadata={"help": ACL_GRAD_SCOPE_HELP}
    )
    no_acl_grad: bool = field(
        default=False,
        metadata={"help": "turn ACL-Grad off: always keep the contrastive terms"},
    )


@register_criterion("acl_cross_layer", dataclass=AclCrossLayerConfig)
class AclCrossLayerCriterion(MultiExitCeCriterion):
    name = "acl_cross_layer"

    def __init__(self, cfg: AclCrossLayerConfig, task):
        validate_contrastive_config(cfg, self.name)
        if not (cfg.cross_layer_lambda >= 0):
            raise ValueError(f"--cross-layer-lambda must be >= 0, got {cfg.cross_layer_lambda}")
        super().__init__(cfg, task)
        self.contrastive_lambda = cfg.contrastive_lambda
        self.cross_layer_lambda = cfg.cross_layer_lambda
        self.temperature = cfg.temperature
        self.use_acl_grad = not cfg.no_acl_grad
        if self.use_acl_grad and not getattr(task, "supports_grad_align", False):
            raise ValueError(
                f"--criterion {self.name} with ACL-Grad needs --task acl_sentence_prediction; "
                "switch the task or pass --no-acl-grad"
            )
        self.grad_align_threshold = cfg.acl_grad_threshold if self.use_acl_grad else None
        self.grad_align_scope = str(cfg.acl_grad_scope)

    def contrastive_terms(self, outputs, targets: Tensor) -> list[Tensor]:
        teacher = outputs[-1]
        terms = []
        for o in outputs[:-1]:
            terms.append(
                self.cross_layer_lambda
                * cross_layer_loss(
                    o.features,
                    o.label_embeddings,
                    teacher.features,
                    teacher.label_embeddings,
                    targets,
                    self.temperature,
                )
            )
        terms.append(
            self.contrastive_lambda
            * acl_embed_loss(teacher.features, targets, teacher.label_embeddings, self.temperature)
        )
        return terms
