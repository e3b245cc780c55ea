"""The optimizer hook: how ACL-Grad reaches the two points of an update that a task's
``train_step`` does not see, the all-reduce of the gradients and their zeroing."""

import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from .step import AclGrad

__all__ = ["AclGradOptimizer"]


class AclGradOptimizer:
    """The trainer's optimizer, seen by ACL-Grad at the all-reduce and the zeroing of the
    gradients (fairseq gives a task no hook there). :meth:`install` shadows two methods of
    the optimizer instance: ``all_reduce_grads(module)`` (the optimizer's own, then
    :meth:`AclGrad.decide_update` for the model; another module while a contrastive gradient
    is buffered is an error, it would be lost) and ``zero_grad()`` (then
    :meth:`AclGrad.reset`, so a skipped update's decisions enter no statistic)."""

    _ATTRIBUTE = "_acl_grad_optimizer"  # where the installed wrapper is kept on the optimizer

    def __init__(self, optimizer: Any, unit: "AclGrad", model: nn.Module, criterion: Any):
        self._all_reduce_grads = optimizer.all_reduce_grads  # the optimizer's own methods
        self._zero_grad = optimizer.zero_grad
        self._optimizer = weakref.ref(optimizer)
        self._model = weakref.ref(model)
        self._criterion = weakref.ref(criterion) if isinstance(criterion, nn.Module) else None
        self.unit = unit

    @classmethod
    def of(cls, optimizer: Any) -> "AclGradOptimizer | None":
        """The wrapper installed on ``optimizer``, if any."""
        return vars(optimizer).get(cls._ATTRIBUTE)

    @classmethod
    def install(
        cls, optimizer: Any, unit: "AclGrad", model: nn.Module, criterion: Any
    ) -> "AclGradOptimizer":
        """Wraps ``optimizer`` for ``unit`` and ``model`` (replacing an earlier wrapper)."""
        previous = cls.of(optimizer)
        if previous is not None:
            previous.uninstall()
        wrapper = cls(optimizer, unit, model, criterion)
        optimizer.all_reduce_grads = wrapper.all_reduce_grads
        optimizer.zero_grad = wrapper.zero_grad
        setattr(optimizer, cls._ATTRIBUTE, wrapper)
        return wrapper

    def uninstall(self) -> None:
        """Gives the optimizer its own two methods back."""
        optimizer = self._optimizer()
        if optimizer is not None and self.of(optimizer) is self:
            for name in ("all_reduce_grads", "zero_grad", self._ATTRIBUTE):
                delattr(optimizer, name)

    def wraps(self, optimizer: Any, model: nn.Module) -> bool:
        return self._optimizer() is optimizer and self._model() is model

    def all_reduce_grads(self, module: nn.Module) -> None:
        self._all_reduce_grads(module)
        if module is self._model():
            self.unit.decide_update()
        elif self.unit.holds_contrastive_gradient and (
            self._criterion is None or module is not self._criterion()
        ):
            raise RuntimeError(
                f"ACL-Grad: the optimizer's all_reduce_grads was called on a "
                f"{type(module).__name__}, not on the model whose contrastive gradient is "
                "buffered; that gradient would be dropped without a decision. The trainer "
                "must pass task.train_step and optimizer.all_reduce_grads the same model; or "
                "turn ACL-Grad off (--no-acl-grad) or use --acl-grad-scope head (no buffer)."
            )

    def zero_grad(self) -> None:
        self._zero_grad()
        self.unit.reset()
