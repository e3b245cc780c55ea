"""Launches the tiny 2-worker run of test_distributed N times and counts the aborts at exit
("terminate called without an active exception"): the check of the plugin's teardown
(acl_fairseq/distributed.py). Not a test (minutes); run from the checkout:

    OMP_NUM_THREADS=1 python tests/distributed_exit_loop.py 30 [--backend legacy_ddp]
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fairseq_helpers import LAUNCHER, TINY_ROBERTA, exact_train_args, make_dataset, train_command


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("launches", type=int)
    p.add_argument("--backend", default="pytorch_ddp", help="--ddp-backend (default pytorch_ddp)")
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_dataset(Path(tmp) / "data")
        args = [*exact_train_args(6, disable_validation=True), *TINY_ROBERTA]
        args += ["--criterion", "acl_embed", "--ddp-backend", a.backend]
        args += ["--find-unused-parameters"]
        aborts = failures = 0
        for i in range(a.launches):
            cmd = train_command(data, Path(tmp) / f"run{i}", *args)
            proc = subprocess.run(
                ["bash", str(LAUNCHER), "2", "--", *cmd], capture_output=True, text=True, env=env
            )
            aborted = "terminate called" in proc.stdout + proc.stderr
            aborts += aborted
            failures += proc.returncode != 0
            print(f"launch {i + 1}: exit status {proc.returncode}{' ABORT' if aborted else ''}")
    print(f"{a.launches} launches: {aborts} aborted at exit, {failures} failed")
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
