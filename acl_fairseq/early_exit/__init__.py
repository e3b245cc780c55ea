"""Early-exit policies and their calibration, in pure torch / numpy (no fairseq import).

``policies`` (the registry of kinds and their rules), ``per_exit`` (the per-exit kinds) and
``learned`` (the learned decision), registered here, ``thresholds`` (the curve from one pass
over every exit), ``calibrate`` / ``calibration_search`` / ``learned_calibration`` /
``risk_control`` (policies fitted to a split for a target) and ``table`` (the sweep table's
file). The loop that runs a policy is ``runtime.torch_loop`` (``runtime.onnx_runtime`` on
ONNX Runtime); its row bookkeeping, shared by both, is ``runtime.rows``.
"""

# isort: off
from . import per_exit  # noqa: F401  (registers the per-exit kinds)
from . import learned  # noqa: F401  (registers the learned kind, listed after them)
# isort: on
