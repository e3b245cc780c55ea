"""ACL-Grad, in one place: drop an update's contrastive term when its gradient conflicts with
the CE gradient (the angle between the two exceeds ``--acl-grad-threshold`` degrees). Its
modules, how and when it decides, and which all-reduce reduces what: docs/acl_grad.md.
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
