"""fairseq-train's restore step (``checkpoint_utils.load_checkpoint``), with the ``--save-dir``
checked before anything is restored, trained or written.

On rank 0, in this order (:func:`check_save_dir`): a missing ``--restore-file``, the
folder's lock (not with ``--no-save``), the leftovers of an interrupted save removed, a
damaged ``checkpoint_last.pt`` (the newest intact one named), another run's checkpoint, a
finished run (exit 0, nothing rewritten), a newer checkpoint than the last (a warning). The
outcome is broadcast, so every worker stops or goes on together. docs/usage.md, "Training".

A guard rail (``acl_fairseq.fairseq_patches``): where the guard rails do not act (a stock run,
``ACL_FAIRSEQ_GUARD_RAILS=off``) this is fairseq's own function. Where they act, a config that
fairseq itself refuses (``--finetune-from-model`` with a ``--restore-file``) goes to fairseq
first, for its own error, and the checks read every optional key with a default.

:func:`install_writable` (also a guard rail): fairseq-train's first write into ``--save-dir``
(``verify_checkpoint_directory``), which a read-only or unwritable folder fails with a
traceback, names the folder and the reason in one line.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from fairseq import checkpoint_utils

from ..atomic_write import failure_reason
from ..errors import AclOSError, AclValueError
from .atomic_files import remove_leftovers
from .fits import CheckpointMismatch
from .resume import check_resume, finished, newest_of_run, read_saved
from .run_lock import acquire
from .safe_loading import DEFAULT_RESTORE_FILE, check_restore_file, damaged, named_as

__all__ = ["check_save_dir", "install", "install_writable"]

logger = logging.getLogger(__name__)


def _resumed_last(cfg: Any, suffix: str | None) -> str | None:
    """``SAVE_DIR/checkpoint_last.pt`` when this run restores it (the default
    ``--restore-file``, or that file named), else None."""
    last = os.path.join(cfg.save_dir, f"checkpoint_last{suffix or ''}.pt")
    if cfg.restore_file == DEFAULT_RESTORE_FILE:
        return last
    path = cfg.restore_file.replace(".pt", suffix + ".pt") if suffix is not None else None
    same = path is not None and os.path.abspath(path) == os.path.abspath(last)
    return last if same else None


def _damaged_last(last: str, what: str, newest: Any) -> AclValueError:
    if newest is None:
        fix = (
            "there is no intact checkpoint of this run beside it: remove it to start afresh "
            "(or pass another --save-dir)"
        )
    else:
        fix = (
            f"the newest intact checkpoint of this run there is {newest.path} "
            f"({newest.where()}): resume from it with --restore-file {newest.path}"
        )
    return AclValueError(f"{last} {what}, so this run cannot resume from it; {fix}")


def check_save_dir(cfg: Any, run_cfg: Any, suffix: str | None = "") -> str | None:
    """Steps 1-7 of the module docstring for fairseq's checkpoint config ``cfg`` and the full
    config ``run_cfg`` (None: only steps 1-4); returns the line that says the run is finished,
    or None to train. Raises the plugin's error of the first step that stops the run."""
    if getattr(cfg, "save_dir", None) is None:  # a caller's partial config: fairseq's own
        return None
    check_restore_file(cfg, suffix)
    if not getattr(cfg, "no_save", False):
        acquire(cfg.save_dir)
        for path in remove_leftovers(cfg.save_dir):
            logger.warning(f"removed {path}: an incomplete file left by an interrupted save")
    last = _resumed_last(cfg, suffix)
    if last is None:
        return None
    if not os.path.isfile(last):
        newest = newest_of_run(cfg.save_dir, run_cfg, last) if run_cfg is not None else None
        if newest is not None and cfg.restore_file == DEFAULT_RESTORE_FILE:
            logger.warning(
                f"--save-dir {cfg.save_dir} holds {newest.path} ({newest.where()}) of this run "
                f"but no {os.path.basename(last)} (its first save was interrupted?): this run "
                f"starts from the beginning. To resume instead, pass --restore-file {newest.path}"
            )
        return None
    what = damaged(last)
    if what is not None:
        newest = newest_of_run(cfg.save_dir, run_cfg, last) if run_cfg is not None else None
        raise _damaged_last(last, what, newest)
    if run_cfg is None:
        return None
    check_resume(run_cfg, cfg, suffix)
    try:
        saved = read_saved(last)
    except Exception:  # unreadable here: fairseq's own loading reports it
        return None
    if getattr(cfg, "reset_optimizer", False):  # a new optimization from its weights
        return None
    done = finished(saved, run_cfg, getattr(cfg, "reset_dataloader", False))
    if done is not None:
        return (
            f"{last} is a finished run ({done}): nothing to train, nothing in --save-dir "
            f"{cfg.save_dir} is changed. To train it further, raise --max-update / "
            "--max-epoch; for a new run, pass another --save-dir"
        )
    newer = newest_of_run(cfg.save_dir, run_cfg, last, newer_than=os.path.getmtime(last))
    if newer is not None and newer.num_updates > saved.num_updates:
        logger.warning(
            f"{newer.path} ({newer.where()}) is newer than {last} ({saved.where()}): a save "
            f"was interrupted after writing it. This run resumes from {last}; to resume from "
            f"the newer one instead, pass --restore-file {newer.path}"
        )
    return None


def _on_rank0(trainer: Any, check: Callable[[], Any]) -> Any:
    """``check()`` on data-parallel rank 0; its result, or its exception, on every rank."""
    world_size = int(getattr(trainer, "data_parallel_world_size", 1) or 1)
    rank = trainer.data_parallel_rank if world_size > 1 else 0
    outcome: tuple[bool, Any] = (True, None)
    if rank == 0:
        try:
            outcome = (True, check())
        except Exception as e:
            if world_size == 1:
                raise
            outcome = (False, e)
    if world_size > 1:
        from fairseq.distributed import utils as distributed_utils

        outcome = distributed_utils.broadcast_object(
            outcome, src_rank=0, group=trainer.data_parallel_process_group,
            dist_device=trainer.device,
        )  # fmt: skip
    ok, value = outcome
    if not ok:
        raise value
    return value


def _hydra_hint() -> str:
    """Under fairseq-hydra-train: where the model flags' overrides are described."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return ""
    except ImportError:
        return ""
    return (
        ". With fairseq-hydra-train the model flags are overrides (model._name=..., "
        "++model.encoder_layers=..., task.max_positions=...): configs/README.md turns a "
        "converted BERT's fairseq_args.txt into them"
    )


def _checked_restore(load_fn: Callable) -> Callable:
    @functools.wraps(load_fn)
    def load_checkpoint(cfg, trainer, **kwargs):
        if not _acts() or _refused_by_fairseq(cfg):
            return load_fn(cfg, trainer, **kwargs)
        suffix = getattr(trainer, "checkpoint_suffix", "")
        run_cfg = getattr(trainer, "cfg", None)
        done = _on_rank0(trainer, lambda: check_save_dir(cfg, run_cfg, suffix))
        if done is not None:
            if int(getattr(trainer, "data_parallel_rank", 0) or 0) == 0:
                logger.info(done)
            raise SystemExit(0)
        try:
            with named_as("--restore-file (checkpoint.restore_file)"):
                return load_fn(cfg, trainer, **kwargs)
        except Exception as e:
            # fairseq's trainer replaces any loading error by "Cannot load model parameters
            # ... ensure that the architectures match": ours says which flag, so it goes last
            if isinstance(e.__context__, CheckpointMismatch):
                raise CheckpointMismatch(f"{e.__context__}{_hydra_hint()}") from None
            raise

    load_checkpoint._acl_fairseq_safe = True  # type: ignore[attr-defined]
    return load_checkpoint


def _refused_by_fairseq(cfg: Any) -> bool:
    """Whether fairseq's ``load_checkpoint`` refuses ``cfg`` itself (its own message)."""
    restore = getattr(cfg, "restore_file", DEFAULT_RESTORE_FILE)
    return restore != DEFAULT_RESTORE_FILE and bool(getattr(cfg, "finetune_from_model", None))


#: Whether the guard rails act on this run (set by ``acl_fairseq.fairseq_patches``).
_acts: Callable[[], bool] = bool


def install(acts: Callable[[], bool]) -> None:
    """Idempotent: wraps ``checkpoint_utils.load_checkpoint`` (fairseq-train's restore step),
    checked where ``acts()``."""
    global _acts
    _acts = acts
    current = checkpoint_utils.load_checkpoint
    if not getattr(current, "_acl_fairseq_safe", False):
        checkpoint_utils.load_checkpoint = _checked_restore(current)


def _writable_save_dir(original: Callable) -> Callable:
    @functools.wraps(original)
    def verify_checkpoint_directory(save_dir: str) -> None:
        if not _acts():
            return original(save_dir)
        try:
            return original(save_dir)
        except OSError as e:
            raise AclOSError(
                f"--save-dir {save_dir}: cannot write there ({failure_reason(e)}): give "
                "--save-dir a folder this run may write to"
            ) from None

    verify_checkpoint_directory._acl_fairseq_safe = True  # type: ignore[attr-defined]
    return verify_checkpoint_directory


def install_writable(acts: Callable[[], bool]) -> None:
    """Idempotent: fairseq's ``checkpoint_utils.verify_checkpoint_directory`` (its first
    write into ``--save-dir``, a file named ``dummy``) names a folder it cannot write in one
    line, where ``acts()``."""
    global _acts
    _acts = acts
    current = checkpoint_utils.verify_checkpoint_directory
    if not getattr(current, "_acl_fairseq_safe", False):
        checkpoint_utils.verify_checkpoint_directory = _writable_save_dir(current)
