"""The GPU path, checked in one run: precisions x data-parallel layouts x the demo's fine-tunes.

For each precision (``fp32``; ``fp16``: fairseq's ``--fp16``, FP16 optimizer with dynamic loss
scaling; ``bf16``: the task's ``--autocast bf16``) and layout (``1``: one process on the GPU;
``2``: two ranks sharing that GPU, ``--ddp-backend pytorch_ddp`` with gloo, each with half the
batch, so an update sees the same examples), the demo's three fine-tunes run for
``--updates`` updates through ``fairseq-train``:

* CE: ``--criterion sentence_prediction --exit-layers none``, from ``MODEL_DIR/model.pt``;
* ACL: ``--criterion acl_embed --exit-layers none`` (ACL-Embed + exact ACL-Grad), likewise;
* ACL-CL: ``--criterion acl_cross_layer`` with an exit on every layer (stage 2), restored from
  that precision's and layout's ACL run.

The table gives the median seconds per update (``Trainer.train_step``, the device
synchronised around it, after ``--warmup`` updates; fp16's skipped overflow updates count as
updates) and the peak memory per process (the larger of the two ranks): GPU
``max_memory_allocated`` over the run (fairseq resets the counter every update; this script
keeps the maximum), or on CPU the peak resident set size. A run that fails is reported with
the tail of its log and the rest continues; the exit status is 1 if any failed. Logs and
checkpoints go to ``--out``.

``DATA`` is a binarized ``sentence_prediction`` folder (``acl-fairseq-prepare``);
``MODEL_DIR`` holds ``model.pt`` and ``fairseq_args.txt`` (``acl-fairseq-convert-bert``).

    python -m benchmarks.gpu_check DATA MODEL_DIR                       # everything, 300 updates
    python -m benchmarks.gpu_check DATA MODEL_DIR --precisions bf16 --layouts 2 --updates 100
    python -m benchmarks.gpu_check DATA MODEL_DIR --cpu --updates 8     # rehearsal on CPU

Budget: 18 runs; each costs fairseq's start (about 10-20 s) plus ``--updates`` updates
(MiniLM-L6, batch 32: a few hundredths of a second per update on a recent GPU).

``--cpu`` rehearses everything on CPU with gloo (tiny models: the CI test does so). fairseq's
fp16 optimizers assume CUDA in two places (``FP16Optimizer.build_fp32_params`` keys its flat
copy by ``torch.cuda.current_device()``; the trainer's overflow branch calls ``.cuda()``): in
the rehearsal only, this script's fairseq-train processes patch both for CPU.

On a GPU machine with Python 3.12 and a CUDA torch but no fairseq and no internet, carry over
the sdist of fairseq-fixed (``pip download --no-deps --no-binary :all:
fairseq-fixed==0.12.3.1``), wheels of its runtime dependencies (``pip download -d wheels
cython numpy hydra-core==1.3.2 omegaconf==2.3.0 bitarray sacrebleu regex tqdm cffi
scikit-learn packaging``, for that Python) and this repository, then::

    pip install --no-index --find-links wheels cython numpy hydra-core==1.3.2 \\
        omegaconf==2.3.0 bitarray sacrebleu regex tqdm cffi scikit-learn packaging
    pip install --no-build-isolation --no-deps fairseq-fixed-0.12.3.1.tar.gz  # builds (~3 min)
    pip install --no-deps -e .                                 # this plugin, from its checkout
    python -m benchmarks.gpu_check DATA MODEL_DIR

(``--no-build-isolation`` builds against the installed CUDA torch instead of downloading
another; ``--no-deps`` keeps pip from pulling torchaudio and a second torch.)
"""

import argparse
import atexit
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "acl_fairseq"
CHILD_FLAG = "--fairseq-train"  # this script as a fairseq-train process (see child_main)
REPORT_PREFIX = "gpu_check report: "  # printed by this script's fairseq-train processes

PRECISIONS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--autocast", "bf16"]}
METHODS = {
    "CE": ["--criterion", "sentence_prediction", "--exit-layers", "none"],
    "ACL": ["--criterion", "acl_embed", "--exit-layers", "none"],
    "ACL-CL": ["--criterion", "acl_cross_layer"],
}
METHOD_KEYS = {"ce": "CE", "acl": "ACL", "acl_cl": "ACL-CL"}


# ----------------------------------------------------------------- the fairseq-train process
def child_main(argv: list[str]) -> None:
    """``fairseq-train argv``, printing at exit this process's peak memory and the seconds of
    every ``Trainer.train_step`` (one update; the device synchronised around it)."""
    import torch
    from fairseq.trainer import Trainer

    cpu = "--cpu" in argv
    cuda = torch.cuda.is_available() and not cpu
    if cpu and "--fp16" in argv:  # the rehearsal's patches (module docstring)
        torch.cuda.current_device = lambda: None
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    peak, seconds = [0], []
    train_step = Trainer.train_step

    def timed_train_step(self, samples, raise_oom=False):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = train_step(self, samples, raise_oom)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        return out

    Trainer.train_step = timed_train_step
    if cuda:  # fairseq resets the peak every update: keep the maximum
        reset = torch.cuda.reset_peak_memory_stats

        def keep_peak_then_reset(*args, **kwargs):
            peak[0] = max(peak[0], torch.cuda.max_memory_allocated())
            reset(*args, **kwargs)

        torch.cuda.reset_peak_memory_stats = keep_peak_then_reset

    def report() -> None:
        if cuda:
            mib = max(peak[0], torch.cuda.max_memory_allocated()) / 2**20
        else:  # peak resident set size (Linux)
            status = Path("/proc/self/status")
            lines = status.read_text().splitlines() if status.exists() else []
            hwm = [int(line.split()[1]) for line in lines if line.startswith("VmHWM:")]
            mib = hwm[0] / 1024 if hwm else float("nan")
        print(f"{REPORT_PREFIX}{json.dumps({'peak_mib': mib, 'seconds': seconds})}", flush=True)

    atexit.register(report)
    from fairseq_cli.train import cli_main

    sys.argv = ["fairseq-train", *argv]
    cli_main()


# ----------------------------------------------------------------- command lines
@dataclass(frozen=True)
class Run:
    precision: str
    ranks: int
    method: str

    @property
    def name(self) -> str:
        return f"{self.precision}-{self.ranks}rank-{self.method.lower()}"


def model_flags(model_dir: Path) -> list[str]:
    """``MODEL_DIR/fairseq_args.txt`` as multi-exit model flags (restore/reset flags dropped)."""
    path = model_dir / "fairseq_args.txt"
    if not path.is_file() or not (model_dir / "model.pt").is_file():
        raise SystemExit(f"{model_dir}: needs model.pt and fairseq_args.txt (convert-bert's)")
    flags = path.read_text().split()
    if "--restore-file" in flags:
        i = flags.index("--restore-file")
        del flags[i : i + 2]
    flags = [f for f in flags if f not in ("--reset-optimizer", "--reset-dataloader")]
    if "--arch" not in flags:
        raise SystemExit(f"{path}: no --arch flag")
    flags[flags.index("--arch") + 1] = "multi_exit_roberta"
    return flags


def data_flags(data: Path) -> list[str]:
    """``--num-classes`` (the labels of ``DATA/label/dict.txt`` that occur), and the
    separator for pairs."""
    labels = data / "label" / "dict.txt"
    if not labels.is_file() or not (data / "input0" / "dict.txt").is_file():
        raise SystemExit(f"{data}: not a binarized sentence_prediction folder (input0/, label/)")
    rows = [line.split() for line in labels.read_text().splitlines() if line.strip()]
    num_classes = sum(1 for row in rows if int(row[1]) > 0)  # not fairseq's padding symbols
    flags = ["--num-classes", str(num_classes), "--init-token", "0"]
    if (data / "input1").is_dir():
        flags += ["--separator-token", "2"]
    return flags


def train_command(a: argparse.Namespace, run: Run, save_dir: Path, restore: Path) -> list[str]:
    """The ``fairseq-train`` flags of ``run`` (one rank's; the distributed ones added later)."""
    batch = a.batch_size // run.ranks
    warmup = max(1, a.updates * 6 // 100)
    return [
        str(a.data), "--user-dir", str(USER_DIR), "--task", "acl_sentence_prediction",
        *model_flags(a.model_dir), *METHODS[run.method], "--exit-pooling", "mean",
        *data_flags(a.data), *PRECISIONS[run.precision],
        "--restore-file", str(restore),
        "--reset-optimizer", "--reset-dataloader", "--reset-meters", "--reset-lr-scheduler",
        "--batch-size", str(batch), "--required-batch-size-multiple", "1",
        "--max-update", str(a.updates), "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
        "--adam-eps", "1e-6", "--weight-decay", "0.1", "--lr", str(a.lr),
        "--lr-scheduler", "polynomial_decay", "--total-num-update", str(a.updates),
        "--warmup-updates", str(warmup), "--disable-validation", "--no-epoch-checkpoints",
        "--no-save-optimizer-state", "--save-dir", str(save_dir), "--seed", "1",
        "--log-format", "json", "--log-interval", str(a.log_interval),
        "--num-workers", "0" if a.cpu else "2", *(["--cpu"] if a.cpu else []),
    ]  # fmt: skip


def distributed_flags(rank: int, ranks: int, port: int) -> list[str]:
    """Rank ``rank`` of ``ranks`` processes on one device: gloo, pytorch_ddp, device 0."""
    if ranks == 1:
        return []
    return [
        "--distributed-backend", "gloo", "--ddp-backend", "pytorch_ddp",
        "--find-unused-parameters", "--distributed-init-method", f"tcp://127.0.0.1:{port}",
        "--distributed-world-size", str(ranks), "--distributed-rank", str(rank),
        "--distributed-no-spawn", "--device-id", "0",
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------- running and reading
@dataclass
class Result:
    run: Run
    ok: bool
    s_per_update: float | None = None
    timed_updates: int = 0
    peak_mib: float | None = None  # max over the ranks
    error: str = ""


def launch(a: argparse.Namespace, run: Run, restore: Path) -> Result:
    """Runs ``run``'s ranks, waits for all (stopping the others when one fails), reads rank 0's
    log and every rank's peak memory."""
    save_dir = a.out / run.name
    save_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs, logs = [], []
    for rank in range(run.ranks):
        log = save_dir / f"rank{rank}.log"
        cmd = [sys.executable, __file__, CHILD_FLAG, *train_command(a, run, save_dir, restore)]
        cmd += distributed_flags(rank, run.ranks, port)
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
    failed = None
    while any(p.poll() is None for p in procs):
        if failed is None:
            failed = next((p for p in procs if p.poll() not in (None, 0)), None)
            if failed is not None:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
        time.sleep(0.5)
    if failed is None:
        failed = next((p for p in procs if p.returncode != 0), None)
    texts = [log.read_text(errors="replace") for log in logs]
    if failed is not None:
        return Result(run, False, error=texts[procs.index(failed)][-3000:])
    reports = [
        json.loads(line[len(REPORT_PREFIX) :])
        for text in texts
        for line in text.splitlines()
        if line.startswith(REPORT_PREFIX)
    ]
    if len(reports) != run.ranks:
        return Result(run, False, error=f"{len(reports)} of {run.ranks} ranks reported")
    timed = reports[0]["seconds"][a.warmup :]  # rank 0's updates after the warm-up
    seconds = statistics.median(timed) if timed else None
    return Result(run, True, seconds, len(timed), max(r["peak_mib"] for r in reports))


def table(results: list[Result], a: argparse.Namespace) -> str:
    kind = "peak RSS MiB (CPU)" if a.cpu else "peak GPU MiB (max allocated)"
    lines = [
        f"| precision | ranks | method | examples/update | s/update | timed updates | {kind} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        seconds = f"{r.s_per_update:.4f}" if r.s_per_update is not None else "-"
        peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-"
        if not r.ok:
            seconds, peak = "FAILED", "-"
        examples = (a.batch_size // r.run.ranks) * r.run.ranks
        lines.append(
            f"| {r.run.precision} | {r.run.ranks} | {r.run.method} | {examples} | {seconds} "
            f"| {r.timed_updates} | {peak} |"
        )
    return "\n".join(lines)


def parse_list(value: str, choices: dict, flag: str, p: argparse.ArgumentParser) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in choices]
    if bad or not items:
        p.error(f"{flag}: choose from {', '.join(choices)} (got {value!r})")
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("data", type=Path, help="binarized sentence_prediction data folder")
    p.add_argument("model_dir", type=Path, help="folder with model.pt and fairseq_args.txt")
    p.add_argument("--updates", type=int, default=300, help="updates per fine-tune")
    p.add_argument("--batch-size", type=int, default=32, help="examples per update, all ranks")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--log-interval", type=int, default=10, help="of fairseq's log")
    p.add_argument("--warmup", type=int, default=10, help="first updates left out of the time")
    p.add_argument("--precisions", default="fp32,fp16,bf16", help="of: fp32, fp16, bf16")
    p.add_argument("--layouts", default="1,2", help="processes on the one device: 1 and/or 2")
    p.add_argument("--methods", default="ce,acl,acl_cl", help="of: ce, acl, acl_cl")
    p.add_argument("--out", type=Path, default=Path("gpu_check_runs"), help="logs, checkpoints")
    p.add_argument("--cpu", action="store_true", help="rehearse on CPU (gloo), tiny settings")
    a = p.parse_args(argv)
    precisions = parse_list(a.precisions, PRECISIONS, "--precisions", p)
    layouts = [int(x) for x in parse_list(a.layouts, {"1": 1, "2": 2}, "--layouts", p)]
    methods = [METHOD_KEYS[m] for m in parse_list(a.methods, METHOD_KEYS, "--methods", p)]
    if "ACL-CL" in methods and "ACL" not in methods:
        p.error("--methods: acl_cl is restored from the acl run; list acl too")
    if a.updates <= a.warmup:
        p.error("--updates must exceed --warmup (the warm-up updates are not timed)")
    import torch  # after argparse, so that --help is fast

    if not a.cpu and not torch.cuda.is_available():
        p.error("no CUDA device: pass --cpu to rehearse on CPU")
    model_flags(a.model_dir), data_flags(a.data)  # the folders, checked before any run
    a.out.mkdir(parents=True, exist_ok=True)
    device = "CPU" if a.cpu else torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; {a.updates} updates per fine-tune")

    results = []
    for precision in precisions:
        for ranks in layouts:
            acl_checkpoint = None
            for method in methods:
                run = Run(precision, ranks, method)
                restore = a.model_dir / "model.pt"
                if method == "ACL-CL":
                    if acl_checkpoint is None:
                        results.append(Result(run, False, error="the ACL run failed"))
                        continue
                    restore = acl_checkpoint
                print(f"-- {run.name}", flush=True)
                result = launch(a, run, restore)
                results.append(result)
                if not result.ok:
                    print(f"   FAILED:\n{result.error}", flush=True)
                elif method == "ACL":
                    acl_checkpoint = a.out / run.name / "checkpoint_last.pt"
    print()
    print(table(results, a))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD_FLAG:
        child_main(sys.argv[2:])
    else:
        sys.exit(main())
