"""Early exit: the policies, the loop, the speed/accuracy curve, calibration and the saved policy.

``policies`` (pure torch: the registry of kinds and their rules) and ``per_exit`` (the per-exit
kinds, registered here), ``loop`` (the batched loop of ``MultiExitRobertaModel.early_exit``),
``thresholds`` (the curve from one pass over every exit), ``calibrate`` /
``calibration_search`` / ``risk_control`` (policies fitted to a split for a target),
``deploy`` (the policy to deploy per precision), ``saved_policy``
(``early_exit_policy.json``), ``measure`` (accuracy and wall-clock speed over policies) and
``table`` (the sweep table's file).
"""

from . import per_exit  # noqa: F401  (registers the per-exit kinds)
