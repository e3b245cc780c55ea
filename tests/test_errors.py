"""The plugin's set-up errors reach fairseq's command line as one line, ``fairseq-train: error:
MESSAGE``, without a traceback (``ACL_FAIRSEQ_TRACEBACK=1`` shows it); other exceptions keep
theirs. tests/test_save_dir_safety.py and tests/test_checkpoint_errors.py check the line of
each save-folder and checkpoint case."""

import os
import subprocess
import sys

import pytest

from acl_fairseq.errors import (
    TRACEBACK_ENV,
    AclFairseqError,
    AclFileNotFoundError,
    AclIsADirectoryError,
    AclRuntimeError,
    AclValueError,
    install_excepthook,
)

from fairseq_helpers import fails_with, train_args, trained_updates


def raise_in(prog: str, raising: str, traceback: bool = False) -> subprocess.CompletedProcess:
    """A Python process named ``prog`` that installs the hook, then runs ``raising``."""
    code = (
        "import sys; sys.argv[0] = sys.argv[1]\n"
        "from acl_fairseq import errors\n"
        "errors.install_excepthook()\n"
        f"{raising}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != TRACEBACK_ENV}
    if traceback:
        env[TRACEBACK_ENV] = "1"
    return subprocess.run(
        [sys.executable, "-c", code, prog], capture_output=True, text=True, env=env, timeout=300
    )


def test_a_plugin_error_is_one_line_in_a_fairseq_command():
    proc = raise_in("fairseq-train", "raise errors.AclValueError('--flag x: use y')")
    assert proc.returncode == 1
    assert proc.stderr == "fairseq-train: error: --flag x: use y\n"


def test_a_plugin_error_of_a_spawned_worker_is_one_line_too():
    """fairseq's multi-GPU launcher spawns a worker per GPU; torch raises the worker's error
    in the parent as a ProcessRaisedException that carries its traceback as text."""
    carried = (
        "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call "
        'last):\n  File "x.py", line 1, in <module>\n'
        "acl_fairseq.errors.AclRuntimeError: --save-dir ck is in use\n"
    )
    raising = (
        "from torch.multiprocessing.spawn import ProcessRaisedException\n"
        f"raise ProcessRaisedException({carried!r}, 1, 4242)"
    )
    proc = raise_in("fairseq-train", raising)
    assert proc.returncode == 1
    assert proc.stderr == "fairseq-train: error: --save-dir ck is in use\n"
    proc = raise_in("fairseq-train", raising.replace("acl_fairseq.errors.", ""))
    assert "Traceback" in proc.stderr  # not the plugin's: torch's report


def test_the_traceback_on_request_and_for_other_errors():
    proc = raise_in("fairseq-train", "raise errors.AclValueError('--flag x')", traceback=True)
    assert proc.returncode == 1 and proc.stderr.startswith("Traceback (most recent call last)")
    assert proc.stderr.rstrip().endswith("acl_fairseq.errors.AclValueError: --flag x")
    proc = raise_in("fairseq-validate", "raise KeyError('target')")
    assert "Traceback" in proc.stderr and proc.stderr.rstrip().endswith("KeyError: 'target'")


def test_elsewhere_nothing_changes():
    proc = raise_in("python", "raise errors.AclValueError('--flag x')")
    assert "Traceback" in proc.stderr
    assert not install_excepthook("acl-fairseq-predict")


@pytest.mark.parametrize(
    "kind,builtin",
    [
        (AclValueError, ValueError),
        (AclFileNotFoundError, FileNotFoundError),
        (AclIsADirectoryError, IsADirectoryError),
        (AclRuntimeError, RuntimeError),
    ],
)
def test_each_kind_is_also_the_builtin_error_it_replaces(kind, builtin):
    error = kind("--flag x: use y")
    assert isinstance(error, AclFairseqError) and isinstance(error, builtin)
    assert str(error) == "--flag x: use y"


TRAIN = train_args(criterion="acl_embed", max_update=2, no_epoch_checkpoints=True)


@pytest.mark.slow
def test_a_set_up_error_through_fairseq_train(sentiment_data, tmp_path, monkeypatch):
    """--acl-grad-log into a missing folder: before any update (fairseq would fail at the
    first one), as one line."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    log = tmp_path / "missing_dir" / "a.tsv"
    out = fails_with(sentiment_data, tmp_path / "ck", *TRAIN, "--acl-grad-log", str(log),
                     message="")  # fmt: skip
    assert out.rstrip().splitlines()[-1] == (
        f"fairseq-train: error: --acl-grad-log {log}: the folder {log.parent} does not exist; "
        f"create it first (mkdir -p {log.parent}) or give a file in an existing folder"
    )
    assert "Traceback" not in out and not trained_updates(out)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    out = fails_with(sentiment_data, tmp_path / "ck", *TRAIN, "--acl-grad-log", str(log),
                     message="Traceback (most recent call last)")  # fmt: skip
    assert f"acl_fairseq.errors.AclFileNotFoundError: --acl-grad-log {log}: the folder" in out


@pytest.mark.slow
def test_ce_scl_at_batch_size_1_through_fairseq_train(sentiment_data, tmp_path):
    args = train_args(criterion="ce_scl", batch_size=1, max_update=2)
    out = fails_with(sentiment_data, tmp_path, *args, message="")
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("fairseq-train: error: --criterion ce_scl with --batch-size 1: SCL")
    assert not trained_updates(out)
