"""A reused ``--save-dir``: fairseq's default ``--restore-file checkpoint_last.pt`` would
silently continue the run saved there, whatever the command line now says.

:func:`check_resume` refuses a run with other :func:`settings` unless ``--restore-file`` or
``--reset-optimizer`` says what is meant. From a checkpoint's header (:func:`read_saved`):
:func:`finished` runs, and :func:`newest_of_run` (the newest intact checkpoint to resume
from). What users see: docs/usage.md, "Training".
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

import torch

from ..errors import AclValueError
from .safe_loading import DEFAULT_RESTORE_FILE, SAFE_GLOBALS

__all__ = [
    "Saved",
    "changed_settings",
    "check_resume",
    "finished",
    "newest_of_run",
    "read_saved",
    "settings",
]

# The config sections whose fields make another run, minus the fields that do not (logging,
# devices, when to stop, validation). Sections not listed (checkpoint, generation, ...) do not.
_IGNORED: dict[str, set[str]] = {
    "criterion": set(),
    "optimizer": {"tpu"},
    "optimization": {"max_epoch", "max_update", "stop_min_lr", "stop_time_hours",
                     "debug_param_names"},
    "lr_scheduler": set(),
    "task": {"data", "acl_grad_log", "acl_grad_log_top_k", "ddp_backend",
             "find_unused_parameters"},
    "common": {"aim_repo", "aim_run_hash", "all_gather_list_size", "azureml_logging", "cpu",
               "empty_cache_freq", "log_file", "log_format", "log_interval", "no_progress_bar",
               "on_cpu_convert_precision", "plasma_path", "profile", "reset_logging",
               "suppress_crashes", "tensorboard_logdir", "tpu", "use_plasma_view", "user_dir",
               "wandb_project"},
    "dataset": {"batch_size_valid", "combine_valid_subsets", "data_buffer_size", "dataset_impl",
                "disable_validation", "fixed_validation_seed", "gen_subset",
                "ignore_unused_valid_subsets", "max_tokens_valid", "max_valid_steps",
                "num_shards", "num_workers", "shard_id", "skip_invalid_size_inputs_valid_test",
                "valid_subset", "validate_after_updates", "validate_interval",
                "validate_interval_updates"},
    "ema": set(),
}  # fmt: skip
# sections of which only these fields make another run (the rest is process plumbing)
_ONLY: dict[str, set[str]] = {"distributed_training": {"distributed_world_size"}}
_ORDER = ["criterion", "optimizer", "optimization", "lr_scheduler", "model", "task", "common",
          "dataset", "distributed_training", "ema"]  # fmt: skip
_NAMED = {"criterion", "optimizer", "lr_scheduler", "model", "task"}  # _name is a choice
_NAME_FLAGS = {"model": "--arch", "lr_scheduler": "--lr-scheduler"}


def _section(cfg: Any, name: str) -> dict[str, Any]:
    value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    except ImportError:
        pass
    return dict(vars(value)) if hasattr(value, "__dict__") else {}  # a legacy model's Namespace


def _section_names(cfg: Any) -> list[str]:
    names = cfg.keys() if hasattr(cfg, "keys") else vars(cfg).keys()
    return [str(n) for n in names]


def _flag(section: str, key: str) -> str:
    if key == "_name":
        return _NAME_FLAGS.get(section, "--" + section.replace("_", "-"))
    return "--" + key.replace("_", "-")


def settings(cfg: Any) -> dict[str, Any]:
    """What makes a run another run, by flag (``DATA``: the data folder's absolute path), from
    a fairseq config or a checkpoint's dict. Not what only logs, validates, saves, says when
    to stop, or places the run."""
    sections = {name: _section(cfg, name) for name in _section_names(cfg)}
    out: dict[str, Any] = {}
    for name in _ORDER:
        fields = sections.get(name) or {}
        if name == "model":  # a legacy model's Namespace holds every flag: keep the model's
            others = {k for n, s in sections.items() if n != "model" for k in s} - {"_name"}
            fields = {k: v for k, v in fields.items() if k not in others and k not in sections}
            if "arch" in fields:
                fields = {"_name": fields.pop("arch"), **fields}
        keep, ignored = _ONLY.get(name), _IGNORED.get(name, set())
        for key in sorted(fields, key=lambda k: (k != "_name", k)):
            if key == "_name" and name not in _NAMED:
                continue  # the section's own name (None)
            if key not in ignored and (keep is None or key in keep):
                out.setdefault(_flag(name, key), fields[key])
        if name == "task":
            data = fields.get("data")
            out["DATA"] = os.path.abspath(data) if data else data
    return out


def changed_settings(saved: Any, current: Any) -> list[str]:
    """``--flag saved -> current`` for every setting of :func:`settings` that both configs
    have and that differs."""
    old, new = settings(saved), settings(current)
    return [
        f"{flag} {old[flag]} -> {new[flag]}"
        for flag in old
        if flag in new and old[flag] != new[flag]
    ]


class Saved(NamedTuple):
    """What a checkpoint file says about its run."""

    path: str
    cfg: Any  # the plain dict of the run's config (None: an old checkpoint with only args)
    num_updates: int
    epoch: int  # the epoch its data iterator resumes in (fairseq's train_iterator)
    iterations_in_epoch: int  # 0: saved at the end of epoch ``epoch - 1``

    def where(self) -> str:
        """fairseq's ``epoch E @ U updates``."""
        return f"epoch {self.epoch} @ {self.num_updates} updates"


def read_saved(path: str) -> Saved:
    """:class:`Saved` of checkpoint ``path``, read with the weights-only unpickler and its
    tensors memory-mapped, not loaded. Raises on a file that is not a whole checkpoint."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    history = state.get("optimizer_history") or [{}]
    itr = (state.get("extra_state") or {}).get("train_iterator") or {}
    return Saved(
        path,
        state.get("cfg"),
        int(history[-1].get("num_updates", 0)),
        int(itr.get("epoch", 1)),
        int(itr.get("iterations_in_epoch", 0)),
    )


def check_resume(cfg: Any, checkpoint_cfg: Any, suffix: str = "") -> None:
    """Raises ``ValueError`` when the default ``--restore-file`` would resume a
    ``checkpoint_last.pt`` trained with other :func:`settings` than ``cfg`` (the full config of
    this run; ``checkpoint_cfg`` its checkpoint section), unless ``--reset-optimizer``."""
    if checkpoint_cfg.restore_file != DEFAULT_RESTORE_FILE or checkpoint_cfg.reset_optimizer:
        return
    last = os.path.join(checkpoint_cfg.save_dir, f"checkpoint_last{suffix or ''}.pt")
    if not os.path.isfile(last):
        return
    try:
        saved = read_saved(last).cfg
    except Exception:  # unreadable here: fairseq's own loading reports it
        return
    if not saved:
        return
    changes = changed_settings(saved, cfg)
    if not changes:
        return
    raise AclValueError(
        f"--save-dir {checkpoint_cfg.save_dir} holds {last}, saved by an earlier run with other "
        f"settings ({'; '.join(changes)}), and the default --restore-file would resume that "
        f"run: its optimizer state and updates, not the run asked for. Pass --restore-file "
        f"{last} to resume it anyway, --reset-optimizer to start a new optimization from its "
        "weights, or another --save-dir to start afresh"
    )


def finished(saved: Saved, cfg: Any, reset_dataloader: bool = False) -> str | None:
    """How ``saved`` already reached this run's end (``cfg``: its full config): ``update N of
    --max-update N`` or the last epoch of ``--max-epoch``; None if there is more to train.
    fairseq would train one more update before it checks ``--max-update``."""
    optimization = _section(cfg, "optimization")
    max_update = int(optimization.get("max_update") or 0)
    max_epoch = int(optimization.get("max_epoch") or 0)
    if max_update > 0 and saved.num_updates >= max_update:
        return f"update {saved.num_updates} of --max-update {max_update}"
    done_epochs = saved.epoch - 1  # at the end of an epoch, fairseq saves the next one's start
    if max_epoch > 0 and not reset_dataloader and saved.iterations_in_epoch == 0:
        if done_epochs >= max_epoch:
            return f"epoch {done_epochs} of --max-epoch {max_epoch}, {saved.num_updates} updates"
    return None


_CHECKPOINT = re.compile(r"checkpoint.*\.pt$")


def newest_of_run(save_dir: str, cfg: Any, exclude: str, newer_than: float = 0.0) -> Saved | None:
    """The intact checkpoint in ``save_dir`` with the most updates, other than ``exclude``,
    saved with the same :func:`settings` as ``cfg`` and modified after ``newer_than`` (a
    time stamp); None if there is none."""
    best: Saved | None = None
    try:
        names = sorted(os.listdir(save_dir))
    except OSError:
        return None
    for name in names:
        path = os.path.join(save_dir, name)
        if not _CHECKPOINT.match(name) or os.path.abspath(path) == os.path.abspath(exclude):
            continue
        try:
            if os.path.getmtime(path) <= newer_than:
                continue
            saved = read_saved(path)
        except Exception:  # not whole, or not a checkpoint
            continue
        if saved.cfg is None or changed_settings(saved.cfg, cfg):
            continue
        if best is None or saved.num_updates > best.num_updates:
            best = saved
    return best
