"""A fine-tuned checkpoint at inference: the one loader, the one decision of what runs
(backend, precision, policy: ``plan``), the hub, the early-exit policy saved with a checkpoint
and chosen per precision, and speed measured over policies. What runs the model is
``acl_fairseq.runtime``."""
