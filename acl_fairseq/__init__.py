"""acl-fairseq: Aligned Contrastive Learning and multi-exit early exit for fairseq.

Load with ``fairseq-train --user-dir acl_fairseq`` (or ``fairseq-validate``,
``fairseq-hydra-train``); importing the package registers its criterions, models and tasks.
"""

from . import distributed, errors
from .checkpoint import atomic_files, safe_loading, save_dir

errors.install_excepthook()  # in fairseq's commands: the plugin's errors as one line
safe_loading.install()
save_dir.install()  # the --save-dir checked before fairseq-train restores or trains
atomic_files.install()  # every checkpoint file fairseq writes or copies appears whole
distributed.install()  # torch's DDP on CPU; checkpoints broadcast to every worker

from . import criterions, models, tasks  # noqa: E402, F401

__version__ = "0.1.0"
