"""Launches the tiny 2-worker run of test_distributed N times and counts the aborts at exit
("terminate called without an active exception"): the check of the plugin's teardown
(acl_fairseq/distributed.py). Not a test (minutes); run from the checkout:

    OMP_NUM_THREADS=1 python tests/distributed_exit_loop.py 30 [--backend legacy_ddp]
    OMP_NUM_THREADS=1 python tests/distributed_exit_loop.py 30 --held-save-dir

``--held-save-dir``: the error path instead. Another run holds each launch's --save-dir, so
both workers stop with fairseq-train's error after the process group is up (as in
test_save_dir_safety); a launch passes when both exit 1 with that error and none aborts.
"""

import argparse
import fcntl
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from acl_fairseq.checkpoint.run_lock import LOCK_FILE

from fairseq_helpers import LAUNCHER, TINY_ROBERTA, exact_train_args, make_dataset, train_command


def held(save_dir: Path) -> int:
    """Locks ``save_dir`` as another training would; returns the open file."""
    save_dir.mkdir(parents=True)
    fd = os.open(save_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def two_ranks(cmd: list[str], env: dict) -> list[subprocess.CompletedProcess]:
    """``cmd`` on 2 gloo workers started directly (the launcher would stop the other worker
    when one fails)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        rank_cmd = [str(c) for c in cmd]
        rank_cmd += ["--distributed-backend", "gloo", "--distributed-init-method",
                     f"tcp://127.0.0.1:{port}", "--distributed-world-size", "2",
                     "--distributed-rank", str(rank), "--distributed-no-spawn"]  # fmt: skip
        procs.append(subprocess.Popen(rank_cmd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))  # fmt: skip
    return [subprocess.CompletedProcess(p.args, p.wait(900), p.stdout.read()) for p in procs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("launches", type=int)
    p.add_argument("--backend", default="pytorch_ddp", help="--ddp-backend (default pytorch_ddp)")
    p.add_argument("--held-save-dir", action="store_true", help="the error path (see above)")
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_dataset(Path(tmp) / "data")
        args = [*exact_train_args(6, disable_validation=True), *TINY_ROBERTA]
        args += ["--criterion", "acl_embed", "--ddp-backend", a.backend]
        args += ["--find-unused-parameters"]
        aborts = failures = 0
        for i in range(a.launches):
            save_dir = Path(tmp) / f"run{i}"
            cmd = train_command(data, save_dir, *args)
            if a.held_save_dir:
                fd = held(save_dir)
                try:
                    procs = two_ranks(cmd, env)
                finally:
                    os.close(fd)
                codes = [proc.returncode for proc in procs]
                outs = [proc.stdout for proc in procs]
                failed = codes != [1, 1] or not all("is in use by another" in o for o in outs)
            else:
                proc = subprocess.run(["bash", str(LAUNCHER), "2", "--", *cmd],
                                      capture_output=True, text=True, env=env)  # fmt: skip
                codes, outs = [proc.returncode], [proc.stdout + proc.stderr]
                failed = proc.returncode != 0
            aborted = any("terminate called" in out for out in outs)
            aborts += aborted
            failures += failed
            print(f"launch {i + 1}: exit status {codes}{' ABORT' if aborted else ''}", flush=True)
    print(f"{a.launches} launches: {aborts} aborted at exit, {failures} not as expected")
    return int(failures > 0 or aborts > 0)


if __name__ == "__main__":
    sys.exit(main())
