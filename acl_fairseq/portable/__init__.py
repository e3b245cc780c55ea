"""The early-exit runner that needs only numpy, onnxruntime and a tokenizer library: no torch,
no fairseq, no plugin import. The project's loops and the bundle share it.

``decide`` (each policy kind as a rule table, and the one decision on numpy host arrays),
``rows`` (the row bookkeeping of the batched loop), ``ort_loop`` (the loop on ONNX Runtime
sessions of a model's segments) and ``lines`` (predict's input lines, batches and output
lines). Every module here imports only the standard library, numpy
and its siblings, relatively; onnxruntime is imported when a session is made.
"""
