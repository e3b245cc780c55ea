"""Early-exit policies and their calibration, in torch / numpy (no fairseq import).

``policies`` (the registry of kinds), ``per_exit`` (the per-exit kinds) and ``learned`` (the
learned decision), registered here, ``thresholds`` (the curve from one pass over every exit),
``calibrate`` / ``calibration_search`` / ``learned_calibration`` / ``risk_control`` (policies
fitted to a split for a target) and ``table`` (the sweep table's file). Each kind's decision is
its rule table run by ``portable.decide``, the one decision of every loop (``runtime
.torch_loop``, ``portable.ort_loop``, the bundle's runner).
"""

# isort: off
from . import per_exit  # noqa: F401  (registers the per-exit kinds)
from . import learned  # noqa: F401  (registers the learned kind, listed after them)
# isort: on
