"""fairseq checkpoints: safe loading under torch >= 2.6 (``safe_loading``), whether one fits the
model and data (``fits``), the data it was trained on (``training_data``), a reused
``--save-dir`` (``resume``), one training per ``--save-dir`` (``run_lock``), checkpoint files
written atomically (``atomic_files``) and the save folder checked before a training starts
(``save_dir``)."""
