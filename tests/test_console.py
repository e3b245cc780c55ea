"""The tools report bad input one way: ``PROG: error: MESSAGE`` on stderr, exit status 2
(``acl_fairseq.errors.run_tool``); and every error class of the package is an
``AclFairseqError`` that keeps the built-in base it had."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from acl_fairseq.cli import convert_bert as convert_cli
from acl_fairseq.cli import export_hf as export_hf_cli
from acl_fairseq.cli import glue as glue_cli
from acl_fairseq.cli import predict as predict_cli
from acl_fairseq.cli import prepare as prepare_cli
from acl_fairseq.cli.compare import cli as compare_cli
from acl_fairseq.cli.demo import cli as demo_cli
from acl_fairseq.cli.fewshot import cli as fewshot_cli
from acl_fairseq.cli.plots import cli as plots_cli
from acl_fairseq.cli.sweep import cli as sweep_cli
from acl_fairseq.errors import ERROR_EXIT, TRACEBACK_ENV, AclFairseqError, AclValueError, run_tool

from fairseq_helpers import REPO


def fail(message: str) -> int:
    raise AclValueError(message)


def test_run_tool_prints_a_plugin_error_as_one_line(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    assert run_tool("acl-fairseq-x", fail, "--flag y: use z") == ERROR_EXIT == 2
    assert capsys.readouterr() == ("", "acl-fairseq-x: error: --flag y: use z\n")


def test_run_tool_passes_the_status_and_other_errors_through(capsys, monkeypatch):
    assert run_tool("acl-fairseq-x", lambda code: code, 3) == 3
    assert capsys.readouterr() == ("", "")
    with pytest.raises(KeyError):
        run_tool("acl-fairseq-x", lambda: {}["target"])
    monkeypatch.setenv(TRACEBACK_ENV, "1")  # the traceback on request
    with pytest.raises(AclValueError, match="--flag y"):
        run_tool("acl-fairseq-x", fail, "--flag y")


TOOLS = {
    "prepare": (prepare_cli.main, "acl-fairseq-prepare", "--task custom needs"),
    "convert_bert": (convert_cli.main, "acl-fairseq-convert-bert", "HF_DIR "),
    "export_hf": (export_hf_cli.main, "acl-fairseq-export-hf", "missing: no such file"),
    "compare": (compare_cli.main, "acl-fairseq-compare", "give the model flags"),
    "plots": (plots_cli.main, "acl-fairseq-plots", "runs not found"),
    "fewshot": (fewshot_cli.main, "acl-fairseq-fewshot", "give the TSV and --test FILE"),
    "glue": (glue_cli.main, "scripts/glue/train.sh", "unknown task 'XX'"),
    "sweep": (sweep_cli.main, "acl-fairseq-sweep", "holds no input0/dict.txt"),
    "predict": (predict_cli.main, "acl-fairseq-predict", "--policy saved: no "),
    "demo": (demo_cli.main, "acl-fairseq-demo", "--train must be >= 1, got 0"),
}


def bad_argv(tool: str, tmp_path: Path) -> list[str]:
    missing = str(tmp_path / "missing")
    if tool == "sweep":  # a checkpoint file and a split, but no dictionary
        (tmp_path / "data" / "input0").mkdir(parents=True)
        (tmp_path / "data" / "input0" / "valid.idx").write_bytes(b"")
        (tmp_path / "model.pt").write_bytes(b"")
    return {
        "prepare": ["--out-dir", str(tmp_path / "out"), "--tokenizer", "sentencepiece",
                    "--task", "custom"],
        "convert_bert": [missing, str(tmp_path / "out")],
        "export_hf": [missing, str(tmp_path / "out")],
        "compare": [missing, "--out", str(tmp_path / "out")],
        "plots": [str(tmp_path)],
        "fewshot": ["--out", str(tmp_path / "out")],
        "glue": ["XX", "ce"],
        "sweep": [str(tmp_path / "model.pt"), str(tmp_path / "data"), "--cpu"],
        "predict": [missing, "--policy", "saved"],
        "demo": ["--work-dir", missing, "--train", "0"],
    }[tool]  # fmt: skip


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_reports_bad_input_in_one_line(tool, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    main, prog, message = TOOLS[tool]
    assert main(bad_argv(tool, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def error_classes() -> list[tuple[str, str]]:
    """(module, class) of every class of the package named ``...Error``, or deriving from
    an exception named so, read from the source."""
    found = []
    for path in sorted((REPO / "acl_fairseq").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            if node.name.endswith("Error") or any(
                b.endswith(("Error", "Exception")) for b in bases
            ):
                found.append((module, node.name))
    return found


def test_every_error_class_of_the_package_is_a_plugin_error():
    classes = error_classes()
    assert ("acl_fairseq.data.task_specs", "DataError") in classes
    not_plugin = []
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        if module.startswith("acl_fairseq.portable."):  # the bundle's runner: no plugin import
            assert issubclass(cls, ValueError), f"{module}.{name}"
            continue
        if not issubclass(cls, AclFairseqError) and name != "Skipped":  # plots: not an error
            not_plugin.append(f"{module}.{name}")
    assert not not_plugin


@pytest.mark.parametrize(
    "module,name,builtin",
    [
        ("acl_fairseq.data.text_encoder", "EncodeError", ValueError),
        ("acl_fairseq.hf_bert.state", "ConversionError", ValueError),
        ("acl_fairseq.inference.loader", "CheckpointError", ValueError),
        ("acl_fairseq.early_exit.thresholds", "TargetError", ValueError),
        ("acl_fairseq.cli.fewshot.pool", "FewshotError", ValueError),
        ("acl_fairseq.cli.fewshot.record", "RecordError", ValueError),
        ("acl_fairseq.data.input_lines", "PredictError", ValueError),
        ("acl_fairseq.cli.compare.run", "RunFailed", Exception),
    ],
)
def test_the_error_classes_keep_their_builtin_base(module, name, builtin):
    assert issubclass(getattr(importlib.import_module(module), name), builtin)
