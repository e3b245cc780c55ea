"""acl-fairseq: Aligned Contrastive Learning and multi-exit early exit for fairseq.

Load with ``fairseq-train --user-dir acl_fairseq`` (or ``fairseq-validate``,
``fairseq-hydra-train``); importing the package installs the patches of fairseq listed in
``fairseq_patches`` (and no other), then registers its criterions, models and tasks.
"""

from . import fairseq_patches

fairseq_patches.install()

from . import criterions, models, tasks  # noqa: E402, F401  (registers)

__version__ = "0.1.0"
