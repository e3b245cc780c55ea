"""The early-exit runtime: running a multi-exit model so that rows leave at their exit.

The torch side of it: ``rows`` (``EarlyExitResult`` and a policy's decider on host arrays),
``torch_loop`` / ``torch_row`` (the loop on the fairseq model in torch), ``onnx_runtime`` (the
model exported per exit segment, run by ``portable.ort_loop``) and ``precision`` (the model at
fp32, bf16 or int8). The decision and the row bookkeeping every loop runs are
``acl_fairseq.portable``'s (numpy). The plugin fairseq loads for training imports none of it.
"""
