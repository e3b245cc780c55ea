"""``--criterion ce_scl``: the CE+SCL baseline (Gunel et al., ICLR 2021).

Same pooled feature, same weighting and temperature flags as ``acl_embed``, so the two
compare fairly; SupCon runs over the N samples only (no label embeddings). ACL-Grad is off by
default and can be turned on with ``--acl-grad``.
"""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from torch import Tensor

from ..acl_grad.config import acl_grad_switch
from .base import ContrastiveSentencePredictionConfig, ContrastiveSentencePredictionCriterion
from .losses import supervised_contrastive_loss


@dataclass
class CeSclConfig(ContrastiveSentencePredictionConfig):
    # the baseline: ACL-Grad off unless asked for (--acl-grad)
    acl_grad: bool = acl_grad_switch(default=False)


@register_criterion("ce_scl", dataclass=CeSclConfig)
class CeSclCriterion(ContrastiveSentencePredictionCriterion):
    name = "ce_scl"

    def contrastive_term(self, features: Tensor, targets: Tensor, label_embeddings: Tensor):
        return supervised_contrastive_loss(features, targets, self.temperature)
