"""benchmarks/gpu_check.py: its command lines, and its rehearsal on CPU (``--cpu``)."""

import re
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from fork_server import ForkServer

from benchmarks import gpu_check

from fairseq_helpers import REPO, TINY_ROBERTA, fairseq_train, train_args

SCRIPT = ["-m", "benchmarks.gpu_check"]  # run from the checkout (cwd=REPO)


def model_dir(root: Path, flags: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.pt").write_bytes(b"")
    (root / "fairseq_args.txt").write_text(flags + "\n")
    return root


def test_model_flags_make_the_converted_model_multi_exit(tmp_path):
    flags = "--arch roberta --encoder-layers 6 --restore-file x.pt --reset-optimizer --dropout 0.1"
    assert gpu_check.model_flags(model_dir(tmp_path, flags)) == [
        "--arch", "multi_exit_roberta", "--encoder-layers", "6", "--dropout", "0.1",
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="no --arch"):
        gpu_check.model_flags(model_dir(tmp_path / "b", "--encoder-layers 6"))
    with pytest.raises(SystemExit, match="needs model.pt and fairseq_args.txt"):
        gpu_check.model_flags(tmp_path / "missing")


def test_data_flags_count_the_labels_and_see_pairs(sentiment_data, tmp_path):
    assert gpu_check.data_flags(sentiment_data) == ["--num-classes", "2", "--init-token", "0"]
    pairs = tmp_path / "pairs"
    shutil.copytree(sentiment_data, pairs)
    (pairs / "input1").mkdir()
    assert gpu_check.data_flags(pairs)[-2:] == ["--separator-token", "2"]
    with pytest.raises(SystemExit, match="not a binarized sentence_prediction folder"):
        gpu_check.data_flags(tmp_path)


def test_two_ranks_share_the_batch_and_one_device(sentiment_data, tmp_path):
    a = Namespace(
        data=sentiment_data, model_dir=model_dir(tmp_path, " ".join(TINY_ROBERTA)),
        batch_size=32, updates=100, lr=2e-5, log_interval=10, cpu=False,
    )  # fmt: skip
    run = gpu_check.Run("fp16", 2, "ACL-CL")
    cmd = gpu_check.train_command(a, run, tmp_path / "save", tmp_path / "acl.pt")
    assert cmd[cmd.index("--batch-size") + 1] == "16" and "--fp16" in cmd
    assert cmd[cmd.index("--criterion") + 1] == "acl_cross_layer" and "--cpu" not in cmd
    assert cmd[cmd.index("--restore-file") + 1] == str(tmp_path / "acl.pt")
    assert cmd[cmd.index("--warmup-updates") + 1] == "6"
    flags = gpu_check.distributed_flags(1, 2, 1234)
    for flag, value in [
        ("--ddp-backend", "pytorch_ddp"), ("--distributed-backend", "gloo"),
        ("--distributed-rank", "1"), ("--distributed-world-size", "2"), ("--device-id", "0"),
    ]:  # fmt: skip
        assert flags[flags.index(flag) + 1] == value
    assert "--find-unused-parameters" in flags and gpu_check.distributed_flags(0, 1, 1) == []


def test_usage_errors(sentiment_data, tmp_path):
    m = model_dir(tmp_path, " ".join(TINY_ROBERTA))
    for args, message in [
        (["--methods", "acl_cl"], "acl_cl is restored from the acl run"),
        (["--precisions", "fp8"], "--precisions: choose from fp32, fp16, bf16"),
        (["--updates", "5", "--warmup", "5"], "--updates must exceed --warmup"),
    ]:
        cmd = [sys.executable, *SCRIPT, str(sentiment_data), str(m), "--cpu", *args]
        proc = subprocess.run(
            ForkServer.served(cmd),
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.slow
def test_cpu_rehearsal_of_every_precision_layout_and_fine_tune(sentiment_data, tmp_path):
    """The whole table on CPU: tiny RoBERTa "pretrained" for one update, 4 updates each."""
    pretrain = tmp_path / "pretrain"
    fairseq_train(
        sentiment_data, pretrain, *train_args(criterion="sentence_prediction", max_update=1),
        "--disable-validation",
    )  # fmt: skip
    m = model_dir(tmp_path / "model", " ".join(TINY_ROBERTA))
    shutil.copyfile(pretrain / "checkpoint_last.pt", m / "model.pt")
    out = tmp_path / "runs"
    cmd = [
        sys.executable,
        *SCRIPT,
        str(sentiment_data),
        str(m),
        "--cpu",
        "--updates",
        "4",
        "--warmup",
        "1",
        "--log-interval",
        "1",
        "--batch-size",
        "8",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        ForkServer.served(cmd),
        capture_output=True, text=True, timeout=1800, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| (fp32|fp16|bf16) \|", line)]
    seen = set()
    for row in rows:
        precision, ranks, method, examples, seconds, timed, peak = row.strip("| ").split(" | ")
        seen.add((precision, ranks, method))
        assert examples == "8" and timed == "3" and float(seconds) > 0 and float(peak) > 0
    assert seen == {
        (p, r, m) for p in ("fp32", "fp16", "bf16") for r in ("1", "2") for m in gpu_check.METHODS
    }
    for precision in ("fp32", "fp16", "bf16"):
        log = (out / f"{precision}-2rank-acl-cl" / "rank0.log").read_text()
        assert "training on 2 devices" in log
        assert f"{precision}-2rank-acl/checkpoint_last.pt" in log  # ACL-CL restored from ACL
        rank1 = (out / f"{precision}-2rank-acl-cl" / "rank1.log").read_text()
        assert "gpu_check report:" in rank1  # the second rank received the checkpoint
