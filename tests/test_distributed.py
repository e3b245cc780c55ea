"""Data-parallel training on CPU (scripts/launch_cpu_workers.sh) equals gradient accumulation.

2 workers x ``--batch-size B`` and 1 worker x ``--batch-size B --update-freq 2`` see the same
examples in every update: fairseq shuffles the *batches* of an epoch with ``seed + epoch``
(the same on every worker), then ``ShardedIterator`` gives worker r the batches r, r+2, ...,
while ``GroupedIterator`` gives the single worker the batches 2u, 2u+1 for update u. The
batches themselves do not depend on the number of workers (``--batch-size`` fixed,
``--required-batch-size-multiple 1``, 384 examples = 48 full batches of 8). With dropout 0
the two runs then compute the same gradient up to float rounding, and ACL-Grad, which decides
once per update on the all-reduced gradients, takes the same decisions on every worker.
"""

import subprocess
import sys

import pytest
import torch

from acl_fairseq.acl_grad import read_angle_log

from fairseq_helpers import (
    LAUNCHER,
    TINY_ROBERTA,
    fairseq_train,
    fairseq_train_workers,
    json_records,
    rank_output,
    train_args,
)

UPDATES = 6
COMMON = train_args(
    [],
    batch_size=8,
    seed=3,
    required_batch_size_multiple=1,
    max_update=UPDATES,
    dropout=0,
    attention_dropout=0,
    pooler_dropout=0,
    disable_validation=True,
    no_epoch_checkpoints=True,
)
MULTI_EXIT = ["--arch", "multi_exit_roberta_tiny", "--encoder-layers", "3", "--max-positions", "64"]

CASES = {
    "acl_embed": [*TINY_ROBERTA, "--criterion", "acl_embed"],
    "ce_scl": [*TINY_ROBERTA, "--criterion", "ce_scl"],
    "ce_scl_acl_grad": [*TINY_ROBERTA, "--criterion", "ce_scl", "--acl-grad"],
    "acl_cross_layer": [*MULTI_EXIT, "--criterion", "acl_cross_layer"],
}
LOGGED = ("loss", "ce_loss", "contrastive_loss", "accuracy", "acl_grad_angle", "acl_grad_drop")


def train_inner(output: str) -> list[dict]:
    return [r for r in json_records(output) if "num_updates" in r and "epoch" in r]


def read_angles(path) -> list[tuple[int, float, int]]:
    return [(r.update, r.angle, int(r.kept)) for r in read_angle_log(path)]


def model_state(path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_equal_update_freq_two(sentiment_data, tmp_path, case):
    args = [*COMMON, *CASES[case]]
    acl_grad = case != "ce_scl"
    one, two = tmp_path / "one", tmp_path / "two"
    out1 = fairseq_train(
        sentiment_data,
        one,
        *args,
        "--update-freq",
        "2",
        "--acl-grad-log",
        str(one / "angles.{rank}.tsv"),
    )
    out2 = fairseq_train_workers(
        2, sentiment_data, two, *args, "--acl-grad-log", str(two / "angles.{rank}.tsv")
    )
    rank0 = rank_output(out2, 0)
    assert "training on 2 devices" in rank0
    assert "training on 1 devices" in out1

    # same parameters after the same updates
    s1, s2 = model_state(one / "checkpoint_last.pt"), model_state(two / "checkpoint_last.pt")
    assert s1.keys() == s2.keys()
    diff = max((s1[k].double() - s2[k].double()).abs().max().item() for k in s1)
    print(f"{case}: largest parameter difference 1 vs 2 workers = {diff:.3g}")
    for k in s1:
        torch.testing.assert_close(s2[k], s1[k], rtol=1e-4, atol=1e-5, msg=k)

    # the same per-update statistics (rank 0 logs the all-reduced values)
    r1, r2 = train_inner(out1), train_inner(rank0)
    assert [int(r["num_updates"]) for r in r1] == list(range(1, UPDATES + 1))
    assert [int(r["num_updates"]) for r in r2] == list(range(1, UPDATES + 1))
    assert all(float(r["bsz"]) == 16 for r in r1 + r2)  # 2 x 8 examples per update
    for a, b in zip(r1, r2):
        assert a.keys() == b.keys()
        for key in LOGGED:
            if key in a:
                assert float(b[key]) == pytest.approx(float(a[key]), abs=2e-3), key

    # ACL-Grad: one decision per update, the same on every worker and as with --update-freq
    logs = sorted(p.name for p in two.glob("angles.*.tsv"))
    if not acl_grad:
        assert logs == [] and "acl_grad_angle" not in r2[-1]
        return
    assert logs == ["angles.0.tsv", "angles.1.tsv"]
    single = read_angles(one / "angles.0.tsv")
    assert [u for u, _, _ in single] == list(range(UPDATES))
    for rank in (0, 1):
        rows = read_angles(two / f"angles.{rank}.tsv")
        assert [(u, k) for u, _, k in rows] == [(u, k) for u, _, k in single], rank
        assert [a for _, a, _ in rows] == pytest.approx([a for _, a, _ in single], abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["head", "top:1"])
def test_head_scope_workers_take_the_same_decisions(sentiment_data, tmp_path, scope):
    """--acl-grad-scope head (top:1: plus the top encoder layer) decides per micro-batch on
    the gradients summed over the workers: every worker logs the same angles and decisions,
    one row per update here."""
    args = [*COMMON, *CASES["acl_embed"], "--acl-grad-scope", scope]
    out = fairseq_train_workers(
        2, sentiment_data, tmp_path, *args, "--acl-grad-log", str(tmp_path / "angles.{rank}.tsv")
    )
    assert "training on 2 devices" in rank_output(out, 0)
    rank0 = read_angles(tmp_path / "angles.0.tsv")
    rank1 = read_angles(tmp_path / "angles.1.tsv")
    assert [u for u, _, _ in rank0] == list(range(UPDATES))
    assert rank1 == rank0


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCHER), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )


def test_launcher_prefixes_each_rank_and_passes_the_distributed_flags():
    proc = _launch("3", "--", "echo", "hello")
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        assert line.startswith(f"[rank {rank}] hello --cpu --distributed-backend gloo")
        assert "--ddp-backend legacy_ddp" in line and "--distributed-no-spawn" in line
        assert f"--distributed-world-size 3 --distributed-rank {rank}" in line
        assert "--distributed-init-method tcp://127.0.0.1:" in line


def test_launcher_writes_per_rank_logs(tmp_path):
    proc = _launch("2", "--log-dir", str(tmp_path), "--port", "12345", "--", "echo", "x")
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.log").read_text()
        assert text.startswith("x --cpu") and f"--distributed-rank {rank} " in text
        assert "tcp://127.0.0.1:12345" in text


def test_launcher_propagates_a_failure_and_stops_the_other_ranks():
    # rank 1 fails at once; rank 0 would wait 60 s (like a rank blocked in a collective)
    script = 'case "$*" in *"--distributed-rank 1 "*) echo boom; exit 7;; esac; sleep 60'
    proc = _launch("2", "--", "bash", "-c", script, "worker")
    assert proc.returncode == 7
    assert "[rank 1] boom" in proc.stdout
    assert "rank 1 exited with status 7" in proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "usage"),
        (["two", "--", "echo"], "N must be a positive integer"),
        (["2", "echo"], "unknown option 'echo'"),
        (["2", "--"], "no command after --"),
    ],
)
def test_launcher_usage_errors(args, message):
    proc = _launch(*args)
    assert proc.returncode == 2
    assert message.lower() in proc.stderr.lower()


def test_angle_log_rank_placeholder_writes_one_file_per_rank(tmp_path):
    from test_acl_grad import PlainOptimizer, TwoTermModel, make_task, run_update

    model, task = TwoTermModel(), make_task(log=str(tmp_path / "angles.{rank}.tsv"))
    opt = PlainOptimizer(model.parameters())
    run_update(task, model, opt, [{"a": [1.0, 0.0], "b": [1.0, 1.0]}])
    assert [p.name for p in tmp_path.iterdir()] == ["angles.0.tsv"]  # one process: rank 0
    (row,) = (tmp_path / "angles.0.tsv").read_text().splitlines()
    assert row.split("\t")[0] == "0" and float(row.split("\t")[1]) == pytest.approx(60.0)
