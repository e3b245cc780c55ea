"""Data-parallel training with fairseq's wrappers, and torch's DDP on CPU.

``--ddp-backend pytorch_ddp`` (fairseq's default, alias ``c10d``) wraps the model as
``ModuleProxyWrapper(DistributedDataParallel(model))``. What the plugin adds for it (the
``install_*`` functions are entries of ``acl_fairseq.fairseq_patches``, installed at import;
all but the checkpoint broadcast act on plugin runs only):

* :func:`install_cpu_ddp`: fairseq 0.12 always builds torch's ``DistributedDataParallel``
  with ``device_ids=[device_id]`` (``fairseq/models/distributed_fairseq_model.py``), which
  torch refuses for a module on the CPU. Installed when the plugin is imported, it drops
  ``device_ids`` / ``output_device`` when, and only when, the module's parameters are all on
  the CPU (``fairseq-train --cpu``): torch's real reducer then runs with gloo. On a GPU
  nothing changes.
* :func:`install_checkpoint_broadcast`: with more than one worker, fairseq loads the
  checkpoint to restore or resume on worker 0 and broadcasts it pickled; under torch >= 2.6
  the other workers' ``torch.load`` refuses it (weights-only). Installed when the plugin is
  imported, the receivers unpickle what worker 0 of the same job sent.
* :func:`install_teardown`: fairseq's data-loading daemon thread (``BackgroundConsumer``),
  caught inside a torch operator when the interpreter shuts down, aborts the process
  ("terminate called without an active exception", now and then after a run that
  succeeded); and ``distributed_main`` returns with the process group alive. Installed when
  the plugin is imported, :func:`teardown` stops those threads and destroys the group when a
  worker's command returns (the threads again at exit). A worker whose collective failed
  because a peer died says which rank in one line (``launch.peer_lost``).
* :func:`call_through_wrappers`: DDP reduces the gradients of a backward pass only when the
  forward went through ``DistributedDataParallel.forward`` (which prepares its reducer).
  A model method other than ``forward`` reached through fairseq's ``ModuleProxyWrapper``
  (e.g. ``model.exit_outputs(...)``) bypasses it: the gradients stay local to each worker
  (on a GPU fairseq stops with "gradients are inconsistent between workers"; on CPU, where
  fairseq does not compare them, the workers silently drift apart). This calls such a method
  through the wrappers' forward instead.
* :func:`check_unused_parameters` (at set-up, by the task): without
  ``--find-unused-parameters`` DDP waits for the gradient of every trainable parameter, and
  stops at the second update when one is never used (RoBERTa's LM head in sentence
  classification); this says so first, naming the flag. :func:`check_static_graph`: ACL-Grad
  refuses torch's ``static_graph=True`` (see :mod:`acl_fairseq.acl_grad.step`).

Which all-reduce reduces what (the trainer calls ``optimizer.all_reduce_grads(model)`` once
per update, after the last micro-batch):

* ``legacy_ddp`` / ``no_c10d``: nothing is reduced during ``backward()``;
  ``all_reduce_grads`` runs ``LegacyDistributedDataParallel.all_reduce_grads``, the mean over
  the workers of ``.grad``.
* ``pytorch_ddp`` / ``c10d``: DDP's reducer hooks reduce ``.grad`` (the mean over the
  workers) during the ``backward()`` of the update's last micro-batch (the earlier ones run
  under ``no_sync()`` with ``--update-freq``); ``all_reduce_grads`` does nothing for the
  model.

Either way the trainer then multiplies by ``world_size / sample_size``.
"""

import atexit
import contextlib
import gc
import io
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fairseq.dataclass import FairseqDataclass
from omegaconf import II
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .errors import AclRuntimeError, AclValueError
from .launch import peer_lost

__all__ = [
    "CpuDistributedDataParallel",
    "DataParallelConfig",
    "call_through_wrappers",
    "check_static_graph",
    "check_unused_parameters",
    "find_ddp",
    "install_checkpoint_broadcast",
    "install_cpu_ddp",
    "install_teardown",
    "stop_data_threads",
    "teardown",
    "unwrap_model",
]


#: Whether each patch acts on this run (set by ``acl_fairseq.fairseq_patches``).
_acts: dict[str, Callable[[], bool]] = {"cpu_ddp": bool, "teardown": bool}


class CpuDistributedDataParallel(DistributedDataParallel):
    """torch's ``DistributedDataParallel``, built without ``device_ids`` / ``output_device``
    when every parameter of ``module`` is on the CPU (torch refuses them there); otherwise
    exactly torch's."""

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        devices = {p.device.type for p in module.parameters()}
        if devices == {"cpu"} and _acts["cpu_ddp"]():
            kwargs["device_ids"] = None
            kwargs["output_device"] = None
        super().__init__(module, *args, **kwargs)


def install_cpu_ddp(acts: Callable[[], bool]) -> None:
    """Makes fairseq's ``--ddp-backend pytorch_ddp`` / ``c10d`` build
    :class:`CpuDistributedDataParallel`, which acts where ``acts()`` (idempotent)."""
    _acts["cpu_ddp"] = acts
    from fairseq.models import distributed_fairseq_model

    distributed_fairseq_model.DistributedDataParallel = CpuDistributedDataParallel


def _broadcast_object_slow(obj: Any, src_rank: int, group: Any, dist_device: Any) -> Any:
    """fairseq's ``distributed.utils._broadcast_object_slow``, except that the receiving
    workers unpickle with ``weights_only=False``: the bytes are what the source worker of
    the same job pickled (the checkpoint it loaded, safely, for everyone)."""
    from fairseq.distributed.utils import broadcast, get_rank

    if get_rank(group) == src_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.ByteTensor(buffer.getbuffer()).to(dist_device)
        length = torch.LongTensor([len(data)]).to(dist_device)
        broadcast(length, src=src_rank, group=group)
        broadcast(data, src=src_rank, group=group)
        return obj
    length = torch.LongTensor([0]).to(dist_device)
    broadcast(length, src=src_rank, group=group)
    data = torch.ByteTensor(int(length.item())).to(dist_device)
    broadcast(data, src=src_rank, group=group)
    return torch.load(io.BytesIO(data.cpu().numpy()), map_location="cpu", weights_only=False)


def install_checkpoint_broadcast() -> None:
    """Lets the workers of a multi-worker run receive the checkpoint that worker 0 loaded
    (idempotent). fairseq's trainer loads ``--restore-file`` / ``checkpoint_last.pt`` on
    worker 0 and broadcasts it pickled; the others unpickle it with ``torch.load``, whose
    weights-only default (torch >= 2.6) refuses the checkpoint's config objects ("Weights
    only load failed": every data-parallel run that restores or resumes, GPU or CPU)."""
    from fairseq.distributed import utils

    utils._broadcast_object_slow = _broadcast_object_slow


def stop_data_threads(timeout: float = 30.0) -> None:
    """Ends fairseq's data-loading threads (``BackgroundConsumer``) that are still alive: each
    stops after the batch it is making, while this drains its queue (bounded: at most two
    more items; a thread stuck in its source is left after ``timeout`` seconds). Afterwards no
    thread is inside a torch operator when the interpreter exits."""
    from fairseq.data.iterators import BackgroundConsumer

    for thread in threading.enumerate():
        if not isinstance(thread, BackgroundConsumer) or not thread.is_alive():
            continue
        thread._max_len = 0  # its loop breaks after the next put, then puts its sentinel
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:  # not forever at exit
            try:
                thread._queue.get(timeout=0.05)
            except queue.Empty:
                pass


def teardown() -> None:
    """:func:`stop_data_threads`, then destroys the default process group, if any, after
    freeing what still holds it (the trainer's DDP wrapper in reference cycles), so gloo's and
    the TCP store's threads stop while the interpreter is whole."""
    stop_data_threads()
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    gc.collect()
    torch.distributed.destroy_process_group()


def _distributed_main(i: int, main: Any, cfg: Any, kwargs: dict) -> None:
    """fairseq's ``distributed_utils.distributed_main`` (which ends with a barrier), then
    :func:`teardown`, also when it raises. A module-level function: ``torch.multiprocessing.spawn``
    pickles it by name, and the spawned worker's import of the plugin installs it there too."""
    from fairseq.distributed import utils

    fairseq_main = getattr(utils.distributed_main, "__wrapped__", utils.distributed_main)
    try:
        fairseq_main(i, main, cfg, kwargs)
    except BaseException as e:  # a worker that stops on an error tears down too, then re-raises
        if not _acts["teardown"]():
            raise
        lost = peer_lost(e)  # a peer that died: named in one line (asks the job's store first)
        with contextlib.suppress(Exception):
            teardown()
        if lost is not None:
            raise AclRuntimeError(lost) from None
        raise
    if _acts["teardown"]():  # a stock run ends as fairseq ends it
        teardown()


def install_teardown(acts: Callable[[], bool]) -> None:
    """Makes every fairseq worker (``call_main``: fairseq-train, -validate, -hydra-train,
    spawned or not) run :func:`teardown` when its command returns, and every process that
    imported the plugin run :func:`stop_data_threads` at exit, where ``acts()`` (idempotent)."""
    _acts["teardown"] = acts
    from fairseq.distributed import utils

    if utils.distributed_main is not _distributed_main:
        _distributed_main.__wrapped__ = utils.distributed_main  # type: ignore[attr-defined]
        utils.distributed_main = _distributed_main
    atexit.unregister(_stop_data_threads_at_exit)
    atexit.register(_stop_data_threads_at_exit)


def _stop_data_threads_at_exit() -> None:
    """:func:`stop_data_threads` at exit, in plugin runs only."""
    if _acts["teardown"]():
        stop_data_threads()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside fairseq's distributed wrappers (each keeps it as ``.module``)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """torch's ``DistributedDataParallel`` among fairseq's wrappers of ``model``, if any."""
    while not isinstance(model, DistributedDataParallel):
        model = getattr(model, "module", None)
        if not isinstance(model, nn.Module):
            return None
    return model


def check_static_graph(model: nn.Module) -> None:
    """Raises RuntimeError when ``model`` is wrapped in torch's DDP with ``static_graph=True``
    (not a fairseq option): ACL-Grad's ``torch.autograd.grad`` before the backward pass would
    run the delayed all-reduce of DDP's first static-graph iteration, and the gradients would
    never be reduced (checked with torch 2.13)."""
    ddp = find_ddp(model)
    if ddp is not None and ddp.static_graph:
        raise AclRuntimeError(
            "ACL-Grad cannot train a DistributedDataParallel model built with "
            "static_graph=True: its gradients would not be all-reduced. Build it without "
            "static_graph (fairseq's --ddp-backend pytorch_ddp does), use --ddp-backend "
            "legacy_ddp, or turn ACL-Grad off (--no-acl-grad)."
        )


def call_through_wrappers(model: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
    """``unwrap_model(model).method(*args, **kwargs)``, called through the forward of every
    wrapper around it (so DDP prepares its reducer for the backward pass, and finds unused
    parameters from the result with ``--find-unused-parameters``).

    For the duration of the call the inner model's ``forward`` is ``method``; an unwrapped
    model just calls ``method``.
    """
    inner = unwrap_model(model)
    bound = getattr(inner, method)
    if inner is model:
        return bound(*args, **kwargs)
    inner.forward = bound  # an instance attribute: nn.Module.__call__ runs it
    try:
        return model(*args, **kwargs)
    finally:
        del inner.forward


@dataclass
class DataParallelConfig(FairseqDataclass):
    """fairseq's data-parallel settings, as a task sees them (:func:`check_unused_parameters`)."""

    ddp_backend: str = II("distributed_training.ddp_backend")
    find_unused_parameters: bool = II("distributed_training.find_unused_parameters")
    distributed_world_size: int = II("distributed_training.distributed_world_size")


def check_unused_parameters(cfg: Any, unused: list[str]) -> None:
    """Raises ValueError naming ``--find-unused-parameters`` when torch's DDP will run
    without it (``--ddp-backend pytorch_ddp`` / ``c10d``, more than one worker) and ``unused``
    names trainable parameters the loss never uses: DDP would wait for their gradients and
    stop at the second update ("Expected to have finished reduction in the prior iteration").
    ``cfg`` has the fields of :class:`DataParallelConfig`; unknown values count as off."""
    backend = getattr(cfg, "ddp_backend", None)
    world_size = getattr(cfg, "distributed_world_size", None)
    if backend not in ("pytorch_ddp", "c10d") or not isinstance(world_size, int):
        return
    if world_size < 2 or getattr(cfg, "find_unused_parameters", None) is not False or not unused:
        return
    shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
    raise AclValueError(
        f"--ddp-backend {backend} with {world_size} workers needs --find-unused-parameters "
        f"here: trainable parameters that the loss never uses ({shown}) would make torch's "
        "DistributedDataParallel wait for their gradients and stop at the second update. "
        "Pass --find-unused-parameters (as fairseq's RoBERTa GLUE recipes do), or "
        "--ddp-backend legacy_ddp."
    )
