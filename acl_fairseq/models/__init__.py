"""Models of the plugin (imported by fairseq through ``--user-dir acl_fairseq``)."""

from .hub_interface import MultiExitRobertaHubInterface
from .multi_exit_roberta import MultiExitClassificationHead, MultiExitRobertaModel  # registers
from .types import EarlyExitResult, ExitOutput

__all__ = [
    "EarlyExitResult",
    "ExitOutput",
    "MultiExitClassificationHead",
    "MultiExitRobertaHubInterface",
    "MultiExitRobertaModel",
]
