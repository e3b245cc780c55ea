"""Every file the tools write survives a failed write: at each write, killed mid-write, killed
after the write but before its rename, killed after the rename, and a full disk mid-write, the
file is the old one, intact, or the new one, whole (acl_fairseq/atomic_write.py).

Each write runs in a child forked from this process (torch, fairseq and the tiny model already
loaded), over an old file the same writer wrote: the kills are ``kill -9`` at the moment
(``os.replace`` and the folder's flush patched to kill the child) or, mid-write, the kernel's
own kill at a file-size limit (``RLIMIT_FSIZE`` with ``SIGXFSZ`` at its default: the process
dies inside the write, no clean-up runs); the full disk is that limit with ``SIGXFSZ``
ignored (the write fails with ``EFBIG``, as with ``ulimit -f``; a full disk gives ``ENOSPC``,
the same path). The table is the one in docs/results.md ("Writes under faults").
"""

from __future__ import annotations

import functools
import math
import os
import re
import resource
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from acl_fairseq import atomic_write, fairseq_patches
from acl_fairseq.atomic_write import TMP_SUFFIX
from acl_fairseq.early_exit.learned import LearnedPolicy
from acl_fairseq.early_exit.policies import EntropyPolicy
from acl_fairseq.early_exit.table import COLUMNS, read_sweep, write_table
from acl_fairseq.experiment.fewshot import DrawResult
from acl_fairseq.experiment.predictions import SplitPredictions, write_predictions
from acl_fairseq.experiment.results import write_result
from acl_fairseq.inference.saved_policy import read_policy, write_policy

from fairseq_helpers import REPO
from tiny_models import build_with_task, write_dicts

RESULTS = REPO / "docs" / "results.md"


@dataclass(frozen=True)
class Writer:
    """One write of a tool: ``write(folder, version)`` writes version 0 (old) or 1 (new) of
    ``name`` in ``folder``; ``read(path)`` reads it back (raises on a damaged file)."""

    label: str
    name: str
    write: Callable[[Path, int], object]
    read: Callable[[Path], object]
    replaces: bool = True  # False: written once, where none is (the old file is no file)


def _policy(folder: Path, version: int) -> None:
    # the new file is longer than the old: a cut new file is not the old one
    policy = EntropyPolicy(0.25) if not version else LearnedPolicy(0.5, (0.1,) * 6, 0.2)
    notes = {"note": "x" * (40 if not version else 4000)}
    write_policy(folder / "checkpoint_best.pt", policy, dtype="fp32", **notes)


def _table(folder: Path, version: int) -> None:
    row = {key: 1.0 for key in COLUMNS} | {"policy": "entropy", "threshold": 0.5, "dtype": "fp32"}
    row["exit_share"] = {1: 0.25, 4: 0.75}
    write_table([row] * (3 if not version else 300), folder / "sweep.tsv")


def _result(folder: Path, version: int) -> None:
    write_result(
        folder, {"method": "acl", "test": {"accuracy": 50.0 + version}, "pad": "x" * 4000 * version}
    )


def _fewshot(folder: Path, version: int) -> None:
    from acl_fairseq.cli.fewshot.cli import write_report

    results = [
        DrawResult(8, draw, method, {1e-3: 70.0 + draw + version}, {1e-3: 60.0 + draw})
        for draw in range(2 + 20 * version)
        for method in ("ce", "acl")
    ]
    write_report(folder, results, 100)


def _record(folder: Path, version: int) -> None:
    from acl_fairseq.cli.fewshot.cli import PROG, build_parser
    from acl_fairseq.cli.fewshot.record import check_and_record

    tsv = folder / "pool.tsv"
    if not tsv.is_file():
        tsv.write_text("a\tpos\nb\tneg\n", encoding="utf-8")
    argv = [str(tsv), "--test-size", "1", "--out", str(folder)]
    parse = build_parser().parse_args
    grid = {"sizes": [8] * (1 + 500 * version)}  # a later run's grid: a longer record
    check_and_record(folder, parse(argv), argv, grid, parse, PROG)


def _predictions(folder: Path, version: int) -> None:
    n = 4 if not version else 400
    split = SplitPredictions("test", [0] * n, {1: [1] * n, 2: [0] * n})
    write_predictions(folder / "predictions.tsv", [split])


def _plot(folder: Path, version: int) -> None:
    import matplotlib.pyplot as plt

    from acl_fairseq.cli.plots.figures import save_plot

    fig, ax = plt.subplots()
    points = 3 if not version else 300
    ax.plot(range(points), [math.sin(i) for i in range(points)])
    save_plot(fig, folder, "angles", ["x", "y"], [(i, math.sin(i)) for i in range(points)])


def _read_plot(path: Path) -> object:
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def _read_json(path: Path) -> object:
    import json

    return json.loads(path.read_text(encoding="utf-8"))


def _read_lines(path: Path) -> object:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return text.splitlines()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny 4-layer multi-exit model with random weights, its task and WordPiece config."""
    from acl_fairseq.data.tokenizer.kinds import TokenizerConfig

    root = write_dicts(tmp_path_factory.mktemp("tiny"))
    words = [f"w{i}" for i in range(30)]
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (root / "vocab.txt").write_text("".join(f"{t}\n" for t in [*specials, *words]))
    model, task = build_with_task(root)
    return model, task, TokenizerConfig("wordpiece", vocab=str(root / "vocab.txt"))


def _export(tiny) -> Callable[[Path, int], None]:
    from acl_fairseq.data.tokenizer.hf_json import Framing
    from acl_fairseq.hf_bert.export import export_model

    model, task, config = tiny

    def write(folder: Path, version: int) -> None:
        framing = Framing(init=0, separator=None, eos=task.source_dictionary.eos())
        layer = 2 + 2 * version  # the new export holds more layers than the old
        export_model(model, folder, config, task.source_dictionary.symbols, framing, 64,
                     ["0", "1", "2"], layer=layer)  # fmt: skip

    return write


def _read_safetensors(path: Path) -> object:
    from safetensors.torch import load_file

    return load_file(str(path))


def _onnx(tiny) -> Callable[[Path, int], None]:
    from acl_fairseq.runtime.onnx_runtime import OrtEarlyExit

    model = tiny[0]

    def write(folder: Path, version: int) -> None:
        runner = OrtEarlyExit(model, "sentence_classification_head", folder, threads=1)
        runner.folder = folder  # the segment's file by its own name, in the test's folder
        runner.segment_file(1, 2)

    return write


def _read_onnx(path: Path) -> object:
    import onnx

    return onnx.checker.check_model(onnx.load(str(path)))


def _checkpoint(folder: Path, version: int) -> None:
    from fairseq import checkpoint_utils

    fairseq_patches.mark_in_use("test")  # the guard rails act: a plugin run
    state = {"model": {"w": torch.full((10 + 40000 * version,), float(version))}}
    checkpoint_utils.torch_persistent_save(state, str(folder / "checkpoint_last.pt"))


def _read_checkpoint(path: Path) -> object:
    return torch.load(path, map_location="cpu", weights_only=True)


def writers(tiny) -> list[Writer]:
    return [
        Writer("acl-fairseq-sweep: early_exit_policy.json", "early_exit_policy.json", _policy,
               lambda p: read_policy(p.parent)),
        Writer("acl-fairseq-sweep --out: the table", "sweep.tsv", _table, read_sweep),
        Writer("acl-fairseq-compare: runs/*/test.json", "test.json", _result, _read_json),
        Writer("acl-fairseq-compare --predictions: predictions.tsv", "predictions.tsv",
               _predictions, _read_lines),
        Writer("acl-fairseq-fewshot: fewshot.json", "fewshot.json", _fewshot, _read_json),
        Writer("acl-fairseq-fewshot: fewshot.md", "fewshot.md", _fewshot, _read_lines),
        Writer("acl-fairseq-fewshot: its record", "fewshot_input.json", _record, _read_json),
        Writer("acl-fairseq-plots: a plot (.png)", "angles.png", _plot, _read_plot),
        Writer("acl-fairseq-plots: its numbers (.csv)", "angles.csv", _plot, _read_lines),
        Writer("acl-fairseq-export-hf: model.safetensors", "model.safetensors", _export(tiny),
               _read_safetensors),
        Writer("acl-fairseq-export-hf: config.json", "config.json", _export(tiny), _read_json),
        Writer("ONNX Runtime backend: a cached segment", "layers1-2.fp32.onnx", _onnx(tiny),
               _read_onnx, replaces=False),
        Writer("fairseq-train: a checkpoint", "checkpoint_last.pt", _checkpoint,
               _read_checkpoint),
    ]  # fmt: skip


# (moment, what the child does)
MOMENTS = (
    ("killed mid-write (at half the new file)", "limit_kill"),
    ("kill -9 once written, before the rename", "kill_before_rename"),
    ("kill -9 after the rename", "kill_after_rename"),
    ("disk full mid-write (write fails: EFBIG)", "limit_fail"),
)


def _kill_self(*_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def in_child(action: Callable[[], object], fault: str, limit: int) -> tuple[int | None, str]:
    """Runs ``action`` in a forked child under ``fault``; ``(signal that ended it or None, its
    error as 'Kind: message', or '')``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        message = ""
        try:
            torch.set_num_threads(1)
            if fault.startswith("limit"):
                handler = signal.SIG_DFL if fault == "limit_kill" else signal.SIG_IGN
                signal.signal(signal.SIGXFSZ, handler)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            elif fault == "kill_before_rename":
                os.replace = lambda *_: _kill_self()  # type: ignore[assignment]
            elif fault == "kill_after_rename":
                atomic_write._fsync_dir = _kill_self  # type: ignore[assignment]
            action()
        except BaseException as e:  # noqa: BLE001  (reported to the parent)
            message = f"{type(e).__name__}: {e}"
        os.write(write_end, message.encode("utf-8", "replace"))
        os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    killed = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return killed, b"".join(chunks).decode("utf-8")


def test_every_write_leaves_the_old_file_or_the_new_one_whole(tiny, tmp_path):
    rows, failures = [], []
    for number, w in enumerate(writers(tiny)):
        reference = tmp_path / f"{number}-new"
        reference.mkdir()
        w.write(reference, 1)
        limit = len((reference / w.name).read_bytes()) // 2  # half the new file
        for moment, fault in MOMENTS:
            folder = tmp_path / f"{number}-{fault}"
            folder.mkdir()
            if w.replaces:
                w.write(folder, 0)
            path = folder / w.name
            old = path.read_bytes() if w.replaces else None
            killed, error = in_child(functools.partial(w.write, folder, 1), fault, limit)
            now = path.read_bytes() if path.is_file() else None
            left = sorted(p.name for p in folder.iterdir() if p.name.endswith(TMP_SUFFIX))
            try:  # what is there after the fault reads back (no file: nothing to read)
                readable = now is None or w.read(path) is not None or True
            except Exception:  # noqa: BLE001
                readable = False
            w.write(folder, 1)  # the new file, written without a fault where the child wrote
            intact, whole = now == old, now == path.read_bytes()
            problems = []
            if fault.startswith("kill") and killed != signal.SIGKILL:
                problems.append(f"not killed ({killed}, {error!r})")
            if fault == "limit_kill" and killed != signal.SIGXFSZ:
                problems.append(f"not killed mid-write ({killed}, {error!r})")
            if not ((intact or whole) and readable):
                problems.append("the file is neither the old one nor the new one, whole")
            if fault == "limit_fail":
                first = error.splitlines()[0] if error else ""
                if not (first.startswith("AclOSError: cannot write") and "ulimit -f" in first):
                    problems.append(f"not one line naming the limit: {error[:300]!r}")
                if left:
                    problems.append(f"left {left}")
            if problems:
                failures.append(f"{w.label}, {moment}: {'; '.join(problems)}")
            note = f" ({', '.join(left)} left)" if left else ""
            if w.replaces:
                before = "yes" if intact else "no (replaced)" if whole else "no"
            else:
                before = "none, none left" if now is None else "none, replaced" if whole else "no"
            rows.append((w.label, moment, before, "yes" if whole else f"not written{note}"))
    table = ["| write | moment | old file intact? | new file whole? |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    print("\n" + "\n".join(table))
    assert not failures, "\n".join(failures)
    assert "\n".join(table) in RESULTS.read_text(encoding="utf-8"), "docs/results.md's table"


def test_a_full_disk_names_the_disk_and_the_file_left():
    """``ENOSPC`` (a full disk): the file, the disk and its free space, and what is left."""
    import errno

    error = OSError(errno.ENOSPC, "No space left on device")
    line = atomic_write.describe_failure(REPO / "x" / "early_exit_policy.json", error, True)
    assert re.fullmatch(
        rf"cannot write {re.escape(str(REPO))}/x/early_exit_policy.json: no space left on the "
        r"disk \(/\S*: [\d.]+ \S+ free\); \S+early_exit_policy.json is as it was \(the previous "
        r"file, intact\): free space on that disk, or write elsewhere, and run again",
        line,
    ), line
    assert "\n" not in line
