"""The early-exit runner that needs only numpy, onnxruntime and a tokenizer library: no torch,
no fairseq, no plugin import. The project's loops and the bundle share it.

``decide`` (each policy kind as a rule table, and the one decision on numpy host arrays),
``rows`` (the row bookkeeping of the batched loop), ``ort_loop`` (the loop on ONNX Runtime
sessions of a model's segments), ``lines`` (predict's input lines, batches and output lines)
and ``bundle`` (a bundle folder loaded and run; ``python -m`` on this package is its command).
A bundle (``acl-fairseq-bundle``) carries a verbatim copy of this package, so every module here
imports only the standard library, numpy and its siblings, relatively; onnxruntime and
tokenizers are imported when a session or a tokenizer is made.
"""

from .bundle import Bundle, Prediction

__all__ = ["Bundle", "Prediction"]
