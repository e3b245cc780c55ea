"""The early-exit bundle's runner against ``acl-fairseq-predict --backend onnxruntime`` on the
same bundle: what each needs installed, how long a process takes from its start to its first
label, and sentences/s at batch 1 and 32.

* **installed size**: the files on disk of each side's distributions and everything they
  require (``importlib.metadata``, extras left out): the runner's ``numpy``, ``onnxruntime``,
  ``tokenizers`` against predict's ``torch`` and ``fairseq`` (the plugin itself, with its own
  numpy, sentencepiece and tokenizers, not counted on either side); a requirement not installed
  here is named;
* **cold start**: one sentence on stdin, from the process's start to the first output line
  (wall clock), and the whole process's CPU time (user + sys); the segments are already
  exported (predict reads the same cached files the bundle copied);
* **throughput**: each command's own summary line (both time the same way: after one untimed
  warm-up forward, tokenization left out) on ``--sentences``, at batch 1 and 32.

Rounds alternate the two commands; medians over ``--rounds``. ``--threads`` is each side's
intra-op thread count (``OMP_NUM_THREADS`` for predict's torch, ``--threads`` for the runner)::

    python -m benchmarks.bundle_runner CKPT --sentences test.txt --dtype int8 --policy saved \\
        --work bundle_bench --rounds 5 --threads 1
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

RUNNER_NEEDS = ("numpy", "onnxruntime", "tokenizers")
PREDICT_NEEDS = ("torch", "fairseq-fixed")
RATE = re.compile(r"([0-9.]+) sentences/s")


def closure(names: tuple[str, ...]) -> tuple[dict[str, int], list[str]]:
    """``({distribution: bytes on disk}, [requirements not installed])`` of ``names`` and all
    they require (no extras)."""
    sizes: dict[str, int] = {}
    missing: list[str] = []
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in sizes or name in missing:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        files = [Path(dist.locate_file(f)) for f in dist.files or []]
        sizes[name] = sum(p.stat().st_size for p in files if p.is_file())
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sizes, sorted(missing)


def first_line(cmd: list[str], stdin: str, env: dict[str, str]) -> tuple[float, float]:
    """``(seconds to the first stdout line, CPU seconds of the process)`` of ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # stderr to a file: a full stderr pipe would block the child before its first line.
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
        line = proc.stdout.readline()
        seconds = time.perf_counter() - start
        proc.stdout.read()
        proc.stdout.close()
        proc.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        log.seek(0)
        err = log.read()
    if proc.returncode or not line:
        raise SystemExit(f"{' '.join(cmd)} failed: {err[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, cpu


def rate(cmd: list[str], stdin: str, env: dict[str, str]) -> float:
    """The sentences/s of ``cmd``'s own summary line."""
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env)
    found = RATE.search(done.stderr)
    if done.returncode or not found:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    return float(found.group(1))


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--sentences", required=True, help="one sentence per line")
    p.add_argument("--dtype", default="int8", choices=("fp32", "int8"))
    p.add_argument("--policy", default="saved")
    p.add_argument("--work", default="bundle_bench", help="the bundle's folder is WORK/bundle")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    for title, names in (("runner", RUNNER_NEEDS), ("predict", PREDICT_NEEDS)):
        sizes, missing = closure(names)
        listed = ", ".join(f"{n} {mib(s)}" for n, s in sorted(sizes.items(), key=lambda x: -x[1]))
        absent = f"; not installed: {', '.join(missing)}" if missing else ""
        total = mib(sum(sizes.values()))
        print(f"{title} needs {', '.join(names)}: {total} installed ({listed}){absent}")

    bundle = Path(args.work) / "bundle"
    flags = ["--dtype", args.dtype, "--policy", args.policy]
    if not (bundle / "bundle.json").is_file():
        subprocess.run([sys.executable, "-m", "acl_fairseq.cli.bundle", args.checkpoint,
                        str(bundle), *flags], check=True)  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    runner = [sys.executable, str(bundle / "run.py"), "--threads", str(args.threads)]
    predict = [sys.executable, "-m", "acl_fairseq.cli.predict", args.checkpoint,
               "--backend", "onnxruntime", *flags]  # fmt: skip
    text = Path(args.sentences).read_text(encoding="utf-8")
    one = text.splitlines(keepends=True)[0]
    cold: dict[str, list[tuple[float, float]]] = {"runner": [], "predict": []}
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, cmd in (("runner", runner), ("predict", predict)):
            cold[name].append(first_line(cmd, one, env))
            for batch in (1, 32):
                got = rate([*cmd, "--batch-size", str(batch)], text, env)
                rates.setdefault((name, batch), []).append(got)
    count = len(text.splitlines())
    print(f"\n{args.rounds} rounds, {args.threads} thread(s), {count} sentences, {args.dtype}, "
          f"policy {args.policy}; medians (min-max)\n")  # fmt: skip
    print(
        "| | cold start to first label, wall | its CPU (user+sys) | batch 1, sentences/s "
        "| batch 32, sentences/s |\n|---|---|---|---|---|"
    )
    for name in ("runner", "predict"):
        wall = [w for w, _ in cold[name]]
        cpu = [c for _, c in cold[name]]
        cells = [f"{statistics.median(v):.2f} s ({min(v):.2f}-{max(v):.2f})" for v in (wall, cpu)]
        for batch in (1, 32):
            v = rates[name, batch]
            cells.append(f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
