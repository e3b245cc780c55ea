"""Every patch of fairseq the plugin installs, in one register, and what each applies to.

Importing the plugin (``--user-dir acl_fairseq``) runs :func:`install`, which installs the
entries of :data:`PATCHES` and nothing else. Each entry says what it replaces, why, and the
runs it acts on:

* **every run**: the fixes that let fairseq read its own checkpoints under torch >= 2.6
  (``weights_only``): the checkpoint loader and the broadcast of a loaded checkpoint to the
  other workers. Stock fairseq fails there; nothing else about a stock run changes.
* **plugin runs**: everything else, the guard rails (the ``--save-dir`` checks and lock,
  checkpoint files that appear whole, one-line errors), the CPU data-parallel pieces and the
  launch of several processes. A run is a plugin run once its config names the plugin's task,
  criterion or architecture (:func:`names_plugin`, before anything is built), it builds one of
  them, or it loads a checkpoint for inference through the plugin (:func:`mark_in_use`); a run
  whose task, criterion and architecture are all stock fairseq runs as stock fairseq.

``ACL_FAIRSEQ_GUARD_RAILS`` sets the scope of the guard rails: ``plugin`` (the default: plugin
runs), ``all`` (a stock run opts in), ``off`` (none, also for plugin runs). docs/usage.md,
"What the plugin changes in fairseq", has the table; after a fairseq upgrade, check each
entry's target against :data:`CHECKED_AGAINST` (tests/test_fairseq_patches.py reads every
target and its signature).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import distributed, errors, launch
from .checkpoint import atomic_files, safe_loading, save_dir
from .errors import AclValueError

__all__ = [
    "CHECKED_AGAINST",
    "GUARD_RAILS_ENV",
    "PATCHES",
    "Patch",
    "guard_rails",
    "in_use",
    "install",
    "mark_in_use",
    "markdown_table",
]

CHECKED_AGAINST = "fairseq-fixed 0.12.3.1 (fairseq main), torch 2.13.0"
GUARD_RAILS_ENV = "ACL_FAIRSEQ_GUARD_RAILS"
SETTINGS = ("plugin", "all", "off")

EVERY_RUN = "every run"
PLUGIN_RUNS = "plugin runs"

_in_use: set[str] = set()


def mark_in_use(component: str) -> None:
    """Records that this process runs the plugin's ``component`` (its task, criterion, model
    or inference loader): from now on it is a plugin run."""
    _in_use.add(component)


def in_use() -> bool:
    """Whether this process has built one of the plugin's components (a plugin run)."""
    return bool(_in_use)


def setting() -> str:
    """``ACL_FAIRSEQ_GUARD_RAILS``: ``plugin`` (default), ``all`` or ``off``."""
    value = os.environ.get(GUARD_RAILS_ENV, "").strip().lower() or "plugin"
    if value not in SETTINGS:
        raise AclValueError(
            f"{GUARD_RAILS_ENV}={value}: must be one of {', '.join(SETTINGS)} (plugin: the "
            "guard rails act on runs of the plugin's task, criterion or model; all: on every "
            "run; off: on none)"
        )
    return value


def guard_rails() -> bool:
    """Whether the guard rails act on this run (``ACL_FAIRSEQ_GUARD_RAILS`` and
    :func:`in_use`)."""
    value = setting()
    return value == "all" or (value == "plugin" and in_use())


def plugin_run() -> bool:
    """Whether the plugin's run-scoped fixes (not guard rails) act here: a plugin run."""
    return in_use()


def names_plugin(cfg: Any) -> bool:
    """Whether fairseq's config ``cfg`` names the plugin's task, criterion or architecture
    (before any of them is built: a plugin run to be)."""
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
    from fairseq.tasks import TASK_REGISTRY

    def name(section: str) -> str | None:
        part = getattr(cfg, section, None)
        return getattr(part, "_name", None) or getattr(part, "arch", None)

    found = [
        TASK_REGISTRY.get(name("task") or ""),
        CRITERION_REGISTRY.get(name("criterion") or ""),
        ARCH_MODEL_REGISTRY.get(name("model") or "") or MODEL_REGISTRY.get(name("model") or ""),
    ]
    return any((getattr(c, "__module__", "") or "").startswith("acl_fairseq") for c in found)


def guard_rails_for(cfg: Any) -> bool:
    """:func:`guard_rails` for a run about to start from ``cfg``: a config that names the
    plugin's task, criterion or architecture makes it a plugin run now."""
    if names_plugin(cfg):
        mark_in_use("config")
    return guard_rails()


@dataclass(frozen=True)
class Patch:
    """One patch: ``target`` (a fairseq attribute, or ``sys.excepthook``) replaced by
    ``replacement`` (the plugin's function or class), on ``scope``'s runs."""

    target: str
    replacement: str
    why: str
    scope: str
    guard_rail: bool
    install: Callable[[], None]


def _excepthook() -> None:
    errors.install_excepthook(acts=lambda: setting() != "off")


def _load_to_cpu() -> None:
    safe_loading.install(named=guard_rails)


def _restore() -> None:
    save_dir.install(guard_rails)


def _persistent_save() -> None:
    atomic_files.install_persistent_save(guard_rails)


def _copy() -> None:
    atomic_files.install_copy(guard_rails)


def _cpu_ddp() -> None:
    distributed.install_cpu_ddp(plugin_run)


def _broadcast() -> None:
    distributed.install_checkpoint_broadcast()


def _teardown() -> None:
    distributed.install_teardown(plugin_run)


def _writable_save_dir() -> None:
    save_dir.install_writable(guard_rails)


def _call_main() -> None:
    launch.install_call_main(guard_rails_for)


def _distributed_init() -> None:
    launch.install_distributed_init(guard_rails_for)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "fairseq.checkpoint_utils.load_checkpoint_to_cpu",
        "acl_fairseq.checkpoint.safe_loading",
        "torch >= 2.6 loads weights only and refuses the Namespace / omegaconf objects of "
        "fairseq checkpoints: the plain-data classes they hold are allowed during this call "
        "only. In guarded runs, a file that is no fairseq checkpoint is also named, with the fix",
        EVERY_RUN,
        False,
        _load_to_cpu,
    ),
    Patch(
        "fairseq.distributed.utils._broadcast_object_slow",
        "acl_fairseq.distributed._broadcast_object_slow",
        "the other workers receive the checkpoint worker 0 loaded pickled; under torch >= 2.6 "
        "their weights-only unpickling refuses it (every multi-worker run that restores)",
        EVERY_RUN,
        False,
        _broadcast,
    ),
    Patch(
        "fairseq.checkpoint_utils.load_checkpoint",
        "acl_fairseq.checkpoint.save_dir",
        "fairseq-train's restore step: the --save-dir checked first (a missing --restore-file, "
        "the folder's lock, leftovers of an interrupted save, a damaged or another run's "
        "checkpoint_last.pt, a finished run)",
        PLUGIN_RUNS,
        True,
        _restore,
    ),
    Patch(
        "fairseq.checkpoint_utils.torch_persistent_save",
        "acl_fairseq.checkpoint.atomic_files",
        "a checkpoint written in place is truncated by a kill mid-write: written beside it "
        "(NAME.tmp), flushed and renamed; a save the disk refuses (torch's 'unexpected pos') is "
        "named in one line with the checkpoint left intact",
        PLUGIN_RUNS,
        True,
        _persistent_save,
    ),
    Patch(
        "fairseq.file_io.PathManager.copy",
        "acl_fairseq.checkpoint.atomic_files",
        "the copies to checkpoint_best.pt / checkpoint_last.pt, written beside and renamed",
        PLUGIN_RUNS,
        True,
        _copy,
    ),
    Patch(
        "fairseq.checkpoint_utils.verify_checkpoint_directory",
        "acl_fairseq.checkpoint.save_dir",
        "fairseq-train's first write into --save-dir: a read-only or unwritable folder, a "
        "traceback in fairseq, is named in one line",
        PLUGIN_RUNS,
        True,
        _writable_save_dir,
    ),
    Patch(
        "fairseq.distributed.utils.call_main",
        "acl_fairseq.launch._call_main",
        "the launch checked on the CPU: fairseq's spawn starts one process per GPU (none, so "
        "it exits 0 untrained), NCCL and a missing --distributed-init-method named in one line; "
        "torchrun's rendezvous filled in",
        PLUGIN_RUNS,
        True,
        _call_main,
    ),
    Patch(
        "fairseq.distributed.utils.distributed_init",
        "acl_fairseq.launch._distributed_init",
        "the wait for the other ranks bounded by --heartbeat-timeout and announced; a peer "
        "that never comes named in one line (torch waits 30 minutes, silently)",
        PLUGIN_RUNS,
        True,
        _distributed_init,
    ),
    Patch(
        "sys.excepthook",
        "acl_fairseq.errors.install_excepthook",
        "in fairseq's commands, the plugin's own errors (AclFairseqError) as one line "
        "`PROG: error: MESSAGE`; every other exception goes to the previous hook",
        PLUGIN_RUNS,
        True,
        _excepthook,
    ),
    Patch(
        "fairseq.models.distributed_fairseq_model.DistributedDataParallel",
        "acl_fairseq.distributed.CpuDistributedDataParallel",
        "fairseq builds torch's DDP with device_ids, which torch refuses on the CPU: dropped "
        "when every parameter is on the CPU (--cpu with pytorch_ddp); on a GPU nothing changes",
        PLUGIN_RUNS,
        False,
        _cpu_ddp,
    ),
    Patch(
        "fairseq.distributed.utils.distributed_main",
        "acl_fairseq.distributed._distributed_main",
        "a worker's command returns with fairseq's data threads and the process group alive, "
        "which now and then aborts the process at exit: both stopped when it returns (and the "
        "threads at exit); a collective that fails because a peer died, a gloo traceback, "
        "names the rank that stopped in one line",
        PLUGIN_RUNS,
        False,
        _teardown,
    ),
)


def install() -> None:
    """Installs every entry of :data:`PATCHES` (idempotent; at plugin import). Reads
    ``ACL_FAIRSEQ_GUARD_RAILS`` once, so a bad value stops at import."""
    setting()
    for patch in PATCHES:
        patch.install()


def markdown_table() -> str:
    """The register as the Markdown table of docs/usage.md."""
    rows = [
        "| fairseq target | replaced by | acts on | guard rail | why |",
        "|---|---|---|---|---|",
    ]
    for p in PATCHES:
        rows.append(
            f"| `{p.target}` | `{p.replacement}` | {p.scope} | {'yes' if p.guard_rail else 'no'} "
            f"| {p.why} |"
        )
    return "\n".join(rows)
