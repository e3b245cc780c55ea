"""``--criterion acl_embed``: CE + lambda * ACL-Embed, with ACL-Grad on by default."""

from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from torch import Tensor

from ..losses import acl_embed_loss
from .contrastive_sentence_prediction import (
    ContrastiveConfig,
    ContrastiveSentencePredictionCriterion,
)


@dataclass
class AclEmbedConfig(ContrastiveConfig):
    no_acl_grad: bool = field(
        default=False,
        metadata={"help": "turn ACL-Grad off: always keep the ACL-Embed term (one backward)"},
    )


@register_criterion("acl_embed", dataclass=AclEmbedConfig)
class AclEmbedCriterion(ContrastiveSentencePredictionCriterion):
    """SupCon over the batch's pooled features plus the K label embeddings (``out_proj`` rows).

    Needs ``--task acl_sentence_prediction`` for ACL-Grad; with ``--no-acl-grad`` it also
    runs under fairseq's ``sentence_prediction`` task.
    """

    name = "acl_embed"

    def __init__(self, cfg: AclEmbedConfig, task):
        super().__init__(cfg, task, use_acl_grad=not cfg.no_acl_grad)

    def contrastive_term(self, features: Tensor, targets: Tensor, label_embeddings: Tensor):
        return acl_embed_loss(features, targets, label_embeddings, self.temperature)
