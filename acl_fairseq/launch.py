"""Training on several processes or machines: the launch checked, the wait for the peers
bounded, a peer's end named.

fairseq starts a job's processes in one of three ways (docs/gpus.md, "Several machines"): one
process per rank started by the user (``--distributed-no-spawn``, ``--distributed-rank R``),
one per GPU spawned by fairseq itself (without ``--distributed-no-spawn``: a machine's
processes are its GPUs), or ``torchrun`` / SLURM, read from the environment. What the plugin
adds, in plugin runs (entries of ``acl_fairseq.fairseq_patches``; a stock run is fairseq's):

* :func:`check_launch` (``call_main``): on the CPU, fairseq's spawn starts one process per GPU
  (none) and the command exits 0 without training; ``--distributed-backend nccl`` needs GPUs;
  without ``--distributed-init-method`` fairseq asserts on the GPU count, and under
  ``torchrun`` it divides by it. The first two stop in one line naming the flag; ``torchrun``
  on the CPU gets the rendezvous it set up (``env://``, its ``RANK`` and ``WORLD_SIZE``).
* :func:`rendezvous` (``distributed_init``): the wait for the other ranks lasts at most
  ``--heartbeat-timeout`` seconds (fairseq's "no progress in N seconds"; else torch's default,
  30 minutes), said when it starts; a peer that never comes ends it in one line naming the
  flag. Collectives keep torch's default timeout.
* :func:`peer_lost`: a collective that fails because a peer's connection closed (the peer died)
  becomes one line naming the rank that ended (:func:`dead_ranks`).
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import AclRuntimeError, AclValueError

__all__ = [
    "TORCHRUN_ENV",
    "check_launch",
    "dead_ranks",
    "install_call_main",
    "install_distributed_init",
    "peer_lost",
    "rendezvous",
]

logger = logging.getLogger(__name__)

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
"""What ``torchrun`` (and ``torch.distributed.launch``) set for each process."""

#: Whether each patch acts on the run of this config (set by ``acl_fairseq.fairseq_patches``).
_acts: dict[str, Callable[[Any], bool]] = {"launch": lambda cfg: False}

_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Socket closed|connection closed|"
    r"NCCL communicator was aborted|ProcessGroupNCCL.*(aborted|error)",
    re.IGNORECASE,
)


def _on_cpu(cfg: Any) -> bool:
    return bool(cfg.common.cpu) or not torch.cuda.is_available()


def _torchrun() -> dict[str, str] | None:
    """The ``torchrun`` variables of this process when all are set, else None."""
    if all(key in os.environ for key in TORCHRUN_ENV):
        return {key: os.environ[key] for key in (*TORCHRUN_ENV, "LOCAL_RANK") if key in os.environ}
    return None


def check_launch(cfg: Any) -> None:
    """Before fairseq starts the job's processes (``call_main``), on a machine without GPUs:
    ``torchrun``'s rendezvous filled in; a launch that would not train (no GPU to spawn a
    process for, no ``--distributed-init-method``; NCCL on the CPU) stops with
    ``AclValueError`` naming the flag."""
    dt = cfg.distributed_training
    if getattr(cfg.common, "tpu", False) or getattr(dt, "pipeline_model_parallel", False):
        return
    gpus = torch.cuda.device_count()  # the processes fairseq's spawn would start
    env = _torchrun()
    unset = dt.distributed_init_method is None
    if gpus == 0 and unset and env is not None and int(env["WORLD_SIZE"]) > 1:
        dt.distributed_init_method = "env://"  # what fairseq sets, without its GPU arithmetic
        dt.distributed_world_size = int(env["WORLD_SIZE"])
        dt.distributed_rank = int(env["RANK"])
        dt.device_id = int(env.get("LOCAL_RANK", 0))
        dt.distributed_no_spawn = True
    world = int(dt.distributed_world_size)
    if world <= 1:
        return
    if gpus == 0 and dt.distributed_init_method is None:
        raise AclValueError(
            f"--distributed-world-size {world} on the CPU needs --distributed-init-method "
            "tcp://HOST:PORT (rank 0's machine and a free port; the same on every rank) and "
            "each process's --distributed-rank R with --distributed-no-spawn, or torchrun "
            "(docs/gpus.md, several machines)"
        )
    if gpus == 0 and not dt.distributed_no_spawn:
        raise AclValueError(
            f"--distributed-world-size {world} on the CPU without --distributed-no-spawn: "
            "fairseq would start one process per GPU, and this machine has none, so nothing "
            "would train (the command would exit at once). Start every rank yourself with "
            "--distributed-no-spawn and its --distributed-rank R (scripts/launch_cpu_workers.sh "
            "does that on one machine; docs/gpus.md, several machines)"
        )
    if _on_cpu(cfg) and dt.distributed_backend == "nccl":
        raise AclValueError(
            "--distributed-backend nccl runs on GPUs only: pass --distributed-backend gloo "
            "with --cpu"
        )


def _call_main(cfg: Any, main: Any, **kwargs: Any) -> Any:
    """fairseq's ``distributed_utils.call_main`` after :func:`check_launch` (plugin runs)."""
    if _acts["launch"](cfg):
        check_launch(cfg)
    return _call_main.__wrapped__(cfg, main, **kwargs)  # type: ignore[attr-defined]


def install_call_main(acts: Callable[[Any], bool]) -> None:
    """Makes fairseq's ``call_main`` (fairseq-train, -validate, -hydra-train) run
    :func:`check_launch` first where ``acts(cfg)`` (idempotent)."""
    _acts["launch"] = acts
    from fairseq.distributed import utils

    if utils.call_main is not _call_main:
        _call_main.__wrapped__ = utils.call_main  # type: ignore[attr-defined]
        utils.call_main = _call_main


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _timed_out(error: BaseException) -> bool:
    kinds = tuple(getattr(dist, name) for name in ("DistStoreError", "DistNetworkError") if
                  hasattr(dist, name))  # fmt: skip
    return isinstance(error, (TimeoutError, *kinds)) or "timed out" in str(error).lower()


def rendezvous(cfg: Any) -> None:
    """``init_process_group`` as fairseq's ``distributed_init`` calls it, waiting for the other
    ranks at most ``--heartbeat-timeout`` seconds (else torch's default); a wait that ends
    without them is ``AclRuntimeError`` naming the flag. The collectives then keep torch's
    default timeout."""
    dt = cfg.distributed_training
    default = dist.distributed_c10d.default_pg_timeout
    given = int(getattr(dt, "heartbeat_timeout", -1) or -1)
    wait = timedelta(seconds=given) if given > 0 else default
    seconds = wait.total_seconds()
    rank, world, where = dt.distributed_rank, dt.distributed_world_size, dt.distributed_init_method
    logger.info(
        "distributed init (rank %s): %s; waiting at most %g s for the %d ranks "
        "(--heartbeat-timeout N sets it)", rank, where, seconds, world,
    )  # fmt: skip
    try:
        dist.init_process_group(
            backend=dt.distributed_backend, init_method=where, world_size=world, rank=rank,
            timeout=wait,
        )  # fmt: skip
    except Exception as e:
        if not _timed_out(e):
            raise
        raise AclRuntimeError(
            f"rank {rank}: the {world} ranks of --distributed-world-size {world} did not all "
            f"join {where} within {seconds:g} s ({_first_line(e)}): start every rank "
            f"(--distributed-rank 0 to {world - 1}) with the same --distributed-init-method, "
            "rank 0's machine and a port it can listen on and the others reach; "
            "--heartbeat-timeout N sets this wait"
        ) from None
    if wait != default:
        dist.distributed_c10d._set_pg_timeout(default)  # collectives: torch's default
    if torch.cuda.is_available() and not cfg.common.cpu:  # as fairseq: NCCL's communicator
        dist.all_reduce(torch.zeros(1).cuda())


def _distributed_init(cfg: Any) -> int:
    """fairseq's ``distributed_utils.distributed_init``, its process group made by
    :func:`rendezvous` first (plugin runs)."""
    fairseq_init = _distributed_init.__wrapped__  # type: ignore[attr-defined]
    from argparse import Namespace

    if isinstance(cfg, Namespace):
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        cfg = convert_namespace_to_omegaconf(cfg)
    if cfg.common.tpu or dist.is_initialized() or not _acts["launch"](cfg):
        return fairseq_init(cfg)
    rendezvous(cfg)
    with warnings.catch_warnings():  # the group is made: fairseq's init goes on from there
        warnings.filterwarnings("ignore", message="Distributed is already initialized")
        return fairseq_init(cfg)


def install_distributed_init(acts: Callable[[Any], bool]) -> None:
    """Makes fairseq's ``distributed_init`` wait for the peers through :func:`rendezvous`
    where ``acts(cfg)`` (idempotent)."""
    _acts["launch"] = acts
    from fairseq.distributed import utils

    if utils.distributed_init is not _distributed_init:
        _distributed_init.__wrapped__ = utils.distributed_init  # type: ignore[attr-defined]
        utils.distributed_init = _distributed_init


def dead_ranks(store: Any, rank: int, world: int, wait: float = 3.0) -> list[int]:
    """The ranks that did not answer on ``store`` within ``wait`` seconds, each survivor
    writing its own key (they all reach here when a peer dies); with 2 ranks, the other."""
    if world == 2:
        return [1 - rank]
    if store is None:
        return [0]
    key = "acl_fairseq/alive/{}".format
    try:
        store.set(key(rank), "1")
        alive, deadline = {rank}, time.monotonic() + wait
        while len(alive) < world and time.monotonic() < deadline:
            alive |= {k for k in range(world) if k not in alive and store.check([key(k)])}
            time.sleep(0.05)
    except Exception:  # the store is gone: rank 0 holds it
        return [0]
    return [k for k in range(world) if k not in alive]


def peer_lost(error: BaseException) -> str | None:
    """One line for a collective that failed because a peer's connection closed: this rank,
    the rank(s) that ended (:func:`dead_ranks` on the job's store) and the fix; None for any
    other error."""
    if not isinstance(error, RuntimeError) or not _PEER_GONE.search(str(error)):
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        store = None
    dead = dead_ranks(store, rank, world)
    which = ", ".join(map(str, dead)) or "another rank"
    text = _first_line(error)
    match = _PEER_GONE.search(text)
    cause = re.sub(r"^\[[^\]]*\]\s*", "", text[: match.end()]) if match else text  # no source
    return (
        f"rank {rank}: rank {which} of the {world} stopped during training ({cause})"
        ", so this rank stops too: find why it stopped (its own output), then run every rank's "
        "command again (each resumes from checkpoint_last.pt)"
    )
