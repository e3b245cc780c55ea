"""A fine-tuned checkpoint as a self-contained early-exit bundle: one folder that runs with
numpy, onnxruntime and tokenizers only (``acl-fairseq-bundle``).

What runs is what ``acl-fairseq-predict --backend onnxruntime`` runs on the same checkpoint:
the loader's plan (``load_for_inference(request=Request(backend="onnxruntime", ...))``: the
precision, the policy asked for or saved by the sweep, and why) and the ONNX segments of that
policy's exits at that precision (``runtime.onnx_runtime.OrtEarlyExit``, the same cached
files). The folder (``portable.bundle`` reads it):

* ``bundle.json``: the policy (its spec and its rule table, ``portable.decide``), the segments,
  the labels, the ids' framing (padding, ``<unk>``, the dictionary's size, the positions and
  whether long inputs are cut), the checkpoint's name and weights' fingerprint;
* ``tokenizer.json``: the training data's encoding (``data.tokenizer.hf_json``);
* ``segments/layersF-L.TAG.onnx``;
* ``early_exit_runner/``: a verbatim copy of ``acl_fairseq/portable`` (the runner), ``run.py``
  (``python BUNDLE/run.py < in.txt``) and ``pyproject.toml`` (``pip install ./BUNDLE``: the
  runner and its command ``early-exit-runner``, requiring numpy, onnxruntime, tokenizers).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import portable
from ..data.tokenizer.hf_json import Framing, hf_tokenizer
from ..data.tokenizer.kinds import TokenizerConfig
from ..errors import AclValueError
from ..models.heads import DEFAULT_HEAD
from ..portable.bundle import BUNDLE_FILE, FORMAT
from ..runtime.onnx_runtime import segment_tag, weight_bits
from .loader import load_for_inference
from .plan import Request

__all__ = ["RUNNER", "BundleError", "BundleSummary", "write_bundle"]

RUNNER = "early_exit_runner"
"""The package name of the runner's copy in a bundle."""
REQUIREMENTS = ("numpy", "onnxruntime", "tokenizers")

RUN_PY = f'''"""Runs this bundle: python run.py [--input FILE] [--text-columns 1,2] [--batch-size N]
(needs only {", ".join(REQUIREMENTS)}); one line per input line: label, probability, exit."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from {RUNNER}.bundle import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main([str(HERE), *sys.argv[1:]]))
'''

PYPROJECT = f"""[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "early-exit-runner"
version = "{FORMAT}.0"
description = "Runs acl-fairseq early-exit bundles with numpy, onnxruntime and tokenizers"
requires-python = ">=3.10"
dependencies = [{", ".join(f'"{r}"' for r in REQUIREMENTS)}]

[project.scripts]
early-exit-runner = "{RUNNER}.bundle:main"

[tool.setuptools]
packages = ["{RUNNER}"]
"""


class BundleError(AclValueError):
    """A checkpoint or folder that cannot be bundled; the message names it and the fix."""


@dataclass
class BundleSummary:
    """What ``write_bundle`` wrote."""

    out_dir: Path
    policy: str | None  # the policy's spec; None: full depth
    why: str  # the plan's line: which policy and why
    dtype: str
    exits: list[int]  # the layers a segment ends at, the last one included
    files: list[str]
    size: int  # bytes in the folder


def write_bundle(
    checkpoint: str | Path,
    out_dir: str | Path,
    dtype: str | None = None,
    policy: str | None = None,
    data: str | Path | None = None,
    head: str = DEFAULT_HEAD,
    onnx_cache: str | Path | None = None,
) -> BundleSummary:
    """Writes the bundle of ``checkpoint`` into ``out_dir`` (new, or empty): ``dtype`` (fp32,
    int8) and ``policy`` (a spec, ``saved`` or ``none``) as predict's ``--dtype`` and
    ``--policy`` with ``--backend onnxruntime`` (None: the saved choice, else fp32 and full
    depth); ``data``: the prepared folder (default: the checkpoint's own); ``head``: the
    classification head; ``onnx_cache``: the segments' cache (default:
    ``onnx_runtime/`` next to the checkpoint, predict's)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(f"{out} exists and is not an empty folder: give a new folder")
    request = Request("onnxruntime", dtype, policy)
    loaded = load_for_inference(
        checkpoint, data, "cpu", label_order=False, request=request, text="required"
    )
    plan, task, examples = loaded.plan, loaded.task, loaded.examples
    assert plan is not None and examples is not None and loaded.meta is not None
    if loaded.regression or loaded.labels is None:
        raise BundleError(f"{checkpoint} is a regression model: a bundle runs classifiers")
    if head not in loaded.model.classification_heads:
        raise BundleError(f"--head {head}: not in {checkpoint}")
    rule = plan.policy.rule() if plan.policy is not None else None
    if plan.policy is not None and rule is None:
        raise BundleError(f"policy {plan.policy.spec}: its kind has no rule a bundle can run")
    runner = loaded.runner(head, onnx_cache)
    try:
        spans = runner.spans(runner.exits_of(plan.policy) if plan.policy is not None else ())
    except ValueError as e:  # a policy naming an exit the model lacks
        raise BundleError(f"--policy: {e}") from None
    dictionary = task.source_dictionary
    framing = Framing(examples.init_token, examples.separator_token, dictionary.eos())
    tokenizer = hf_tokenizer(
        TokenizerConfig(**loaded.meta["tokenizer"]), dictionary.symbols, framing
    )

    work = out.parent / f".{out.name}.partial-{os.getpid()}"  # renamed to ``out`` when whole
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        segments = _write(work, runner, spans, tokenizer)
        fields = _fields(checkpoint, loaded, head, rule, segments, runner.num_layers)
        text = json.dumps(fields, indent=2, allow_nan=False) + "\n"
        (work / BUNDLE_FILE).write_text(text, encoding="utf-8")
        work.rename(out)  # replaces an empty folder
    finally:
        shutil.rmtree(work, ignore_errors=True)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    return BundleSummary(
        out_dir=out,
        policy=fields["policy"],
        why=plan.why,
        dtype=plan.dtype,
        exits=[last for _, last in spans],
        files=files,
        size=sum((out / f).stat().st_size for f in files),
    )


def _write(out: Path, runner: Any, spans: list[tuple[int, int]], tokenizer: Any) -> list[dict]:
    """The segments (exported once, cached for predict too), the tokenizer and the runner into
    ``out``; returns the segments' entries of ``bundle.json``."""
    (out / "segments").mkdir()
    segments = []
    for first, last in spans:
        source = runner.segment_file(first, last)
        shutil.copyfile(source, out / "segments" / source.name)
        segments.append({"layer": last, "file": f"segments/{source.name}"})
    tokenizer.backend.save(str(out / "tokenizer.json"))
    _copy_runner(out / RUNNER)
    (out / "run.py").write_text(RUN_PY, encoding="utf-8")
    (out / "pyproject.toml").write_text(PYPROJECT, encoding="utf-8")
    return segments


def _fields(
    checkpoint: Any, loaded: Any, head: str, rule: Any, segments: list, num_layers: int
) -> dict[str, Any]:
    """``bundle.json``: what runs and how the ids are framed (``portable.bundle`` reads it)."""
    plan, examples, dictionary = loaded.plan, loaded.examples, loaded.task.source_dictionary
    return {
        "format": FORMAT,
        "checkpoint": Path(checkpoint).name,
        "fingerprint": loaded.fingerprint,
        "head": head,
        "dtype": plan.dtype,
        "segment_tag": segment_tag(plan.dtype),
        "weight_bits": weight_bits() if plan.dtype == "int8" else 32,
        "policy": plan.policy.spec if plan.policy is not None else None,
        "why": plan.why.replace(str(Path(checkpoint).resolve().parent) + os.sep, "").replace(
            str(Path(checkpoint).parent) + os.sep, ""
        ),  # the policy file's name, not the folder it was read from on this machine
        "rule": rule,
        "segments": segments,
        "num_layers": num_layers,
        "labels": list(loaded.labels),
        "num_inputs": examples.num_inputs,
        "pad": dictionary.pad(),
        "unk": dictionary.unk(),
        "dictionary_size": len(dictionary),
        "max_positions": examples.max_positions,
        "truncate": examples.truncate,
    }


def _copy_runner(target: Path) -> None:
    """The runner's modules (``acl_fairseq/portable/*.py``), copied verbatim."""
    target.mkdir()
    for source in sorted(Path(portable.__file__).parent.glob("*.py")):
        shutil.copyfile(source, target / source.name)
