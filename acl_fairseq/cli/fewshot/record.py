"""The record of an ``acl-fairseq-fewshot --out`` folder (``fewshot_input.json``): the settings
its draws and runs depend on, checked on every re-run (a difference is named), and the last
run's grid (what ``--report-only`` reports). An older record without ``settings`` is read from
its ``command`` and ``identity``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shlex
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from acl_fairseq.atomic_write import write_json
from acl_fairseq.errors import AclValueError
from acl_fairseq.experiment.fewshot import protocol_extra

RECORD_FILE = "fewshot_input.json"
OWN = ("raw", "data", "runs", "fewshot.md", "fewshot.json", RECORD_FILE)  # what --force deletes
MODEL_FILES = ("model.pt", "fairseq_args.txt", "dict.txt", "tokenizer.json", "vocab.txt")
FILE_FLAGS = ("--srcdict", "--gpt2-encoder-json", "--gpt2-vocab-bpe", "--vocab", "--spm-model")


class RecordError(AclValueError):
    """An ``--out`` that holds another study, or a record that cannot be read."""


def _sha256(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def file_entry(path: str | Path | None, contents: bool = True) -> dict[str, Any] | None:
    """A file (or a converted model's folder) as ``{"path", "sha256"}``: its contents when
    ``contents`` and it is there, else only where it is (``sha256`` None)."""
    if path is None:
        return None
    path = Path(path)
    files = [path / name for name in MODEL_FILES if (path / name).is_file()] if path.is_dir() else [
        path] if path.is_file() else []  # fmt: skip
    digest = _sha256(files) if contents and files else None
    return {"path": str(path.resolve()), "sha256": digest}


def settings(args: argparse.Namespace, contents: bool = True) -> dict[str, Any]:
    """What the draws' data and the runs' training depend on, by flag: values, and files by
    their contents (``contents``) or else by path. Flags that only add to a study (sizes,
    draws, methods, learning rates) or do not change a result (workers) are not in it."""
    files = {"TSV": file_entry(args.tsv, contents), "--test": file_entry(args.test, contents)}
    tokenizer: dict[str, Any] = {flag: None for flag in ("--tokenizer", *FILE_FLAGS)}
    tokenizer.update({"--lowercase": None, "--spm-vocab-size": None})
    tokenizer["--spm-character-coverage"] = None
    if args.model is None:  # --model brings its own tokenizer (in the folder's entry)
        tokenizer["--tokenizer"] = args.tokenizer
        for flag in FILE_FLAGS:
            tokenizer[flag] = file_entry(getattr(args, flag[2:].replace("-", "_")), contents)
        if args.tokenizer == "wordpiece":
            tokenizer["--lowercase"] = args.lowercase
        if args.tokenizer == "sentencepiece" and args.spm_model is None:  # trained per draw
            tokenizer["--spm-vocab-size"] = args.spm_vocab_size
            tokenizer["--spm-character-coverage"] = args.spm_character_coverage
    restore = args.restore_file
    return {
        **files, "--test-size": args.test_size, "--text-columns": args.text_columns,
        "--label-column": args.label_column, "--header": args.header, **tokenizer,
        "--model": file_entry(args.model, contents),
        "--restore-file": restore if restore in (None, "none") else file_entry(restore, contents),
        "--arch-args-file": file_entry(args.arch_args_file, contents),
        "--arch-args": args.arch_args, "--exit-pooling": args.exit_pooling,
        "--updates": args.updates, "--validate-every": args.validate_every,
        "--batch-size": args.batch_size, "--contrastive-lambda": args.contrastive_lambda,
        "--temperature": args.temperature, "--extra": protocol_extra(args.extra),
        "--cpu": args.cpu,
    }  # fmt: skip


def identity(args: argparse.Namespace) -> dict[str, Any]:
    """The first record's ``identity`` (the input files as given, the split), kept as the
    first versions wrote it, so that they still accept the folder."""
    files = [args.tsv] + ([args.test] if args.test else [])
    return {
        "files": {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
        "split": [args.text_columns, args.label_column, args.header, args.test_size],
    }


def _old_command(record: dict, parse: Callable[[list[str]], argparse.Namespace]):
    """The arguments of a record's ``command`` (``None`` when it does not parse)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parse(shlex.split(record["command"])[1:])
    except (KeyError, ValueError, SystemExit):
        return None


def recorded_settings(
    record: dict, path: Path, parse: Callable[[list[str]], argparse.Namespace]
) -> dict[str, Any]:
    """A record's settings; for a record without them, those of its command with the input
    files' contents from its ``identity``."""
    if "settings" in record:
        return record["settings"]
    old = _old_command(record, parse)
    if old is None:
        raise RecordError(f"{path}: cannot read its command; give another --out or --force")
    found = settings(old, contents=False)
    hashes = list(record.get("identity", {}).get("files", {}).values())
    for flag, digest in zip(("TSV", "--test"), hashes):
        if found[flag] is not None:
            found[flag]["sha256"] = digest
    return found


def _same(then: Any, now: Any) -> bool:
    if isinstance(then, dict) and isinstance(now, dict):
        if then.get("sha256") and now.get("sha256"):
            return then["sha256"] == now["sha256"]
        return then.get("path") == now.get("path")
    return then == now


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return value["path"]
    return str(value)


def differences(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``FLAG: then X, now Y`` for every setting that differs."""
    found = []
    for flag in dict.fromkeys([*then, *now]):
        a, b = then.get(flag), now.get(flag)
        if not _same(a, b):
            changed = " (other contents)" if _shown(a) == _shown(b) else ""
            found.append(f"{flag}: then {_shown(a)}, now {_shown(b)}{changed}")
    return found


def read_record(out: Path) -> dict | None:
    path = out / RECORD_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not a record of acl-fairseq-fewshot ({e})") from None


def check_and_record(
    out: Path,
    args: argparse.Namespace,
    argv: Sequence[str],
    grid: dict[str, Any],
    parse: Callable[[list[str]], argparse.Namespace],
    prog: str,
) -> None:
    """Raises ``RecordError`` when ``out`` holds a study made with other settings (each
    difference named), else records this run's settings (first run) and ``grid``."""
    path = out / RECORD_FILE
    record = read_record(out)
    now = settings(args)
    if record is not None:
        changed = differences(recorded_settings(record, path, parse), now)
        if changed:
            raise RecordError(
                f"--out {out} holds a few-shot study made with other settings "
                f"({'; '.join(changed)}): its draws and runs are not this command's. Pass "
                "--force to delete them and start over, or give another --out"
            )
    else:
        record = {"identity": identity(args), "command": shlex.join([prog, *argv])}
    record.setdefault("settings", now)
    record["grid"] = grid
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, record)


def recorded_grid(out: Path, parse: Callable[[list[str]], argparse.Namespace]) -> dict[str, Any]:
    """The sizes, draws, methods and learning rates of the last run in ``out`` (a record
    without them: those of its command)."""
    record = read_record(out)
    if record is None:
        raise RecordError(f"--out {out}: no {RECORD_FILE} (not a folder of acl-fairseq-fewshot)")
    if "grid" in record:
        return record["grid"]
    old = _old_command(record, parse)
    if old is None:
        raise RecordError(f"{out / RECORD_FILE}: cannot read its command")
    return grid_of(old)


def grid_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"per_class": list(args.per_class), "draws": args.draws,
            "methods": list(args.methods), "lrs": list(args.lrs)}  # fmt: skip


def start_over(out: Path) -> bool:
    """``--force``: deletes what a study wrote in ``out`` (draws, data, runs, tables, record);
    nothing in a folder without its record. Returns whether it deleted."""
    if not (out / RECORD_FILE).is_file():
        return False
    for name in OWN:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    return True
