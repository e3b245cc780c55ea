"""Training cost of the contrastive criterions relative to fairseq's ``sentence_prediction``.

Same model, same batch, same process, through fairseq's real ``Trainer.train_step`` (so the
ACL-Grad hook, the all-reduce interception and the optimizer step are all included).
Methods run interleaved in rounds so machine noise hits them alike; the table gives the
median seconds per update and the ratio to the baseline. Peak memory: on a GPU the peak of
``torch.cuda.max_memory_allocated`` per method; on CPU the peak resident set size (Linux
``VmHWM``) during 3 updates of a fresh process that runs that method alone, after a first
update has allocated the optimizer state (``--no-memory`` skips these processes).

``--precision fp32,bf16`` runs every method in each precision (bf16: the task's
``--autocast bf16``, fp32 weights; on CPU or CUDA): one more column gives each row's ratio to
the same method in fp32.

    python -m benchmarks.train_cost                      # MiniLM-L6 sized, batch 32, length 128
    python -m benchmarks.train_cost --layers 12 --dim 768 --heads 12 --ffn 3072   # BERT-base
    python -m benchmarks.train_cost --top-k 1,2,3        # --acl-grad-scope top:1..3 rows
    python -m benchmarks.train_cost --precision fp32,bf16 --methods ce,acl   # CE, exact ACL-Grad
"""

import argparse
import contextlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.trainer import Trainer

import acl_fairseq  # noqa: F401  (registers the plugin)

METHODS = {  # key -> (row label, fairseq-train flags)
    "ce": ("CE (fairseq sentence_prediction)", ["--criterion", "sentence_prediction"]),
    "ce_scl": ("CE+SCL (ce_scl)", ["--criterion", "ce_scl"]),
    "acl_no_grad": ("ACL-Embed, ACL-Grad off", ["--criterion", "acl_embed", "--no-acl-grad"]),
    "acl": ("ACL-Embed + ACL-Grad (acl_embed)", ["--criterion", "acl_embed"]),
    "acl_head": (
        "ACL-Embed + ACL-Grad, --acl-grad-scope head",
        ["--criterion", "acl_embed", "--acl-grad-scope", "head"],
    ),
}
PRECISIONS = {"fp32": [], "bf16": ["--autocast", "bf16"]}  # --precision -> task flags


class Row(NamedTuple):
    """One timed configuration: a method in a precision."""

    key: str  # METHODS key (or acl_topK)
    precision: str
    label: str
    args: list[str]

    @property
    def name(self) -> str:
        return f"{self.key}@{self.precision}"


def methods_with_top_k(top_k: str, layers: int) -> dict[str, tuple[str, list[str]]]:
    """:data:`METHODS` plus one ``--acl-grad-scope top:K`` row per K of ``top_k`` (a comma
    list) that fits ``layers``."""
    methods = dict(METHODS)
    for item in filter(None, (x.strip() for x in top_k.split(","))):
        if int(item) <= layers:
            methods[f"acl_top{item}"] = (
                f"ACL-Embed + ACL-Grad, --acl-grad-scope top:{item}",
                ["--criterion", "acl_embed", "--acl-grad-scope", f"top:{item}"],
            )
    return methods


def make_rows(a: argparse.Namespace, p: argparse.ArgumentParser) -> list[Row]:
    """The rows of ``--methods`` x ``--precision``, precision-major (CE fp32 first)."""
    methods = methods_with_top_k(a.top_k, a.layers)
    keys = [k.strip() for k in a.methods.split(",") if k.strip()] if a.methods else list(methods)
    precisions = [x.strip() for x in a.precision.split(",") if x.strip()]
    for key in keys:
        if key not in methods:
            p.error(f"--methods: unknown method {key!r}; choose from {', '.join(methods)}")
    for precision in precisions:
        if precision not in PRECISIONS:
            p.error(f"--precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if not keys or not precisions:
        p.error("--methods and --precision need at least one value each")
    rows = []
    for precision in precisions:
        for key in keys:
            label, args = methods[key]
            suffix = "" if precisions == ["fp32"] else f" [{precision}]"
            rows.append(Row(key, precision, label + suffix, args + PRECISIONS[precision]))
    return rows


def write_dicts(root: Path, vocab: int, classes: int) -> None:
    (root / "input0").mkdir(parents=True)
    (root / "label").mkdir()
    (root / "input0" / "dict.txt").write_text("".join(f"t{i} 1\n" for i in range(vocab)))
    (root / "label" / "dict.txt").write_text("".join(f"{i} 1\n" for i in range(classes)))


def build_trainer(data: Path, a: argparse.Namespace, method_args: list[str]) -> Trainer:
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            str(data),
            "--user-dir",
            str(Path(acl_fairseq.__file__).parent),
            "--task",
            "acl_sentence_prediction",
            "--num-classes",
            str(a.classes),
            "--arch",
            "roberta",
            "--encoder-layers",
            str(a.layers),
            "--encoder-embed-dim",
            str(a.dim),
            "--encoder-ffn-embed-dim",
            str(a.ffn),
            "--encoder-attention-heads",
            str(a.heads),
            "--max-positions",
            "512",
            "--optimizer",
            "adam",
            "--lr",
            "1e-5",
            "--batch-size",
            str(a.batch),
            "--seed",
            "1",
            "--dropout",
            "0.1",
            "--num-workers",
            "0",
            *([] if torch.cuda.is_available() else ["--cpu"]),
            *method_args,
        ],
    )
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return Trainer(cfg, task, model, criterion)


def make_sample(a: argparse.Namespace, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, a.vocab, (a.batch, a.length), generator=g)
    tokens[:, 0] = 0
    return {
        "id": torch.arange(a.batch),
        "net_input": {"src_tokens": tokens, "src_lengths": torch.full((a.batch,), a.length)},
        "target": torch.randint(0, a.classes, (a.batch,), generator=g),
        "ntokens": a.batch * a.length,
        "nsentences": a.batch,
    }


def reset_peak_rss() -> None:
    """Resets the kernel's peak-RSS counter of this process (Linux; no-op elsewhere)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float:
    """Peak RSS since the last reset (Linux ``VmHWM``), else since the process started."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_peak_rss_mib(row: Row) -> float:
    """Peak resident set size (MiB) of a fresh process running only ``row``."""
    out = subprocess.run(
        [sys.executable, __file__, *sys.argv[1:], "--no-memory", "--only", row.name],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.strip().splitlines()[-1].split("=")[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--updates", type=int, default=5, help="timed updates per method per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-memory", action="store_true", help="skip the CPU peak-memory processes")
    p.add_argument(
        "--top-k",
        default="1,2",
        help="comma list of K: one --acl-grad-scope top:K row each (default: 1,2; '' none)",
    )
    p.add_argument(
        "--methods",
        default="",
        help="comma list of the methods to time (default: all): "
        + ", ".join(METHODS)
        + ", acl_topK (with --top-k)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        help="comma list: fp32 and/or bf16 (--autocast bf16); every method runs in each",
    )
    p.add_argument("--only", help=argparse.SUPPRESS)
    a = p.parse_args()
    rows = make_rows(a, p)
    by_name = {row.name: row for row in rows}
    if a.only is not None and a.only not in by_name:
        p.error(f"--only: unknown row {a.only!r}")

    if a.only:  # child process of cpu_peak_rss_mib
        with tempfile.TemporaryDirectory() as tmp:
            write_dicts(Path(tmp), a.vocab, a.classes)
            trainer = build_trainer(Path(tmp), a, by_name[a.only].args)
            trainer.train_step([make_sample(a, trainer.device)])  # optimizer state allocated
            reset_peak_rss()
            for _ in range(3):
                trainer.train_step([make_sample(a, trainer.device)])
        print(f"peak_rss_mib={peak_rss_mib():.1f}")
        return

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        write_dicts(Path(tmp), a.vocab, a.classes)
        trainers = {row.name: build_trainer(Path(tmp), a, row.args) for row in rows}
        times: dict[str, list[float]] = {row.name: [] for row in rows}
        peak: dict[str, float] = {}
        for trainer in trainers.values():  # warm-up
            trainer.train_step([make_sample(a, trainer.device)])
        for _ in range(a.rounds):
            for name, trainer in trainers.items():
                sample = make_sample(a, trainer.device)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(a.updates):
                    start = time.perf_counter()
                    trainer.train_step([sample])
                    if cuda:
                        torch.cuda.synchronize()
                    times[name].append(time.perf_counter() - start)
                if cuda:
                    peak[name] = torch.cuda.max_memory_allocated() / 2**20

    if not cuda and not a.no_memory:
        peak = {row.name: cpu_peak_rss_mib(row) for row in rows}
    median = {name: statistics.median(t) for name, t in times.items()}
    base = median[rows[0].name]
    base_mem = peak.get(rows[0].name)
    device = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"\nmodel: {a.layers} layers x {a.dim}, batch {a.batch} x {a.length} tokens, {device}")
    print(f"{a.rounds} rounds x {a.updates} updates per method, median seconds per update\n")
    kind = "GPU max allocated" if cuda else "CPU peak RSS during updates"
    precisions = sorted({row.precision for row in rows}, key=list(PRECISIONS).index)
    vs_fp32 = len(precisions) > 1 and "fp32" in precisions
    first = "CE" if rows[0].key == "ce" else rows[0].label.split(" [")[0]
    first += f" {rows[0].precision}" if len(precisions) > 1 else ""
    extra = " ratio to the method in fp32 |" if vs_fp32 else ""
    print(f"| method | s/update | ratio to {first} | peak MiB ({kind}) | ratio |{extra}")
    print("|---|---|---|---|---|" + ("---|" if vs_fp32 else ""))
    for row in rows:
        med = median[row.name]
        mem = f"{peak[row.name]:.0f}" if row.name in peak else "not measured"
        mem_ratio = f"{peak[row.name] / base_mem:.2f}x" if row.name in peak and base_mem else "-"
        line = f"| {row.label} | {med:.3f} | {med / base:.2f}x | {mem} | {mem_ratio} |"
        if vs_fp32:
            fp32 = median.get(f"{row.key}@fp32")
            line += f" {med / fp32:.2f}x |" if fp32 else " - |"
        print(line)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
