"""Models of the plugin (imported by fairseq through ``--user-dir acl_fairseq``)."""

from .heads import DEFAULT_HEAD, MultiExitClassificationHead
from .hub_interface import MultiExitRobertaHubInterface
from .multi_exit_roberta import MultiExitRobertaModel  # registers
from .types import EarlyExitResult, ExitOutput

__all__ = [
    "DEFAULT_HEAD",
    "EarlyExitResult",
    "ExitOutput",
    "MultiExitClassificationHead",
    "MultiExitRobertaHubInterface",
    "MultiExitRobertaModel",
]
