"""Models of the plugin (imported by fairseq through ``--user-dir acl_fairseq``)."""

from .heads import DEFAULT_HEAD, MultiExitClassificationHead
from .multi_exit_roberta import MultiExitRobertaModel  # registers
from .types import ExitOutput

__all__ = [
    "DEFAULT_HEAD",
    "ExitOutput",
    "MultiExitClassificationHead",
    "MultiExitRobertaModel",
]
