"""The study's finished runs on disk: links between phases, resuming on another machine.

A phase often reuses a run another phase trained (the seed phase's seed 1 is the grid's run at
the chosen values; a stage-2 variant restores the seed phase's stage-1 run): it *links* the run
(a relative symlink ``OUT/runs/RUN -> ../../OTHER/runs/RUN``) instead of training it again.
``docs/study/links.csv`` records every link (written by ``python -m studies report``), so
:func:`restore` brings back the runs, their links, the choices and the early-exit tables
exactly as they were, and a phase resumed after it trains nothing that is finished.

A stage-2 run needs its stage-1 run's checkpoint, which is never committed: only when a
stage-2 run is still to be trained is a stage-1 run without its checkpoint trained again
(:func:`need_checkpoints`); its committed result is kept beside it and compared with the new
one (:func:`check_retrained`).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from studies.data import REPO

LINKS_FILE = "links.csv"
LINK_COLUMNS = ("folder", "run", "target")  # folder/runs/run -> target/runs/run
RESTORED_SUFFIX = ".restored.json"  # a stage-1 result moved aside while it is trained again


def finished(run_dir: Path) -> bool:
    return (run_dir / "test.json").exists()


def link_run(src_out: Path, dst_out: Path, run: str) -> None:
    """Makes ``dst_out/runs/run`` the finished run of ``src_out`` (compare then skips it)."""
    src = src_out / "runs" / run
    dst = dst_out / "runs" / run
    if dst.exists() or dst.is_symlink():  # linked before (or a run of its own): kept as it is
        return
    if not finished(src):
        raise SystemExit(f"{src} is not finished")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(os.path.relpath(src, dst.parent))


def links(work: Path) -> list[tuple[str, str, str]]:
    """``(folder, run, target folder)`` of every linked run under ``work/runs``, folders
    relative to it (``movie/main``), sorted."""
    root = (work / "runs").resolve()
    rows = []
    for run_dir in sorted(root.glob("**/runs/*")):
        if run_dir.is_symlink():
            target = run_dir.resolve().parent.parent
            folder = run_dir.parent.parent
            rel = str(folder.relative_to(root)), str(target.relative_to(root))
            rows.append((rel[0], run_dir.name, rel[1]))
    return rows


def write_links(work: Path, path: Path) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(LINK_COLUMNS)
        writer.writerows(links(work))


def read_links(path: Path) -> list[tuple[str, str, str]]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8", newline="") as f:
        return [(r["folder"], r["run"], r["target"]) for r in csv.DictReader(f)]


def restore(work: Path, docs: Path) -> int:
    """Puts the committed small results of finished runs (``docs/study``) back under
    ``work/runs``: every run, its links, the choices on dev and the early-exit tables, so
    that a study resumed on another machine does not train them again. Returns the number of
    runs put back (links not counted); what is already there is kept."""
    work = work.resolve()
    count = 0
    for test_json in sorted((docs / "runs").glob("**/test.json")):
        rel = test_json.parent.relative_to(docs / "runs")  # TASK/.../RUN
        dest = work / "runs" / rel.parent / "runs" / rel.name
        if finished(dest):
            continue
        dest.mkdir(parents=True, exist_ok=True)
        for src in test_json.parent.iterdir():
            text = src.read_text(encoding="utf-8").replace("<work>", str(work))
            (dest / src.name).write_text(text.replace("<repo>", str(REPO)), encoding="utf-8")
        (dest / "train.done").write_text("", encoding="utf-8")
        count += 1
    for folder, run, target in read_links(docs / LINKS_FILE):
        link_run(work / "runs" / target, work / "runs" / folder, run)
    for choices in sorted((docs / "choices").glob("*.json")):
        dest = work / "runs" / choices.stem / "choices.json"
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(choices, dest)
    for table in sorted((docs / "earlyexit").glob("*/*")):
        dest = work / "runs" / table.parent.name / "earlyexit" / table.name
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(table, dest)
    return count


def need_checkpoints(out: Path, runs: Iterable[str], dependents: Iterable[Path]) -> list[str]:
    """Makes the stage-1 ``runs`` of ``out`` trainable again when some of ``dependents`` (the
    stage-2 run folders that restore them) is not finished and the run has no checkpoint (it
    was restored from docs/study). Nothing happens when every dependent is finished.

    The run's result is moved aside (``RUN.restored.json`` next to its folder, the link
    target's folder for a linked run) so that acl-fairseq-compare trains it again, with the
    same flags and seed; :func:`check_retrained` then compares the two. Returns the runs made
    trainable.
    """
    if all(finished(d) for d in dependents):
        return []
    again = []
    for name in runs:
        run_dir = (out / "runs" / name).resolve()
        if not finished(run_dir) or (run_dir / "checkpoint_best.pt").exists():
            continue
        print(f"{run_dir}: no checkpoint for its stage-2 runs, training it again", flush=True)
        (run_dir / "test.json").rename(run_dir.parent / f"{name}{RESTORED_SUFFIX}")
        again.append(name)
    return again


def check_retrained(out: Path, runs: Iterable[str]) -> None:
    """Compares the dev and test numbers of runs trained again with their committed ones;
    prints whether they are identical (training is deterministic on one machine and thread
    count, not across machines)."""
    for name in runs:
        run_dir = (out / "runs" / name).resolve()
        old_path = run_dir.parent / f"{name}{RESTORED_SUFFIX}"
        if not (old_path.exists() and finished(run_dir)):
            continue
        old = json.loads(old_path.read_text(encoding="utf-8"))
        new = json.loads((run_dir / "test.json").read_text(encoding="utf-8"))
        same = all(old[k].get("accuracy") == new[k].get("accuracy") for k in ("dev", "test"))
        verdict = "identical" if same else "DIFFERENT (kept the new run)"
        print(
            f"{run_dir}: trained again, dev/test {new['dev']['accuracy']}/"
            f"{new['test']['accuracy']} vs committed {old['dev']['accuracy']}/"
            f"{old['test']['accuracy']}: {verdict}",
            flush=True,
        )
