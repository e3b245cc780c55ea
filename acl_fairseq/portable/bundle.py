"""An early-exit bundle loaded and run: raw text in, label, probability and exit layer out, with
numpy, onnxruntime and tokenizers only.

A bundle (written by ``acl-fairseq-bundle``) is one folder: ``bundle.json`` (what runs: the
policy's rule, the segments, the labels, the framing of the ids, the weights' fingerprint),
``tokenizer.json`` (the training data's encoding as a ``tokenizers`` tokenizer),
``segments/*.onnx`` (the model cut at the policy's exits, fp32 or int8) and a copy of this
package. ``Bundle(folder).predict(texts)`` gives ``Prediction``s; ``main`` is the command
(``python BUNDLE/run.py``), whose output lines are ``acl-fairseq-predict``'s.

The ids are the project's encoder's: the tokenizer's ids past the dictionary (tokens it lacks)
are its ``<unk>``, and an input longer than the model's positions is cut when the checkpoint
was trained so (``truncate``), else refused with its line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import numpy as np

from .decide import Decision
from .lines import (
    InputError,
    answers,
    blank_lines,
    blank_note,
    check_inputs,
    collate,
    length_batches,
    output_lines,
    parse_columns,
    read_input,
    read_rows,
    summary,
    warm_up,
    with_blanks,
)
from .ort_loop import INT8_DISABLED, run_early_exit, session

__all__ = ["BUNDLE_FILE", "FORMAT", "Bundle", "BundleError", "Prediction", "main"]

BUNDLE_FILE = "bundle.json"
FORMAT = 1
"""The bundle's layout version: a runner reads only its own."""
PROG = "early-exit-runner"
STREAMS = ("stdin", "stdout", "stderr")


class BundleError(ValueError):
    """A folder that is not a bundle this runner reads, or an input it cannot take."""


class Prediction(NamedTuple):
    """One example's answer."""

    label: str
    probability: float  # the softmax probability of ``label`` at the exit it was taken from
    exit_layer: int  # the 1-based layer of that exit


def default_threads() -> int:
    """``OMP_NUM_THREADS`` when set (as torch reads it), else the CPUs this process may use."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def read_config(folder: Path) -> dict[str, Any]:
    """``folder/bundle.json``, checked to be a bundle of this runner's ``FORMAT``."""
    path = folder / BUNDLE_FILE
    if not path.is_file():
        raise BundleError(f"{folder}: no {BUNDLE_FILE}; give the folder acl-fairseq-bundle wrote")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: not a bundle's file ({e})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else None
        raise BundleError(
            f"{path}: bundle format {found!r}, this runner reads {FORMAT}: run the runner the "
            "bundle carries (python BUNDLE/run.py)"
        )
    return config


class Bundle:
    """The bundle in ``folder``, its sessions made: ``threads`` intra-op threads each (default
    ``default_threads``); ``shared_pool``: on the process's global ONNX Runtime thread pool
    (faster on several threads; every session the process makes afterwards runs on it: the
    command's own process, not a library call's)."""

    def __init__(
        self, folder: str | Path, threads: int | None = None, shared_pool: bool = False
    ) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        config = read_config(self.folder)
        self.config = config
        try:
            self.labels: list[str] = list(config["labels"])
            self.num_inputs = int(config["num_inputs"])
            self.num_layers = int(config["num_layers"])
            self.pad, self.unk = int(config["pad"]), int(config["unk"])
            self.dictionary_size = int(config["dictionary_size"])
            self.max_positions, self.truncate = int(config["max_positions"]), config["truncate"]
            self.policy: str | None = config["policy"]
            rule = config["rule"]
            segments = [(int(s["layer"]), self.folder / s["file"]) for s in config["segments"]]
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(
                f"{self.folder / BUNDLE_FILE}: a field is missing or bad ({e})"
            ) from None
        self.decision = Decision(rule) if rule is not None else None
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.threads = threads or default_threads()
        disabled = INT8_DISABLED if config.get("dtype") == "int8" else ()
        self.segments = [
            (layer, session(path, self.threads, False, shared_pool, disabled))
            for layer, path in segments
        ]

    def encode(self, texts: Sequence[str], where: str = "input") -> np.ndarray:
        """One example's texts (one, or two for a pair) -> its ids (1-D int64), as the
        project's encoder gives them; ``where`` names the example in errors."""
        if len(texts) != self.num_inputs:
            raise BundleError(f"{where}: {len(texts)} text(s) for a model of {self.num_inputs}")
        encoding = self.tokenizer.encode(*texts)
        return self._ids(encoding.ids, where)

    def _ids(self, ids: Sequence[int], where: str) -> np.ndarray:
        tokens = np.asarray(ids, dtype=np.int64)
        tokens[tokens >= self.dictionary_size] = self.unk  # tokens the dictionary lacks
        if tokens.size > self.max_positions:
            if not self.truncate:
                raise BundleError(
                    f"{where}: {tokens.size} tokens, more than the model's {self.max_positions} "
                    "positions (the checkpoint was not trained with --shorten-method "
                    "truncate): shorten it"
                )
            tokens = tokens[: self.max_positions]
        return tokens

    def encode_rows(self, rows: Sequence[Any], source: str) -> list[np.ndarray]:
        """``lines.InputRow``s -> their ids (the tokenizer's batch call), errors naming the
        line."""
        inputs = [row.texts[0] if self.num_inputs == 1 else tuple(row.texts) for row in rows]
        encodings = self.tokenizer.encode_batch(inputs) if inputs else []
        return [self._ids(e.ids, f"{source} line {row.line}") for row, e in zip(rows, encodings)]

    def run(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One batch (B x T ids, ``pad`` at padding) -> ``(logits B x K, exit layers B)``."""
        result = run_early_exit(self.segments, tokens, self.pad, self.decision, self.num_layers)
        return result.logits, result.exit_layers

    def run_all(self, examples: Sequence[np.ndarray], batch_size: int = 32) -> tuple:
        """Every example's ``(logits K, exit layer)``, in their order: batches by length
        (``lines.length_batches``), as ``acl-fairseq-predict`` forms them."""
        logits: list[Any] = [None] * len(examples)
        layers = [0] * len(examples)
        for ids in length_batches([len(e) for e in examples], batch_size):
            batch_logits, batch_layers = self.run(collate([examples[i] for i in ids], self.pad))
            for i, row, layer in zip(ids, batch_logits, batch_layers.tolist()):
                logits[i], layers[i] = row, layer
        return logits, layers

    def predict(self, examples: Sequence[Any], batch_size: int = 32) -> list[Prediction]:
        """``Prediction`` of each example: a text, or a pair of texts for a pair model."""
        ids = [
            self.encode([e] if isinstance(e, str) else list(e), f"example {i + 1}")
            for i, e in enumerate(examples)
        ]
        logits, layers = self.run_all(ids, batch_size)
        if not ids:
            return []
        best, top = answers(np.stack(logits))
        return [Prediction(self.labels[b], p, n) for b, p, n in zip(best, top, layers)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Classify raw text (one example per line) with an early-exit bundle: "
        "label<TAB>probability<TAB>exit_layer per line, as acl-fairseq-predict prints them.",
    )
    p.add_argument("bundle", help="the folder acl-fairseq-bundle wrote")
    p.add_argument("--input", default="-", help="text file, one example per line; - is stdin")
    p.add_argument(
        "--text-columns", help="read the input as TSV: its 1-based text column(s), e.g. 1,2"
    )
    p.add_argument("--header", action="store_true", help="skip the first input line")
    p.add_argument("--batch-size", type=int, default=32, help="examples per forward pass")
    p.add_argument(
        "--threads", type=int, help="intra-op threads (default: OMP_NUM_THREADS, else the CPUs)"
    )
    return p


def run_main(args: argparse.Namespace, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    columns = parse_columns(args.text_columns)
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads is not None and args.threads < 1:
        raise InputError(f"--threads must be >= 1, got {args.threads}")
    bundle = Bundle(args.bundle, args.threads, shared_pool=True)
    source = "stdin" if args.input == "-" else args.input
    rows = read_rows(read_input(args.input, stdin), source, columns, args.header)
    check_inputs(rows, bundle.num_inputs, source, args.bundle, columns)
    blank = set(blank_lines(rows))  # not classified, as predict
    if blank:
        stderr.write(f"{PROG}: {blank_note(sorted(blank))}\n")
    examples = bundle.encode_rows([row for row in rows if row.line not in blank], source)
    bundle.run_all(warm_up(examples, args.batch_size), args.batch_size)  # untimed, as predict
    start = time.perf_counter()
    logits, layers = bundle.run_all(examples, args.batch_size)
    seconds = time.perf_counter() - start
    lines = output_lines(logits, layers, bundle.labels) if examples else []
    stdout.write("".join(f"{line}\n" for line in with_blanks(rows, blank, lines)))
    stdout.flush()
    done = summary(len(lines), seconds, layers, bundle.num_layers, bundle.policy or "full depth")
    stderr.write(f"{PROG}: {done}\n")
    return 0


def main(argv: Sequence[str] | None = None, **streams: TextIO) -> int:
    """The command on ``streams`` (``stdin``, ``stdout``, ``stderr``; default: the process's);
    an error in the input or the bundle is one line, ``PROG: error: ...``, and status 2."""
    args = build_parser().parse_args(argv)
    stdin, stdout, stderr = (streams.get(name) or getattr(sys, name) for name in STREAMS)
    try:
        return run_main(args, stdin, stdout, stderr)
    except (InputError, BundleError) as e:
        stderr.write(f"{PROG}: error: {e}\n")
        return 2
