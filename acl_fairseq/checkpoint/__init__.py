"""fairseq checkpoints: safe loading under torch >= 2.6 (``safe_loading``), the check that a
checkpoint fits the model and data (``fits``), and loading one for inference (``inference``)."""
