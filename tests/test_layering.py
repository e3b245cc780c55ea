"""The package's layering, read from the import statements: the library never imports a tool
(``acl_fairseq.cli``), and a tool imports no other tool (what two tools need is in the
library). Running another tool as a command (``python -m acl_fairseq.cli.NAME``) is allowed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fairseq_helpers import REPO

PACKAGE = REPO / "acl_fairseq"
TOOLS = sorted(p.name for p in (PACKAGE / "cli").iterdir() if (p / "__main__.py").is_file())


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def test_imported_modules_resolves_relative_imports():
    assert imported_modules(PACKAGE / "models" / "heads.py") >= {
        "acl_fairseq.models.pooling",
        "fairseq.models.roberta.model",
    }


def test_every_tool_is_a_package_of_one_shape():
    assert TOOLS == sorted(
        ["compare", "convert_bert", "demo", "plots", "predict", "prepare", "study", "sweep"]
    )
    for tool in TOOLS:
        assert (PACKAGE / "cli" / tool / "cli.py").is_file(), tool
    assert [p.name for p in (PACKAGE / "cli").glob("*.py")] == ["__init__.py"]


def test_the_library_never_imports_a_tool():
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts:
            continue
        tools = {m for m in imported_modules(path) if m.startswith("acl_fairseq.cli")}
        assert not tools, f"{path.relative_to(REPO)} imports {sorted(tools)}"


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_imports_no_other_tool(tool):
    for path in (PACKAGE / "cli" / tool).rglob("*.py"):
        others = {
            m
            for m in imported_modules(path)
            if m.startswith("acl_fairseq.cli.") and m.split(".")[2] != tool
        }
        assert not others, f"{path.relative_to(REPO)} imports {sorted(others)}"
