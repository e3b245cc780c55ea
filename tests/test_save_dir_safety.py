"""A ``--save-dir`` is one run's, whole and current: one training at a time holds it, a run of
other settings (``--seed`` too) is not resumed, a finished run is not trained again, checkpoint
files appear whole, and a damaged ``checkpoint_last.pt`` names the checkpoint to resume from.

tests/test_crash_safety.py kills trainings at every step of their saves.
"""

import fcntl
import json
import logging
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from fairseq import checkpoint_utils, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.file_io import PathManager
from fork_server import ForkServer

import acl_fairseq  # noqa: F401  (installs the checks and the atomic files)
from acl_fairseq.checkpoint import atomic_files
from acl_fairseq.checkpoint.resume import Saved, changed_settings, finished
from acl_fairseq.checkpoint.run_lock import LOCK_FILE, SaveDirInUse, acquire

from fairseq_helpers import (
    fails_with,
    fairseq_train,
    fairseq_train_workers,
    rank_output,
    train_args,
    train_command,
    trained_updates,
)

ARGS = train_args(criterion="acl_embed", max_update=2, no_epoch_checkpoints=True)


# ------------------------------------------------------------------ 1. one run per --save-dir
def hold(save_dir, pid: int = 4242, command: str = "fairseq-train DATA --seed 1") -> int:
    """Locks ``save_dir`` as another training would (another open file); returns its fd."""
    save_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(save_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    record = {"pid": pid, "host": "gpu7", "started": "2026-12-01T10:00:00", "command": command}
    os.write(fd, json.dumps(record).encode())
    return fd


def test_a_held_save_dir_is_refused_naming_its_holder(tmp_path):
    fd = hold(tmp_path)
    with pytest.raises(SaveDirInUse) as info:
        acquire(str(tmp_path))
    assert str(info.value) == (
        f"--save-dir {tmp_path} is in use by another training (pid 4242 on gpu7, started "
        "2026-12-01T10:00:00: fairseq-train DATA --seed 1). Two trainings in one --save-dir "
        "overwrite each other's checkpoints: wait for that one to end, or pass another --save-dir"
    )
    os.close(fd)  # the holder ends (killed: its record stays)
    lock = acquire(str(tmp_path))
    assert lock.taken_over.pid == 4242
    lock.release()


def test_the_lock_records_this_run_and_goes_away_when_released(tmp_path):
    lock = acquire(str(tmp_path / "new"))
    assert acquire(str(tmp_path / "new")) is lock  # this process holds it already
    record = json.loads((tmp_path / "new" / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["command"] and record["host"]
    lock.release()
    assert not (tmp_path / "new" / LOCK_FILE).exists()
    lock.release()  # idempotent


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    (tmp_path / LOCK_FILE).write_text(
        json.dumps(
            {
                "pid": 999999,
                "host": "gpu7",
                "started": "2026-12-01T10:00:00",
                "command": "fairseq-train DATA",
            }
        )  # fmt: skip
    )  # a record, but nobody holds the lock: its process was killed
    with caplog.at_level(logging.WARNING, logger="acl_fairseq.checkpoint.run_lock"):
        lock = acquire(str(tmp_path))
    assert lock.taken_over.pid == 999999
    assert (
        f"{tmp_path / LOCK_FILE}: the training that held --save-dir {tmp_path} (pid 999999 on "
        "gpu7, started 2026-12-01T10:00:00: fairseq-train DATA) ended without releasing it "
        "(killed?); this run takes the folder over" in caplog.text
    )
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def wait_for_lock(save_dir, proc, log, timeout: float = 600) -> dict:
    """The lock record of the training ``proc`` (writing to ``log``) once it holds
    ``save_dir``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            record = json.loads((save_dir / LOCK_FILE).read_text())
            if record["pid"] == proc.pid:
                return record
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError("the training never took the lock")


@pytest.mark.slow
def test_two_trainings_in_one_save_dir(sentiment_data, tmp_path):
    """Seeds 1 and 2 started together: the second stops at once naming the first; killed, the
    first leaves a stale lock that the next run takes over."""
    save_dir = tmp_path / "ck"
    # the first: long, and writing nothing, so that the run after its kill starts afresh
    first_args = [*train_args(criterion="acl_embed", max_update=100000), "--no-last-checkpoints",
                  "--no-epoch-checkpoints", "--disable-validation"]  # fmt: skip
    cmd = [str(c) for c in train_command(sentiment_data, save_dir, *first_args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "first.log"
    with open(log, "w") as sink:
        first = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)  # fmt: skip
    try:
        record = wait_for_lock(save_dir, first, log)
        second = [*train_args(criterion="acl_embed", seed=2, max_update=2)]
        out = fails_with(sentiment_data, save_dir, *second, message="")
        assert out.rstrip().splitlines()[-1] == (
            f"fairseq-train: error: --save-dir {save_dir} is in use by another training (pid "
            f"{first.pid} on {record['host']}, started {record['started']}: "
            f"{record['command']}). Two trainings in one --save-dir overwrite each other's "
            "checkpoints: wait for that one to end, or pass another --save-dir"
        )
        assert not trained_updates(out) and "Traceback" not in out
        assert first.poll() is None  # the first trains on
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # kill -9
        first.wait()
    out = fairseq_train(sentiment_data, save_dir, *train_args(criterion="acl_embed", max_update=2))
    assert f"(pid {first.pid} on {record['host']}" in out and "ended without releasing it" in out
    assert trained_updates(out)[-1] == 2
    assert not (save_dir / LOCK_FILE).exists()  # released at the end


def ranks(n: int, data, save_dir, *args: str, log_dir) -> list[tuple[int, str]]:
    """``fairseq-train`` on ``n`` gloo workers started directly (no launcher, which would stop
    the others when one fails): each rank's exit status and output."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(n):
        cmd = [str(c) for c in train_command(data, save_dir, *args)]
        cmd += ["--distributed-backend", "gloo", "--distributed-init-method",
                f"tcp://127.0.0.1:{port}", "--distributed-world-size", str(n),
                "--distributed-rank", str(rank), "--distributed-no-spawn"]  # fmt: skip
        with open(log_dir / f"rank{rank}.log", "w") as sink:
            procs.append(subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env))
    codes = [proc.wait(timeout=900) for proc in procs]
    return [(code, (log_dir / f"rank{r}.log").read_text()) for r, code in enumerate(codes)]


@pytest.mark.slow
def test_data_parallel_workers_share_one_lock(sentiment_data, tmp_path):
    """2 gloo workers: rank 0 takes the lock and every rank stops with its message (none waits
    in a collective); a run that holds it trains on both ranks; --no-save neither takes nor
    needs it."""
    args = [*ARGS, "--ddp-backend", "legacy_ddp"]
    fd = hold(tmp_path / "held")
    try:
        line = f"fairseq-train: error: --save-dir {tmp_path / 'held'} is in use by another "
        outs = ranks(2, sentiment_data, tmp_path / "held", *args, log_dir=tmp_path)
        for rank, (code, out) in enumerate(outs):  # torch prefixes a rank's uncaught error
            last = out.rstrip().splitlines()[-1]
            assert code == 1 and last.startswith(f"[rank{rank}]: {line}"), out[-3000:]
            assert not trained_updates(out)
        out = fairseq_train(sentiment_data, tmp_path / "held", *ARGS, "--no-save")
        assert trained_updates(out)[-1] == 2
    finally:
        os.close(fd)
    out = fairseq_train_workers(2, sentiment_data, tmp_path / "free", *args)
    assert "training on 2 devices" in rank_output(out, 0)
    assert trained_updates(rank_output(out, 0))[-1] == 2
    assert (tmp_path / "free" / "checkpoint_last.pt").is_file()
    assert not (tmp_path / "free" / LOCK_FILE).exists()


# ------------------------------------------------------------------ 2. another run, a finished run
def config(*flags: str):
    parsed = options.parse_args_and_arch(
        options.get_training_parser(),
        ["DATA", "--task", "acl_sentence_prediction", "--num-classes", "2", "--arch",
         "roberta", "--criterion", "acl_embed", "--optimizer", "adam", "--lr", "1e-3",
         "--batch-size", "16", "--seed", "1", *flags],
    )  # fmt: skip
    return convert_namespace_to_omegaconf(parsed)


@pytest.mark.parametrize(
    "flags,change",
    [
        (["--seed", "3"], "--seed 1 -> 3"),
        (["--batch-size", "32"], "--batch-size 16 -> 32"),
        (["--update-freq", "2"], "--update-freq [1] -> [2]"),
        (["--dropout", "0.2"], "--dropout 0.1 -> 0.2"),
        (["--weight-decay", "0.1"], "--weight-decay 0.0 -> 0.1"),
        (["--clip-norm", "1"], "--clip-norm 0.0 -> 1.0"),
        (["--temperature", "0.1"], "--temperature 0.3 -> 0.1"),
        (["--max-positions", "128"], "--max-positions 512 -> 128"),
        (["--group-by-length"], "--group-by-length False -> True"),
        (["--distributed-world-size", "2"], "--distributed-world-size 1 -> 2"),
        (
            ["--lr-scheduler", "polynomial_decay", "--total-num-update", "100"],
            "--lr-scheduler fixed -> polynomial_decay",
        ),
        (["--warmup-updates", "10"], "--warmup-updates 0 -> 10"),
    ],
)
def test_flags_that_change_the_run_are_compared(flags, change):
    assert change in changed_settings(config(), config(*flags))


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-update", "500"],  # training longer is resuming
        ["--max-epoch", "3"],
        ["--log-interval", "7", "--log-format", "json"],
        ["--num-workers", "3"],
        ["--save-interval-updates", "50", "--keep-interval-updates", "2"],
        ["--validate-interval-updates", "10", "--batch-size-valid", "64"],
        ["--distributed-port", "12345", "--distributed-rank", "1", "--device-id", "1"],
        ["--acl-grad-log", "angles.tsv"],
        ["--tensorboard-logdir", "runs", "--cpu"],
    ],
)
def test_flags_that_do_not_change_the_run_are_not(flags):
    assert changed_settings(config(), config(*flags)) == []


def saved(num_updates: int, epoch: int, iterations_in_epoch: int) -> Saved:
    return Saved("ck/checkpoint_last.pt", None, num_updates, epoch, iterations_in_epoch)


def test_finished_runs():
    assert finished(saved(200, 3, 10), config("--max-update", "200")) == (
        "update 200 of --max-update 200"
    )
    assert finished(saved(200, 3, 10), config("--max-update", "300")) is None
    assert finished(saved(72, 4, 0), config("--max-epoch", "3")) == (
        "epoch 3 of --max-epoch 3, 72 updates"
    )
    assert finished(saved(60, 3, 12), config("--max-epoch", "3")) is None  # mid-epoch 3
    assert finished(saved(72, 4, 0), config("--max-epoch", "4")) is None
    assert finished(saved(72, 4, 0), config("--max-epoch", "3"), reset_dataloader=True) is None


def files(save_dir) -> dict:
    """Every file of ``save_dir``: its bytes and modification time."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(save_dir.iterdir())}


@pytest.mark.slow
def test_another_seed_is_refused_and_a_finished_run_changes_nothing(sentiment_data, tmp_path):
    save_dir = tmp_path / "ck"
    fairseq_train(sentiment_data, save_dir, *ARGS)  # seed 1, 2 updates
    before = files(save_dir)
    last = save_dir / "checkpoint_last.pt"
    out = fails_with(sentiment_data, save_dir, *ARGS, "--seed", "3", message="")
    assert out.rstrip().splitlines()[-1] == (
        f"fairseq-train: error: --save-dir {save_dir} holds {last}, saved by an earlier run "
        "with other settings (--seed 1 -> 3), and the default --restore-file would resume that "
        f"run: its optimizer state and updates, not the run asked for. Pass --restore-file "
        f"{last} to resume it anyway, --reset-optimizer to start a new optimization from its "
        "weights, or another --save-dir to start afresh"
    )
    out = fairseq_train(sentiment_data, save_dir, *ARGS)  # the same command again
    assert (
        f"{last} is a finished run (update 2 of --max-update 2): nothing to train, nothing in "
        f"--save-dir {save_dir} is changed. To train it further, raise --max-update / "
        "--max-epoch; for a new run, pass another --save-dir"
    ) in [line for line in out.splitlines() if " | INFO | " in line][-1]  # fairseq's last
    assert not trained_updates(out)
    assert files(save_dir) == before  # no checkpoint rewritten, no lock left
    out = fairseq_train(sentiment_data, save_dir, *ARGS, "--max-update", "3")
    assert trained_updates(out) == [3]  # a larger --max-update trains on


@pytest.mark.slow
def test_a_run_finished_by_max_epoch_says_so(sentiment_data, tmp_path):
    args = [*train_args(criterion="acl_embed", batch_size=128), "--max-epoch", "1"]
    fairseq_train(sentiment_data, tmp_path, *args)
    before = files(tmp_path)
    out = fairseq_train(sentiment_data, tmp_path, *args)
    assert "is a finished run (epoch 1 of --max-epoch 1, 3 updates)" in out
    assert files(tmp_path) == before


# ------------------------------------------------------------------ 3. whole checkpoint files
def test_an_interrupted_copy_leaves_the_old_file(tmp_path, monkeypatch, plugin_run):
    src, dst = tmp_path / "checkpoint_1_4.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old")

    def copy_half_then_fail(a, b, *args, **kwargs):
        with open(a, "rb") as f, open(b, "wb") as out:
            out.write(f.read()[:100])
        raise OSError("disk full")

    monkeypatch.setattr("shutil.copyfile", copy_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        PathManager.copy(str(src), str(dst), overwrite=True)  # fairseq's copy, patched
    assert dst.read_bytes() == b"old" and atomic_files.leftovers(str(tmp_path)) == []
    monkeypatch.undo()
    assert PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == src.read_bytes() and sorted(os.listdir(tmp_path)) == [
        "checkpoint_1_4.pt", "checkpoint_last.pt"
    ]  # fmt: skip


def test_an_interrupted_torch_save_leaves_the_old_file(tmp_path, monkeypatch, plugin_run):
    path = tmp_path / "checkpoint_last.pt"
    checkpoint_utils.torch_persistent_save({"model": {"w": torch.zeros(3)}}, str(path))
    before = path.read_bytes()

    def save_part_then_fail(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 part of a checkpoint")
        raise RuntimeError("killed")

    monkeypatch.setattr(torch, "save", save_part_then_fail)
    with pytest.raises(RuntimeError, match="killed"):
        checkpoint_utils.torch_persistent_save({"model": {"w": torch.ones(3)}}, str(path))
    assert path.read_bytes() == before and atomic_files.leftovers(str(tmp_path)) == []


def test_leftovers_are_the_temporary_checkpoint_files(tmp_path):
    for name in ("checkpoint_last.pt.tmp", "checkpoint_1_5.pt.tmp", "checkpoint_last.pt",
                 "notes.tmp"):  # fmt: skip
        (tmp_path / name).write_bytes(b"x")
    expected = [str(tmp_path / "checkpoint_1_5.pt.tmp"), str(tmp_path / "checkpoint_last.pt.tmp")]
    assert atomic_files.remove_leftovers(str(tmp_path)) == expected
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_last.pt", "notes.tmp"]


@pytest.mark.slow
def test_a_damaged_checkpoint_last_names_the_checkpoint_to_resume_from(sentiment_data, tmp_path):
    args = [*ARGS, "--save-interval-updates", "1", "--keep-interval-updates", "2"]
    fairseq_train(sentiment_data, tmp_path, *args)
    last, newest = tmp_path / "checkpoint_last.pt", tmp_path / "checkpoint_1_2.pt"
    last.write_bytes(b"")  # as stock fairseq's copy left it when killed
    (tmp_path / "checkpoint_best.pt.tmp").write_bytes(b"PK\x03\x04")  # a torch.save killed
    more = [*args, "--max-update", "3"]
    out = fails_with(sentiment_data, tmp_path, *more, message="")
    assert out.rstrip().splitlines()[-1] == (
        f"fairseq-train: error: {last} is empty (0 bytes), so this run cannot resume from it; "
        f"the newest intact checkpoint of this run there is {newest} (epoch 1 @ 2 updates): "
        f"resume from it with --restore-file {newest}"
    )
    assert f"removed {tmp_path / 'checkpoint_best.pt.tmp'}: an incomplete file left by an " in out
    out = fairseq_train(sentiment_data, tmp_path, *more, "--restore-file", str(newest))
    assert f"Loaded checkpoint {newest} (epoch 1 @ 2 updates)" in out
    assert trained_updates(out) == [3]


def test_no_checkpoint_to_resume_from(tmp_path):
    from acl_fairseq.checkpoint.save_dir import check_save_dir

    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    cfg = SimpleNamespace(save_dir=str(tmp_path), restore_file="checkpoint_last.pt",
                          no_save=True, reset_optimizer=False, reset_dataloader=False)  # fmt: skip
    with pytest.raises(ValueError) as info:
        check_save_dir(cfg, config())
    assert str(info.value) == (
        f"{tmp_path / 'checkpoint_last.pt'} is empty (0 bytes), so this run cannot resume from "
        "it; there is no intact checkpoint of this run beside it: remove it to start afresh (or "
        "pass another --save-dir)"
    )


def checkpoint_of(path, run_cfg, num_updates: int, iterations_in_epoch: int) -> None:
    """A checkpoint file as fairseq-train saves one (no weights) of the run ``run_cfg``."""
    from omegaconf import OmegaConf

    torch.save(
        {"cfg": OmegaConf.to_container(run_cfg, resolve=True, enum_to_str=True),
         "optimizer_history": [{"num_updates": num_updates}],
         "extra_state": {"train_iterator": {"epoch": 1,
                                            "iterations_in_epoch": iterations_in_epoch}}},
        path,
    )  # fmt: skip


def save_dir_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "acl_fairseq.checkpoint.save_dir"]


def checkpoint_cfg(save_dir) -> SimpleNamespace:
    return SimpleNamespace(save_dir=str(save_dir), restore_file="checkpoint_last.pt",
                           no_save=True, reset_optimizer=False, reset_dataloader=False)  # fmt: skip


def test_no_checkpoint_last_beside_a_checkpoint_of_this_run_is_named(tmp_path, caplog):
    """A kill during the first save's copy to checkpoint_last.pt: the run starts afresh, and
    says which checkpoint of this run it could resume from instead (another seed's: not)."""
    from acl_fairseq.checkpoint.save_dir import check_save_dir

    run = config("--max-update", "10")
    checkpoint_of(tmp_path / "checkpoint_1_2.pt", run, 2, 2)
    checkpoint_of(tmp_path / "checkpoint_1_4.pt", config("--max-update", "10", "--seed", "2"), 4, 4)
    with caplog.at_level(logging.WARNING, logger="acl_fairseq.checkpoint.save_dir"):
        assert check_save_dir(checkpoint_cfg(tmp_path), run) is None
    newest = tmp_path / "checkpoint_1_2.pt"
    assert save_dir_warnings(caplog) == [
        f"--save-dir {tmp_path} holds {newest} (epoch 1 @ 2 updates) of this run but no "
        "checkpoint_last.pt (its first save was interrupted?): this run starts from the "
        f"beginning. To resume instead, pass --restore-file {newest}"
    ]


def test_a_checkpoint_newer_than_checkpoint_last_is_named(tmp_path, caplog):
    """A kill after a save wrote its first file but before checkpoint_last.pt was replaced:
    the run resumes from checkpoint_last.pt, and names the newer one."""
    from acl_fairseq.checkpoint.save_dir import check_save_dir

    run = config("--max-update", "10")
    last, newer = tmp_path / "checkpoint_last.pt", tmp_path / "checkpoint1.pt"
    checkpoint_of(last, run, 2, 2)
    checkpoint_of(newer, run, 3, 3)
    os.utime(last, (1_000_000, 1_000_000))  # older than checkpoint1.pt
    with caplog.at_level(logging.WARNING, logger="acl_fairseq.checkpoint.save_dir"):
        assert check_save_dir(checkpoint_cfg(tmp_path), run) is None
    assert save_dir_warnings(caplog) == [
        f"{newer} (epoch 1 @ 3 updates) is newer than {last} (epoch 1 @ 2 updates): a save was "
        f"interrupted after writing it. This run resumes from {last}; to resume from the newer "
        f"one instead, pass --restore-file {newer}"
    ]
    caplog.clear()
    os.utime(newer, (1_000, 1_000))  # an older checkpoint1.pt: nothing to say
    with caplog.at_level(logging.WARNING, logger="acl_fairseq.checkpoint.save_dir"):
        assert check_save_dir(checkpoint_cfg(tmp_path), run) is None
    assert save_dir_warnings(caplog) == []


# ------------------------------------------------------------- writes the disk refuses
@pytest.mark.slow
def test_an_unwritable_save_dir_is_one_line(sentiment_data, tmp_path):
    """fairseq-train's first write into --save-dir (its ``dummy`` file) failed with an OSError
    traceback; now one line names the folder, the reason and the fix."""
    save_dir = "/sys/acl_fairseq_save"  # nobody may create a folder there, root included
    out = fails_with(sentiment_data, save_dir, *ARGS, message="fairseq-train: error: --save-dir")
    (line,) = [x for x in out.splitlines() if "error:" in x]
    assert line.startswith(f"fairseq-train: error: --save-dir {save_dir}: cannot write there (")
    assert line.endswith("): give --save-dir a folder this run may write to")
    assert "Traceback" not in out


def test_a_read_only_save_dir_is_named(tmp_path, monkeypatch):
    """The same for a read-only file system (EROFS), in process: the guard rail's message."""
    import errno

    from acl_fairseq import fairseq_patches

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(fairseq_patches, "_in_use", {"test"})
    monkeypatch.setattr(checkpoint_utils, "open", read_only, raising=False)
    with pytest.raises(OSError) as info:
        checkpoint_utils.verify_checkpoint_directory(str(tmp_path))
    assert str(info.value) == (
        f"--save-dir {tmp_path}: cannot write there (the file system is read-only): give "
        "--save-dir a folder this run may write to"
    )
    monkeypatch.setattr(fairseq_patches, "_in_use", set())  # a stock run: fairseq's traceback
    with pytest.raises(OSError, match="Read-only file system"):
        checkpoint_utils.verify_checkpoint_directory(str(tmp_path))


@pytest.mark.slow
def test_a_full_disk_while_saving_names_the_disk_and_the_intact_checkpoint(
    sentiment_data, tmp_path
):
    """Resumed under a file-size limit smaller than a checkpoint (a full disk's ENOSPC takes
    the same path): the save fails, and instead of torch's ``[enforce fail at
    inline_container.cc] unexpected pos`` traceback one line names the file, the limit and
    the checkpoint left intact, which a later run resumes from."""
    import resource

    fairseq_train(sentiment_data, tmp_path, *ARGS)
    last = tmp_path / "checkpoint_last.pt"
    before = last.read_bytes()
    limit = len(before) // 2
    longer = [*ARGS, "--max-update", "4"]  # the same run, two updates more
    cmd = train_command(sentiment_data, tmp_path, *longer)

    def limited() -> None:  # SIGXFSZ is ignored by Python: the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    proc = subprocess.run(ForkServer.served(cmd), capture_output=True, text=True, env=env,
                          timeout=600, preexec_fn=limited)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "unexpected pos" not in out
    (line,) = [x for x in out.splitlines() if "error:" in x]
    assert line == (
        f"fairseq-train: error: cannot write {last}: the file-size limit of this process is "
        f"reached (ulimit -f); {last} is as it was (the previous file, intact): raise the limit "
        "(ulimit -f unlimited) and run again"
    )
    assert last.read_bytes() == before and not list(tmp_path.glob("*.tmp"))
    assert trained_updates(fairseq_train(sentiment_data, tmp_path, *longer))[-1] == 4
