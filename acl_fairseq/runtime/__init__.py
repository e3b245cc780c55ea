"""The early-exit runtime: running a multi-exit model so that rows leave at their exit.

One place for what every backend shares and each backend's loop: ``rows`` (the row
bookkeeping and ``EarlyExitResult``), ``row_decider`` (one row's decisions on the host, batch
1), ``torch_loop`` / ``torch_row`` (the loop on the fairseq model in torch), ``onnx_runtime``
(the same loop on ONNX Runtime sessions of the model's segments) and ``precision`` (the model
at fp32, bf16 or int8). The plugin fairseq loads for training imports none of it.
"""
