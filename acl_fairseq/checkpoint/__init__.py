"""fairseq checkpoints: safe loading under torch >= 2.6 (``safe_loading``), whether one fits the
model and data (``fits``), the data it was trained on (``training_data``) and a reused
``--save-dir`` (``resume``)."""
