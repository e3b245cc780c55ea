"""Data-parallel training on CPU (scripts/launch_cpu_workers.sh, gloo) equals gradient
accumulation, under both of fairseq's data-parallel backends.

2 workers x ``--batch-size B`` and 1 worker x ``--batch-size B --update-freq 2`` see the same
examples in every update: fairseq shuffles the *batches* of an epoch with ``seed + epoch``
(the same on every worker), then ``ShardedIterator`` gives worker r the batches r, r+2, ...,
while ``GroupedIterator`` gives the single worker the batches 2u, 2u+1 for update u (with
``--update-freq k`` on 2 workers, 1 worker needs ``--update-freq 2k``). The batches themselves
do not depend on the number of workers (``--batch-size`` fixed,
``--required-batch-size-multiple 1``, 384 examples = 48 full batches of 8). With dropout 0 the
runs then compute the same gradient up to float rounding, and ACL-Grad, which decides once per
update on the all-reduced gradients, takes the same decisions on every worker.

``--ddp-backend legacy_ddp`` all-reduces ``.grad`` after the update's last backward;
``pytorch_ddp`` (alias ``c10d``, torch's DistributedDataParallel, built on CPU by the plugin)
reduces it inside the last backward (``no_sync`` before). Both must give what one worker gives.
The ``head`` / ``top:K`` scopes decide per micro-batch on the gradients summed over the
workers, so there the two backends must agree with each other (one worker with
``--update-freq 2`` decides per single batch, by design not the same).
"""

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from acl_fairseq.acl_grad import read_angle_log
from acl_fairseq.distributed import (
    _distributed_main,
    call_through_wrappers,
    check_unused_parameters,
    find_ddp,
    stop_data_threads,
    unwrap_model,
)

from fairseq_helpers import (
    LAUNCHER,
    TINY_MULTI_EXIT_3,
    TINY_ROBERTA,
    exact_train_args,
    fairseq_train_with,
    json_records,
    rank_output,
)

UPDATES = 6
COMMON = exact_train_args(UPDATES, disable_validation=True)

CASES = {
    "acl_embed": [*TINY_ROBERTA, "--criterion", "acl_embed"],
    "ce_scl": [*TINY_ROBERTA, "--criterion", "ce_scl"],
    "ce_scl_acl_grad": [*TINY_ROBERTA, "--criterion", "ce_scl", "--acl-grad"],
    "acl_cross_layer": [*TINY_MULTI_EXIT_3, "--criterion", "acl_cross_layer"],
    "head": [*TINY_ROBERTA, "--criterion", "acl_embed", "--acl-grad-scope", "head"],
    "top:1": [*TINY_ROBERTA, "--criterion", "acl_embed", "--acl-grad-scope", "top:1"],
}
PER_MICRO_BATCH = ("head", "top:1")  # the scopes that decide per micro-batch
LOGGED = ("loss", "ce_loss", "contrastive_loss", "accuracy", "acl_grad_angle", "acl_grad_drop")
# acl_grad_angle is logged to one decimal (a 5e-3 difference can flip the last digit); the
# unrounded angles are compared through the angle logs below.
LOGGED_TOLERANCE = {"acl_grad_angle": 0.1 + 1e-6}


@dataclass(frozen=True)
class Run:
    """One training run of a case: ``workers`` processes (1: no distributed flags)."""

    case: str
    workers: int = 1
    update_freq: int = 1
    backend: str = "legacy_ddp"
    find_unused: bool = False  # --find-unused-parameters (else the LM head is built frozen)

    def args(self, save_dir) -> list[str]:
        args = [*COMMON, *CASES[self.case], "--update-freq", str(self.update_freq)]
        args += ["--acl-grad-log", str(save_dir / "angles.{rank}.tsv")]
        if self.workers > 1:
            args += ["--ddp-backend", self.backend]
            args += ["--find-unused-parameters"] if self.find_unused else []
        return args

    @property
    def patches(self) -> tuple[str, ...]:
        torch_ddp = self.workers > 1 and self.backend in ("pytorch_ddp", "c10d")
        return ("frozen_lm_head",) if torch_ddp and not self.find_unused else ()


@dataclass
class Trained:
    run: Run
    output: str  # rank 0's
    save_dir: object

    def train_inner(self) -> list[dict]:
        return [r for r in json_records(self.output) if "num_updates" in r and "epoch" in r]

    def angles(self, rank: int) -> list[tuple[int, float, int]]:
        rows = read_angle_log(self.save_dir / f"angles.{rank}.tsv")
        return [(r.update, r.angle, int(r.kept)) for r in rows]

    def state(self) -> dict[str, torch.Tensor]:
        path = self.save_dir / "checkpoint_last.pt"
        return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.fixture(scope="module")
def trained(sentiment_data, tmp_path_factory):
    """``trained(Run(...))``: the run, trained once per test module."""
    cache: dict[Run, Trained] = {}

    def train(r: Run) -> Trained:
        if r not in cache:
            save_dir = tmp_path_factory.mktemp("run")
            out = fairseq_train_with(
                sentiment_data, save_dir, *r.args(save_dir), workers=r.workers, patches=r.patches
            )
            rank0 = rank_output(out, 0) if r.workers > 1 else out
            assert f"training on {r.workers} devices" in rank0
            cache[r] = Trained(r, rank0, save_dir)
        return cache[r]

    return train


def assert_same_training(a: Trained, b: Trained, angles: bool = True) -> None:
    """Same parameters after the same updates, the same logged statistics, and (``angles``)
    the same ACL-Grad decisions and angles, on every worker of ``b``."""
    s1, s2 = a.state(), b.state()
    assert s1.keys() == s2.keys()
    diff = max((s1[k].double() - s2[k].double()).abs().max().item() for k in s1)
    print(f"{a.run} vs {b.run}: largest parameter difference {diff:.3g}")
    for k in s1:
        torch.testing.assert_close(s2[k], s1[k], rtol=1e-4, atol=1e-5, msg=k)

    r1, r2 = a.train_inner(), b.train_inner()
    examples = 8 * b.run.workers * b.run.update_freq
    for records in (r1, r2):
        assert [int(r["num_updates"]) for r in records] == list(range(1, UPDATES + 1))
        assert all(float(r["bsz"]) == examples for r in records)
    for x, y in zip(r1, r2):
        assert x.keys() == y.keys()
        for key in LOGGED:
            if key in x:
                tolerance = LOGGED_TOLERANCE.get(key, 2e-3)
                assert float(y[key]) == pytest.approx(float(x[key]), abs=tolerance), key

    acl_grad = a.run.case != "ce_scl"
    logs = sorted(p.name for p in b.save_dir.glob("angles.*.tsv"))
    if not acl_grad:
        assert logs == [] and "acl_grad_angle" not in r2[-1]
        return
    assert logs == [f"angles.{rank}.tsv" for rank in range(b.run.workers)]
    if not angles:
        return
    reference = a.angles(0)
    per_update = 1 if a.run.case not in PER_MICRO_BATCH else a.run.update_freq
    assert [u for u, _, _ in reference] == [u for u in range(UPDATES) for _ in range(per_update)]
    for rank in range(b.run.workers):
        rows = b.angles(rank)
        assert [(u, k) for u, _, k in rows] == [(u, k) for u, _, k in reference], rank
        # degrees; gradients summed in another order move an angle by up to about 0.005
        assert [x for _, x, _ in rows] == pytest.approx([x for _, x, _ in reference], abs=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [pytest.param("acl_embed", marks=pytest.mark.server_off), "ce_scl", "ce_scl_acl_grad",
     "acl_cross_layer"],
)  # fmt: skip
def test_two_workers_equal_update_freq_two(trained, case):
    """legacy_ddp: 2 workers decide and update like 1 worker with --update-freq 2."""
    assert_same_training(trained(Run(case, update_freq=2)), trained(Run(case, workers=2)))


# (case, --ddp-backend, --update-freq, --find-unused-parameters): every case under torch's DDP,
# with and without unused-parameter detection (without: the unused LM head built frozen), each
# also with fairseq's no_sync path (--update-freq 2), through both spellings of the backend
TORCH_DDP = [
    ("acl_embed", "pytorch_ddp", 1, True),
    ("acl_embed", "c10d", 1, False),
    ("acl_cross_layer", "c10d", 2, True),
    ("ce_scl_acl_grad", "pytorch_ddp", 2, False),
    ("ce_scl", "pytorch_ddp", 1, True),
    ("head", "pytorch_ddp", 2, True),
    ("top:1", "c10d", 1, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,backend,update_freq,find_unused", TORCH_DDP)
def test_torch_ddp_equals_legacy_ddp_and_one_worker(
    trained, case, backend, update_freq, find_unused
):
    """pytorch_ddp / c10d: the same decisions, angles, statistics and final weights as
    legacy_ddp with the same workers and --update-freq, and (scopes that decide per update)
    as 1 worker with twice the --update-freq."""
    torch_ddp = trained(Run(case, 2, update_freq, backend, find_unused))
    legacy = trained(Run(case, 2, update_freq))
    assert_same_training(legacy, torch_ddp)
    if case in PER_MICRO_BATCH:  # rank 0's decision, broadcast
        assert torch_ddp.angles(1) == torch_ddp.angles(0)
    else:
        assert_same_training(trained(Run(case, update_freq=2 * update_freq)), torch_ddp)


@pytest.mark.slow
def test_torch_ddp_with_an_unused_lm_head_needs_find_unused_parameters(sentiment_data, tmp_path):
    """Without --find-unused-parameters torch's DDP would wait for the LM head's gradients
    and stop at the second update; the task says so at set-up, naming the flag."""
    args = [*COMMON, *CASES["acl_embed"], "--ddp-backend", "pytorch_ddp"]
    with pytest.raises(AssertionError) as failure:
        fairseq_train_with(sentiment_data, tmp_path, *args, workers=2)
    message = str(failure.value)
    assert "--ddp-backend pytorch_ddp with 2 workers needs --find-unused-parameters" in message
    assert "encoder.lm_head" in message and "train_inner" not in message


@pytest.mark.slow
def test_two_workers_restore_a_checkpoint(trained, sentiment_data, tmp_path):
    """Worker 0 loads --restore-file and broadcasts it; under torch >= 2.6 worker 1's
    weights-only unpickling refused it until the plugin's broadcast (distributed.py)."""
    checkpoint = trained(Run("acl_embed", update_freq=2)).save_dir / "checkpoint_last.pt"
    args = [*COMMON, *CASES["acl_embed"], "--ddp-backend", "pytorch_ddp"]
    args += ["--find-unused-parameters", "--restore-file", str(checkpoint), "--reset-optimizer"]
    out = fairseq_train_with(sentiment_data, tmp_path, *args, "--max-update", "1", workers=2)
    assert f"Loaded checkpoint {checkpoint}" in rank_output(out, 0)  # and both ranks exited 0
    assert "Weights only load failed" not in rank_output(out, 1)


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
        assert "--ddp-backend" not in line and "--distributed-no-spawn" in line  # fairseq's
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


# ----------------------------------------------------------------- acl_fairseq.distributed
class Wrapper(torch.nn.Module):
    """A fairseq-style wrapper: keeps the model as ``.module``, forwards every call."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


class Inner(torch.nn.Module):
    def forward(self, x):
        return "forward"

    def exits(self, x, scale=1):
        if x is None:
            raise ValueError("no input")
        return ("exits", x * scale)


def test_call_through_wrappers_runs_the_method_through_every_forward():
    inner = Inner()
    outer = Wrapper(Wrapper(inner))
    assert call_through_wrappers(outer, "exits", 2, scale=3) == ("exits", 6)
    assert outer.calls == outer.module.calls == 1
    assert inner(0) == "forward" and "forward" not in vars(inner)  # forward is back
    with pytest.raises(ValueError, match="no input"):
        call_through_wrappers(outer, "exits", None)
    assert inner(0) == "forward" and outer.calls == 2
    assert call_through_wrappers(inner, "exits", 1) == ("exits", 1)  # no wrapper
    assert unwrap_model(outer) is inner and find_ddp(outer) is None


@pytest.mark.parametrize(
    "backend,world_size,find_unused,unused,raises",
    [
        ("pytorch_ddp", 2, False, ["encoder.lm_head.bias"], True),
        ("c10d", 4, False, ["a", "b", "c", "d", "e"], True),
        ("pytorch_ddp", 2, True, ["encoder.lm_head.bias"], False),
        ("pytorch_ddp", 1, False, ["encoder.lm_head.bias"], False),
        ("legacy_ddp", 2, False, ["encoder.lm_head.bias"], False),
        ("pytorch_ddp", 2, False, [], False),
        ("pytorch_ddp", "${distributed_training.distributed_world_size}", False, ["x"], False),
    ],
)
def test_torch_ddp_with_unused_parameters_needs_the_flag(
    backend, world_size, find_unused, unused, raises
):
    cfg = SimpleNamespace(
        ddp_backend=backend, distributed_world_size=world_size, find_unused_parameters=find_unused
    )
    if not raises:
        check_unused_parameters(cfg, unused)
        return
    with pytest.raises(ValueError, match="needs --find-unused-parameters") as error:
        check_unused_parameters(cfg, unused)
    assert f"--ddp-backend {backend} with {world_size} workers" in str(error.value)
    assert unused[0] in str(error.value)
    assert ("and 2 more" in str(error.value)) is (len(unused) == 5)


ONE_PROCESS_DDP = """
import torch, torch.distributed as dist
from argparse import Namespace
from torch.nn.parallel import DistributedDataParallel
from acl_fairseq import fairseq_patches
from acl_fairseq.acl_grad import AclGrad, AclGradSettings, LossTerms
from acl_fairseq.distributed import find_ddp
from fairseq.models import DistributedFairseqModel

fairseq_patches.mark_in_use("task")  # as fairseq-train does once it builds the plugin's task
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
args = Namespace(tpu=False, ddp_backend="pytorch_ddp", device_id=0, broadcast_buffers=False,
                 bucket_cap_mb=25, find_unused_parameters=False, gradient_as_bucket_view=False,
                 ddp_comm_hook="none", heartbeat_timeout=-1)
model = DistributedFairseqModel(args, torch.nn.Linear(2, 2), dist.group.WORLD, "cpu")
print("fairseq's pytorch_ddp on CPU:", type(find_ddp(model)).__name__, find_ddp(model).device_ids)
try:
    DistributedDataParallel(torch.nn.Linear(2, 2), device_ids=[0])
except Exception as e:
    print("torch refuses device_ids on CPU:", "device_ids" in str(e))

class Criterion:
    acl_grad = AclGradSettings(90.0, "all")
    def loss_terms(self, model, sample):
        y = model(torch.ones(1, 2)).sum()
        return LossTerms(y, y * 2, 1, {})
    def check_model(self, model): pass

static = DistributedDataParallel(torch.nn.Linear(2, 2), static_graph=True)
try:
    AclGrad().train_step({}, static, Criterion(), None, 0)
except RuntimeError as e:
    print("static graph:", str(e).split(":")[0])
dist.destroy_process_group()
"""


def test_cpu_ddp_shim_and_the_static_graph_refusal_in_one_process():
    """With the plugin imported, fairseq's pytorch_ddp wrapper builds torch's DDP on CPU
    (torch refuses the device_ids fairseq passes); ACL-Grad refuses a static-graph DDP."""
    proc = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS_DDP], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "fairseq's pytorch_ddp on CPU: CpuDistributedDataParallel None" in lines
    assert "torch refuses device_ids on CPU: True" in lines
    assert (
        "static graph: ACL-Grad cannot train a DistributedDataParallel model built with "
        "static_graph=True" in lines
    )


# ------------------------------------------------------------------- teardown at exit
DAEMON_IN_TORCH_AT_EXIT = """
import sys, torch
from fairseq.data.iterators import BufferedIterator
if sys.argv[1] == "plugin":  # a plugin run: fairseq-train has built the plugin's task
    from acl_fairseq import fairseq_patches
    fairseq_patches.mark_in_use("task")

class Batches:  # a collater busy inside torch operators, as with a big batch
    def __len__(self):
        return 10**6

    def __iter__(self):
        while True:
            x = torch.randn(64, 64)
            for _ in range(50):
                x = torch.tanh(x @ x)
            yield x

itr = BufferedIterator(1000, Batches())
next(itr)
print("took a batch")
"""


@pytest.mark.parametrize("plugin", [False, True])
def test_fairseqs_data_thread_inside_torch_at_exit_aborts_unless_the_plugin_stops_it(plugin):
    """fairseq's data-loading daemon thread, caught inside a torch operator when the
    interpreter exits, aborts the process ("terminate called without an active exception"):
    the abort a 2-worker launch showed now and then. The plugin stops the thread first."""
    proc = subprocess.run(
        [sys.executable, "-c", DAEMON_IN_TORCH_AT_EXIT, "plugin" if plugin else "stock"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert "took a batch" in proc.stdout
    if plugin:
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr
    else:  # the cause, shown without the plugin
        assert proc.returncode != 0 and "terminate called" in proc.stderr


def test_stop_data_threads_ends_a_consumer_blocked_on_a_full_queue():
    from fairseq.data.iterators import BackgroundConsumer, BufferedIterator

    itr = BufferedIterator(2, list(range(100)))
    assert next(itr) == 0
    (thread,) = [t for t in threading.enumerate() if isinstance(t, BackgroundConsumer)]
    stop_data_threads()
    assert not thread.is_alive()


def test_workers_destroy_their_process_group_when_the_command_returns(monkeypatch, plugin_run):
    """fairseq's ``distributed_main`` returns with the group alive; the plugin's destroys it
    (after stopping the data threads), also when spawned (a module-level function)."""
    from fairseq.distributed import utils

    seen = []

    def fairseq_distributed_main(i, main, cfg, kwargs):  # stands for fairseq's
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        main(cfg, **kwargs)

    assert utils.distributed_main is _distributed_main
    monkeypatch.setattr(_distributed_main, "__wrapped__", fairseq_distributed_main)
    utils.distributed_main(0, lambda cfg: seen.append(dist.is_initialized()), None, {})
    assert seen == [True] and not dist.is_initialized()
    assert _distributed_main.__module__ == "acl_fairseq.distributed"


def test_a_worker_that_stops_on_an_error_destroys_its_process_group_too(monkeypatch, plugin_run):
    """A worker whose command raises (e.g. another run holds --save-dir) tears down as well,
    then the error goes on unchanged: no gloo thread is left alive at exit to abort it."""
    from fairseq.distributed import utils

    def fairseq_distributed_main(i, main, cfg, kwargs):  # stands for fairseq's
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        main(cfg, **kwargs)

    def failing_main(cfg):
        raise RuntimeError("--save-dir is in use")

    monkeypatch.setattr(_distributed_main, "__wrapped__", fairseq_distributed_main)
    with pytest.raises(RuntimeError, match="--save-dir is in use"):
        utils.distributed_main(0, failing_main, None, {})
    assert not dist.is_initialized()
