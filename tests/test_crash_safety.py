"""kill -9 at many moments of a tiny training, during updates and during every step of its
saves, then the same command again: every resume succeeds, loses at most the updates since the
last completed save, and ends with the same model as a run that was never killed.

The kills come from tests/patched_fairseq_train.py (``kill_at``), which hooks ``torch.save``,
``shutil.copyfile``, ``os.rename`` / ``os.replace`` and the trainer's update: the same moments
exist in fairseq's own saving code and in the plugin's (acl_fairseq/checkpoint/atomic_files.py).
Stock fairseq copies ``checkpoint_last.pt`` in place, so a kill during that copy left a
truncated file that no resume could read.

The run: 14 updates, 12 per epoch, a checkpoint every 5 updates (``--keep-interval-updates
1``), the end of epoch 1, and the final save; ``checkpoint_best.pt`` by dev accuracy.
"""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from fork_server import ForkServer

from acl_fairseq.checkpoint.atomic_files import leftovers
from acl_fairseq.checkpoint.run_lock import LOCK_FILE

from fairseq_helpers import (
    PATCHED_TRAIN,
    REPO,
    fairseq_train,
    train_args,
    train_command,
    trained_updates,
)

MAX_UPDATE = 14
ARGS = train_args(
    criterion="acl_embed",
    batch_size=32,
    max_update=MAX_UPDATE,
    save_interval_updates=5,
    keep_interval_updates=1,
    best_checkpoint_metric="accuracy",
    maximize_best_checkpoint_metric=True,
)
# (ACL_TEST_KILL_AT, the moment in words)
MOMENTS = [
    ("update:*:3", "training update 3 (nothing saved yet)"),
    ("save:*:1", "writing checkpoint_1_5.pt (1st save, update 5)"),
    ("copy:checkpoint_best.pt:1", "copying to checkpoint_best.pt (update 5)"),
    ("copy:checkpoint_last.pt:1", "copying to checkpoint_last.pt (update 5)"),
    ("update:*:8", "training update 8"),
    ("replace:checkpoint_1_10.pt:1", "checkpoint_1_10.pt written, before its rename"),
    ("copy:checkpoint_last.pt:2", "copying to checkpoint_last.pt (update 10)"),
    ("save:checkpoint1.pt:1", "writing checkpoint1.pt (end of epoch 1, update 12)"),
    ("replace:checkpoint_last.pt:3", "checkpoint_last.pt copied (update 12), before its rename"),
    ("save:*:4", "writing the final checkpoint (update 14)"),
]
SAVED = re.compile(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates")
LOADED = re.compile(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)")


def killed_run(data, save_dir, moment: str) -> str:
    """The training, killed at ``moment``; its output."""
    cmd = [sys.executable, str(PATCHED_TRAIN), *train_command(data, save_dir, *ARGS)[1:]]
    env = {"OMP_NUM_THREADS": "1", "ACL_TEST_PATCHES": "kill_at", "ACL_TEST_KILL_AT": moment}
    env = {**os.environ, **env}
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    proc = subprocess.run(ForkServer.served(cmd), capture_output=True, text=True, env=env,
                          timeout=900, cwd=REPO)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGKILL, f"{moment}: not killed\n{out[-3000:]}"
    return out


def model_of(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.fixture(scope="module")
def never_killed(sentiment_data, tmp_path_factory) -> dict:
    """The model of the same training never killed."""
    reference = tmp_path_factory.mktemp("reference")
    out = fairseq_train(sentiment_data, reference, *ARGS)
    assert trained_updates(out)[-1] == MAX_UPDATE
    return model_of(reference / "checkpoint_last.pt")


# with the fork server off (CI's second leg) three moments stand for all: an update, a copy
# to checkpoint_last.pt, a written file before its rename
SERVER_OFF = ("update:*:8", "copy:checkpoint_last.pt:2", "replace:checkpoint_last.pt:3")


@pytest.mark.slow
@pytest.mark.parametrize(
    "moment,words",
    [pytest.param(m, w, marks=pytest.mark.server_off) if m in SERVER_OFF else (m, w)
     for m, w in MOMENTS],
    ids=[m for m, _ in MOMENTS],
)  # fmt: skip
def test_kill_9_then_resume(sentiment_data, tmp_path, never_killed, moment, words):
    """Killed at ``moment`` (``words``), then the same command: it resumes, loses at most the
    updates since the last completed save, reports the stale lock, removes and names the
    leftovers, and ends with the model of the run never killed."""
    save_dir = tmp_path / "kill"
    out = killed_run(sentiment_data, save_dir, moment)
    done = max(trained_updates(out), default=0)
    last_saved = max((int(u) for u in SAVED.findall(out)), default=0)
    left = [p.rsplit("/", 1)[-1] for p in leftovers(str(save_dir))]
    resumed = fairseq_train(sentiment_data, save_dir, *ARGS)  # fails the test if it fails
    loaded = LOADED.findall(resumed)
    start = int(loaded[0]) if loaded else 0
    lost = done - start
    print(f"| {words} | {f'yes, from update {start}' if start else 'yes, from the start'} "
          f"| {lost} |")  # fmt: skip
    problems = []
    if lost > done - last_saved:
        problems.append(f"lost {lost} updates, {done - last_saved} since the last save")
    if trained_updates(resumed)[-1] != MAX_UPDATE:
        problems.append("did not train to the end")
    if "ended without releasing it" not in resumed:  # the killed run's lock, taken over
        problems.append("the stale lock was not reported")
    if left and not all(f"removed {save_dir / name}" in resumed for name in left):
        problems.append(f"leftovers {left} not removed and named")
    if leftovers(str(save_dir)) or (save_dir / LOCK_FILE).exists():
        problems.append("a .tmp file or the lock file is left")
    final = model_of(save_dir / "checkpoint_last.pt")
    if final.keys() != never_killed.keys() or any(
        not torch.equal(final[k], never_killed[k]) for k in final
    ):
        problems.append("another model than the run never killed")
    assert not problems, f"{moment} ({words}): {'; '.join(problems)}"
