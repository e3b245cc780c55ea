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
        [
            "compare",
            "convert_bert",
            "demo",
            "fewshot",
            "plots",
            "predict",
            "prepare",
            "study",
            "sweep",
        ]  # fmt: skip
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


def readme_layout() -> set[str]:
    """The ``.py`` files the README's layout block lists, as paths from the repository root."""
    block = (REPO / "README.md").read_text(encoding="utf-8").split("## Layout")[1].split("```")[1]
    listed, stack = set(), []  # stack: (indent, folder) of the enclosing folders
    for line in block.splitlines():
        if not line.strip():
            continue
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if name.endswith("/"):
            stack.append((indent, name))
        elif name.endswith(".py"):
            listed.add("".join(folder for _, folder in stack) + name)
    return listed


def test_the_readme_layout_lists_every_module_and_only_those():
    modules = {
        p.relative_to(REPO).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "__main__.py" and (p.name != "__init__.py" or p.parent == PACKAGE)
    }
    listed = readme_layout()
    assert not modules - listed, f"not in README's layout: {sorted(modules - listed)}"
    assert not listed - modules, f"in README's layout, not in the tree: {sorted(listed - modules)}"
