"""``--criterion acl_embed``: CE + lambda * ACL-Embed, with ACL-Grad on by default."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from torch import Tensor

from .base import ContrastiveSentencePredictionConfig, ContrastiveSentencePredictionCriterion
from .losses import acl_embed_loss


@dataclass
class AclEmbedConfig(ContrastiveSentencePredictionConfig):
    """ACL-Grad on by default (``--no-acl-grad``: always keep the term, one backward)."""


@register_criterion("acl_embed", dataclass=AclEmbedConfig)
class AclEmbedCriterion(ContrastiveSentencePredictionCriterion):
    """SupCon over the batch's pooled features plus the K label embeddings (``out_proj`` rows).

    Needs ``--task acl_sentence_prediction`` for ACL-Grad; with ``--no-acl-grad`` it also
    runs under fairseq's ``sentence_prediction`` task.
    """

    name = "acl_embed"

    def contrastive_term(self, features: Tensor, targets: Tensor, label_embeddings: Tensor):
        return acl_embed_loss(features, targets, label_embeddings, self.temperature)
