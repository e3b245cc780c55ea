"""ACL-Grad, in one place: drop an update's contrastive term when its gradient conflicts with
the CE gradient (the angle between the two exceeds ``--acl-grad-threshold`` degrees).

- :mod:`.step`: the flags (``AclGradConfig``, ``AclGradLogConfig``), the task/criterion
  contract (``AclGradCriterion``, ``LossTerms``), the per-micro-batch step and per-update
  decision (``AclGrad``) and the optimizer wrapper that reaches the trainer's all-reduce
  (``AclGradOptimizer``); how and when the decision is taken is documented there.
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
from .step import (
    AclGrad,
    AclGradConfig,
    AclGradCriterion,
    AclGradLogConfig,
    AclGradOptimizer,
    AclGradSettings,
    AclGradTask,
    LossTerms,
    acl_grad_switch,
    add_acl_grad_switch,
)

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
