"""ACL-Grad, in one place: drop an update's contrastive term when its gradient conflicts with
the CE gradient (the angle between the two exceeds ``--acl-grad-threshold`` degrees).

- :mod:`.config`: the flags (``AclGradConfig``, ``AclGradLogConfig``, the ``--acl-grad`` /
  ``--no-acl-grad`` switch) and what the step takes of them (``AclGradSettings``).
- :mod:`.contract`: what the task and the criterion provide (``AclGradCriterion``,
  ``AclGradTask``, ``LossTerms``).
- :mod:`.step`: the per-micro-batch step and the per-update decision (``AclGrad``); how and
  when the decision is taken, and which all-reduce reduces what, is documented there.
- :mod:`.optimizer`: the optimizer wrapper that reaches the trainer's all-reduce and
  zeroing of the gradients (``AclGradOptimizer``).
- :mod:`.angles`: the angle, the keep/drop decision and the contrastive-gradient buffer
  (pure torch).
- :mod:`.scope`: which parameters the approximate scopes (``head``, ``top:K``) measure.
- :mod:`.angle_log`: the ``--acl-grad-log`` file, its one writer and reader.
"""

from .angle_log import (
    AngleRecord,
    ScopeAgreement,
    append_angle_record,
    read_angle_log,
    scope_agreement,
    scope_angles,
)
from .config import (
    AclGradConfig,
    AclGradLogConfig,
    AclGradSettings,
    acl_grad_switch,
    add_acl_grad_switch,
)
from .contract import AclGradCriterion, AclGradTask, LossTerms
from .optimizer import AclGradOptimizer
from .step import AclGrad

__all__ = [
    "AclGrad",
    "AclGradConfig",
    "AclGradCriterion",
    "AclGradLogConfig",
    "AclGradOptimizer",
    "AclGradSettings",
    "AclGradTask",
    "AngleRecord",
    "ScopeAgreement",
    "LossTerms",
    "acl_grad_switch",
    "add_acl_grad_switch",
    "append_angle_record",
    "read_angle_log",
    "scope_agreement",
    "scope_angles",
]
