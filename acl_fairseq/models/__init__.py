"""Models of the plugin (imported by fairseq through ``--user-dir acl_fairseq``)."""

from . import hub_interface, multi_exit_roberta  # noqa: F401  (registers the model)
from .hub_interface import MultiExitRobertaHubInterface
from .multi_exit_roberta import (
    EarlyExitResult,
    ExitOutput,
    MultiExitClassificationHead,
    MultiExitRobertaModel,
)

__all__ = [
    "EarlyExitResult",
    "ExitOutput",
    "MultiExitClassificationHead",
    "MultiExitRobertaHubInterface",
    "MultiExitRobertaModel",
]
