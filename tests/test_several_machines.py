"""Training on several machines with fairseq's own flags (docs/gpus.md, "Several machines"),
two processes on this host standing for two machines, each started by its own command:

    fairseq-train ... --cpu --distributed-backend gloo --distributed-init-method tcp://HOST:PORT
        --distributed-world-size 2 --distributed-rank R --distributed-num-procs 1
        --distributed-no-spawn

They train as one worker with ``--update-freq 2`` under both data-parallel backends; what goes
wrong says so in one line (acl_fairseq/launch.py): fairseq's spawn on a machine without GPUs
(which exited 0 untrained), a peer that never starts (which waited 30 minutes, silently), a
peer that dies (a gloo traceback). A stock run keeps fairseq's behaviour."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from fork_server import ForkServer
from omegaconf import OmegaConf
from test_distributed import CASES, COMMON, Run, Trained, assert_same_training

from acl_fairseq import fairseq_patches, launch

from fairseq_helpers import REPO, command_env, json_records, train_command

TINY_STOCK = [a for a in CASES["acl_embed"] if a not in ("--criterion", "acl_embed")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_flags(rank: int, port: int, world: int = 2, spawn: bool = False) -> list[str]:
    """fairseq's flags of one process standing for one machine."""
    flags = ["--distributed-init-method", f"tcp://127.0.0.1:{port}"]
    flags += ["--distributed-world-size", str(world), "--distributed-rank", str(rank)]
    flags += ["--distributed-num-procs", "1", "--distributed-backend", "gloo"]
    return flags if spawn else [*flags, "--distributed-no-spawn"]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """``cmd`` started (served by the tests' fork server when it is on), its output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(
            ForkServer.served(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO),
            env=command_env({"OMP_NUM_THREADS": "1"}),
        )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def errors_of(log: Path) -> list[str]:
    """The lines of ``log`` that a command printed as its error, and tracebacks."""
    text = log.read_text(errors="replace")
    return [
        line
        for line in text.splitlines()
        if "error: " in line and "fairseq-train" in line or line.startswith("Traceback")
    ]


@pytest.fixture(scope="module")
def one_worker(sentiment_data, tmp_path_factory) -> Trained:
    run = Run("acl_embed", update_freq=2)
    save_dir = tmp_path_factory.mktemp("one")
    proc = start(train_command(sentiment_data, save_dir, *run.args(save_dir)), save_dir / "log")
    assert finish(proc) == 0, (save_dir / "log").read_text()[-3000:]
    return Trained(run, (save_dir / "log").read_text(), save_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["legacy_ddp", pytest.param("pytorch_ddp", marks=pytest.mark.server_off)]
)
def test_two_processes_as_two_machines_train_as_one_worker(
    sentiment_data, tmp_path, one_worker, backend
):
    """Both data-parallel backends: the same weights, statistics and ACL-Grad decisions as
    one worker with --update-freq 2."""
    run = Run("acl_embed", workers=2, backend=backend, find_unused=backend == "pytorch_ddp")
    save_dir = tmp_path / backend
    save_dir.mkdir()
    port = free_port()
    procs = [
        start(
            train_command(
                sentiment_data, save_dir, *run.args(save_dir), *machine_flags(rank, port)
            ),
            save_dir / f"machine{rank}.log",
        )  # fmt: skip
        for rank in (0, 1)
    ]
    codes = [finish(p) for p in procs]
    rank0 = (save_dir / "machine0.log").read_text()
    assert codes == [0, 0], rank0[-3000:] + (save_dir / "machine1.log").read_text()[-3000:]
    assert "training on 2 devices" in rank0
    assert_same_training(one_worker, Trained(run, rank0, save_dir))


@pytest.mark.slow
def test_fairseqs_spawn_without_gpus_is_one_line_not_a_silent_exit(sentiment_data, tmp_path):
    """Without --distributed-no-spawn fairseq starts one process per GPU: none here. Both
    processes exited 0 untrained; now each stops in one line naming the flag. A stock run
    (fairseq's task, criterion and model) still exits as fairseq does."""
    port = free_port()
    args = [*COMMON, *CASES["acl_embed"], "--ddp-backend", "legacy_ddp"]
    logs = [tmp_path / f"machine{rank}.log" for rank in (0, 1)]
    procs = [
        start(
            train_command(
                sentiment_data, tmp_path / "save", *args, *machine_flags(rank, port, spawn=True)
            ),
            logs[rank],
        )  # fmt: skip
        for rank in (0, 1)
    ]
    assert [finish(p) for p in procs] == [1, 1]
    for log in logs:
        assert errors_of(log) == [
            "fairseq-train: error: --distributed-world-size 2 on the CPU without "
            "--distributed-no-spawn: fairseq would start one process per GPU, and this machine "
            "has none, so nothing would train (the command would exit at once). Start every "
            "rank yourself with --distributed-no-spawn and its --distributed-rank R "
            "(scripts/launch_cpu_workers.sh does that on one machine; docs/gpus.md, several "
            "machines)"
        ]
    assert not (tmp_path / "save" / "checkpoint_last.pt").exists()
    stock = [*COMMON, *TINY_STOCK, "--criterion", "sentence_prediction", "--task",
             "sentence_prediction", "--ddp-backend", "legacy_ddp"]  # fmt: skip
    cmd = train_command(
        sentiment_data, tmp_path / "stock", *stock, *machine_flags(0, port, 2, True)
    )
    log = tmp_path / "stock.log"
    assert finish(start(cmd, log)) == 0 and errors_of(log) == []
    assert json_records(log.read_text()) == []  # fairseq's own silent exit, untouched


@pytest.mark.slow
def test_a_peer_that_never_starts_ends_the_wait_naming_the_flag(sentiment_data, tmp_path):
    """Rank 0 alone: it waits --heartbeat-timeout seconds (said at the start), then stops in
    one line naming the flag; torch's default was 30 minutes without a word."""
    port = free_port()
    args = [*COMMON, *CASES["acl_embed"], "--ddp-backend", "legacy_ddp", "--heartbeat-timeout", "3"]
    log = tmp_path / "alone.log"
    cmd = train_command(sentiment_data, tmp_path / "save", *args, *machine_flags(0, port))
    assert finish(start(cmd, log)) == 1
    text = log.read_text()
    assert "waiting at most 3 s for the 2 ranks (--heartbeat-timeout N sets it)" in text
    (line,) = errors_of(log)
    assert line.startswith(
        f"fairseq-train: error: rank 0: the 2 ranks of --distributed-world-size 2 did not all "
        f"join tcp://127.0.0.1:{port} within 3 s ("
    )
    assert line.endswith("--heartbeat-timeout N sets this wait")


@pytest.mark.slow
def test_a_peer_killed_mid_training_ends_the_other_naming_it(sentiment_data, tmp_path):
    """kill -9 of rank 1 after a few updates: rank 0 stops in one line naming rank 1 (it was
    gloo's "Connection reset by peer" traceback)."""
    port = free_port()
    args = [*COMMON, *CASES["acl_embed"], "--ddp-backend", "legacy_ddp", "--max-update", "100000"]
    logs = [tmp_path / f"machine{rank}.log" for rank in (0, 1)]
    procs = [
        start(
            train_command(sentiment_data, tmp_path / "save", *args, *machine_flags(rank, port)),
            logs[rank],
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and procs[0].poll() is None:
            done = [r for r in json_records(logs[0].read_text()) if "num_updates" in r]
            if len(done) >= 3:
                break
            time.sleep(0.2)
        assert procs[0].poll() is None, logs[0].read_text()[-3000:]
        os.kill(procs[1].pid, signal.SIGKILL)
        assert finish(procs[1]) == -signal.SIGKILL
        assert finish(procs[0], timeout=120) == 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    (line,) = errors_of(logs[0])
    assert line.split("fairseq-train: error: ", 1)[1].startswith(
        "rank 0: rank 1 of the 2 stopped during training ("
    ), line
    assert line.endswith(
        "then run every rank's command again (each resumes from checkpoint_last.pt)"
    )


# ---------------------------------------------------------------- the launch, without a launch


def config(**distributed) -> object:
    """The parts of fairseq's config that ``launch.check_launch`` reads."""
    training = {
        "distributed_world_size": 1, "distributed_rank": 0, "distributed_init_method": None,
        "distributed_no_spawn": False, "distributed_backend": "nccl", "device_id": 0,
        "pipeline_model_parallel": False, "heartbeat_timeout": -1, **distributed,
    }  # fmt: skip
    return OmegaConf.create({"common": {"cpu": True, "tpu": False},
                             "distributed_training": training})  # fmt: skip


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="the checks of a machine without GPUs")
def test_check_launch_on_a_machine_without_gpus(monkeypatch):
    for key in launch.TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    launch.check_launch(config())  # one process: nothing to check
    with pytest.raises(ValueError, match="needs --distributed-init-method tcp://HOST:PORT"):
        launch.check_launch(config(distributed_world_size=2))
    with pytest.raises(ValueError, match="without --distributed-no-spawn: fairseq would start"):
        launch.check_launch(config(distributed_world_size=2, distributed_init_method="tcp://h:1"))
    with pytest.raises(ValueError, match="^--distributed-backend nccl runs on GPUs only"):
        launch.check_launch(config(distributed_world_size=2, distributed_init_method="tcp://h:1",
                                   distributed_no_spawn=True))  # fmt: skip
    # torchrun on the CPU: its rendezvous (fairseq's own divides by the GPU count)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = config(distributed_backend="gloo")
    launch.check_launch(cfg)
    dt = cfg.distributed_training
    assert (dt.distributed_init_method, dt.distributed_world_size, dt.distributed_rank,
            dt.device_id, dt.distributed_no_spawn) == ("env://", 4, 3, 1, True)  # fmt: skip


def test_dead_ranks_are_those_that_do_not_answer_on_the_store():
    store = torch.distributed.HashStore()
    for alive in (0, 2):  # the other survivors answer
        store.set(f"acl_fairseq/alive/{alive}", "1")
    assert launch.dead_ranks(store, 3, 5, wait=0.3) == [1, 4]
    assert launch.dead_ranks(None, 1, 2) == [0] and launch.dead_ranks(None, 0, 2) == [1]
    assert launch.dead_ranks(None, 2, 3) == [0]  # no store: rank 0, which held it, ended


def test_a_config_names_the_plugin_by_its_task_criterion_or_architecture():
    from argparse import Namespace

    def cfg(task: str, criterion: str, arch: str) -> Namespace:
        named = [Namespace(_name=name) for name in (task, criterion)]
        return Namespace(task=named[0], criterion=named[1], model=Namespace(arch=arch))

    assert not fairseq_patches.names_plugin(cfg("sentence_prediction", "sentence_prediction",
                                                "roberta"))  # fmt: skip
    assert fairseq_patches.names_plugin(cfg("acl_sentence_prediction", "sentence_prediction",
                                            "roberta"))  # fmt: skip
    assert fairseq_patches.names_plugin(cfg("sentence_prediction", "acl_embed", "roberta"))
    assert fairseq_patches.names_plugin(cfg("sentence_prediction", "sentence_prediction",
                                            "multi_exit_roberta_tiny"))  # fmt: skip
