"""``--criterion ce_scl``: the CE+SCL baseline (Gunel et al., ICLR 2021).

Same pooled feature and flags as ``acl_embed``, SupCon over the N samples only; ACL-Grad off
by default (``--acl-grad``). SCL needs a positive and a third example per anchor, so
``--batch-size`` 1 or 2 would train plain CE: :meth:`CeSclCriterion.check_batch_size` refuses
it.
"""

import logging
from dataclasses import dataclass

from fairseq.criterions import register_criterion
from torch import Tensor

from ..acl_grad.config import acl_grad_switch
from ..errors import AclValueError
from .base import ContrastiveSentencePredictionConfig, ContrastiveSentencePredictionCriterion
from .losses import supervised_contrastive_loss

logger = logging.getLogger(__name__)

#: The smallest batch in which SCL can be more than zero (an anchor, a positive, a third).
MIN_BATCH_SIZE = 3


@dataclass
class CeSclConfig(ContrastiveSentencePredictionConfig):
    # the baseline: ACL-Grad off unless asked for (--acl-grad)
    acl_grad: bool = acl_grad_switch(default=False)


@register_criterion("ce_scl", dataclass=CeSclConfig)
class CeSclCriterion(ContrastiveSentencePredictionCriterion):
    name = "ce_scl"

    def contrastive_term(self, features: Tensor, targets: Tensor, label_embeddings: Tensor):
        return supervised_contrastive_loss(features, targets, self.temperature)

    def check_batch_size(self, batch_size: int | None, num_classes: int | None) -> None:
        """At set-up of a training (``--batch-size`` per worker; None: batches by
        ``--max-tokens``, not checked): refuses a batch in which SCL is always zero, and warns
        when, with balanced labels, most examples would have no positive in their batch."""
        if batch_size is None:
            return
        if batch_size < MIN_BATCH_SIZE:
            raise AclValueError(
                f"--criterion {self.name} with --batch-size {batch_size}: SCL needs, in one "
                "batch of a worker, an example with another of its label and a third to compare "
                f"them with, which a batch of {batch_size} never has, so every update would be "
                "plain CE (no contrastive term, no ACL-Grad angle). Use --criterion acl_embed "
                "(its label embeddings give every example a positive, even at --batch-size 1) "
                f"or --batch-size {MIN_BATCH_SIZE} or more (several times --num-classes)"
            )
        if num_classes and num_classes > 1:
            alone = (1 - 1 / num_classes) ** (batch_size - 1)  # P(no other of its label)
            if alone > 0.5:
                logger.warning(
                    f"--criterion {self.name} with --batch-size {batch_size} and {num_classes} "
                    f"classes: with balanced labels about {alone:.0%} of the examples have no "
                    "other example of their label in their batch and get no SCL term; "
                    "--criterion acl_embed gives every example a positive, or raise --batch-size"
                )
