"""What ACL-Grad needs of the criterion and the task: the protocols between them.

A criterion returns its loss as separate terms (:class:`LossTerms`) and says whether ACL-Grad
is on (:class:`AclGradCriterion`); the task owns the training run's
:class:`~acl_fairseq.acl_grad.step.AclGrad` (:class:`AclGradTask`).
"""

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from torch import Tensor, nn

from .config import AclGradSettings

if TYPE_CHECKING:
    from .step import AclGrad

__all__ = ["AclGradCriterion", "AclGradTask", "LossTerms"]


class LossTerms(NamedTuple):
    """The loss of one batch as separate terms (both summed over the batch)."""

    ce_loss: Tensor
    contrastive_loss: Tensor
    sample_size: int
    logging_output: dict[str, Any]


@runtime_checkable
class AclGradCriterion(Protocol):
    """What ``--task acl_sentence_prediction`` needs of a criterion. ``acl_grad``: None when
    off (fairseq's own ``train_step``); ``check_model`` refuses a model it cannot train."""

    acl_grad: AclGradSettings | None

    def loss_terms(self, model: nn.Module, sample: dict[str, Any]) -> LossTerms: ...

    def check_model(self, model: nn.Module) -> None: ...


@runtime_checkable
class AclGradTask(Protocol):
    """A task whose ``train_step`` runs ACL-Grad (``--task acl_sentence_prediction``)."""

    acl_grad: "AclGrad"
