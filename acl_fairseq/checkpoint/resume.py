"""A reused ``--save-dir``: fairseq's default ``--restore-file checkpoint_last.pt`` resumes the
run saved there, whatever the command line now says; with another criterion, learning rate,
optimizer, model or data that silently continues the earlier run (its optimizer state, its
update count) instead of starting the one asked for.

:func:`check_resume` refuses that case unless the command says what is meant: an explicit
``--restore-file`` (resume it, whatever changed) or ``--reset-optimizer`` (a new optimization
from its weights). Resuming with the same settings (a crash, a preempted job, a larger
``--max-update``) goes on as before.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import AclValueError

__all__ = ["changed_settings", "check_resume", "settings"]


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
    return dict(vars(value))  # a legacy model's argparse.Namespace


def settings(cfg: Any) -> dict[str, Any]:
    """What makes a run another run: the criterion and its settings, the optimizer, learning
    rate and schedule, the architecture, the task and its data folder (``cfg`` a fairseq
    config, or the plain dict a checkpoint holds)."""
    criterion = _section(cfg, "criterion")
    optimizer = _section(cfg, "optimizer")
    model = _section(cfg, "model")
    task = _section(cfg, "task")
    out = {f"criterion.{k}": v for k, v in sorted(criterion.items())}
    out["optimizer"] = optimizer.get("_name")
    out["lr"] = list(_section(cfg, "optimization").get("lr") or [])
    out["lr_scheduler"] = _section(cfg, "lr_scheduler").get("_name")
    out["arch"] = model.get("arch") or model.get("_name")
    out["task"] = task.get("_name")
    data = task.get("data")
    out["data"] = os.path.abspath(data) if data else data
    out["num_classes"] = task.get("num_classes")
    return out


def _flag(key: str) -> str:
    """The command-line name of a :func:`settings` key (``criterion.temperature`` ->
    ``--temperature``, ``criterion._name`` -> ``--criterion``, ``data`` -> ``DATA``)."""
    if key == "data":
        return "DATA"
    name = {"criterion._name": "criterion"}.get(key, key.removeprefix("criterion."))
    return "--" + name.replace("_", "-")


def changed_settings(saved: Any, current: Any) -> list[str]:
    """``--flag saved -> current`` for every setting of :func:`settings` that differs."""
    old, new = settings(saved), settings(current)
    return [
        f"{_flag(key)} {old.get(key)} -> {new.get(key)}"
        for key in dict.fromkeys([*old, *new])
        if old.get(key) != new.get(key)
    ]


def _saved_cfg(path: str) -> Any:
    """The config saved in checkpoint ``path``, read without loading its tensors."""
    import torch

    from .safe_loading import SAFE_GLOBALS

    with torch.serialization.safe_globals(SAFE_GLOBALS):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return state.get("cfg") if isinstance(state, dict) else None


def check_resume(cfg: Any, checkpoint_cfg: Any, suffix: str = "") -> None:
    """Raises ``ValueError`` when the default ``--restore-file`` would resume a
    ``checkpoint_last.pt`` trained with other :func:`settings` than ``cfg`` (the full config of
    this run; ``checkpoint_cfg`` its checkpoint section), unless ``--reset-optimizer``."""
    from .safe_loading import DEFAULT_RESTORE_FILE

    if checkpoint_cfg.restore_file != DEFAULT_RESTORE_FILE or checkpoint_cfg.reset_optimizer:
        return
    last = os.path.join(checkpoint_cfg.save_dir, f"checkpoint_last{suffix or ''}.pt")
    if not os.path.isfile(last):
        return
    try:
        saved = _saved_cfg(last)
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
