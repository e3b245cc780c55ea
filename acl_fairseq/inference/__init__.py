"""A fine-tuned checkpoint at inference: the one loader, its precisions (fp32 / bf16 / int8),
the early-exit policy saved with it and chosen per precision, and speed measured over policies."""
