"""``--criterion ce_scl``: the CE+SCL baseline (Gunel et al., ICLR 2021).

Same pooled feature, same weighting and temperature flags as ``acl_embed``, so the two
compare fairly; SupCon runs over the N samples only (no label embeddings). ACL-Grad is off by
default and can be turned on with ``--acl-grad``.
"""

from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from torch import Tensor

from ..losses import supervised_contrastive_loss
from .contrastive_sentence_prediction import (
    ContrastiveConfig,
    ContrastiveSentencePredictionCriterion,
)


@dataclass
class CeSclConfig(ContrastiveConfig):
    acl_grad: bool = field(
        default=False,
        metadata={"help": "apply ACL-Grad to the SCL term (drop it when its gradient conflicts)"},
    )


@register_criterion("ce_scl", dataclass=CeSclConfig)
class CeSclCriterion(ContrastiveSentencePredictionCriterion):
    name = "ce_scl"

    def __init__(self, cfg: CeSclConfig, task):
        super().__init__(cfg, task, use_acl_grad=cfg.acl_grad)

    def contrastive_term(self, features: Tensor, targets: Tensor, label_embeddings: Tensor):
        return supervised_contrastive_loss(features, targets, self.temperature)
