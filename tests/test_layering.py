"""The package's layering, read from the import statements: the library never imports a tool
(``acl_fairseq.cli``), a tool imports no other tool (what two tools need is in the library),
the packages import each other without a cycle, and the study and the benchmarks stay out of
the installed package. Running another tool as a command (``python -m acl_fairseq.cli.NAME``)
is allowed. docs/architecture.md lists every module."""

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
            "export_hf",
            "fewshot",
            "glue",
            "plots",
            "predict",
            "prepare",
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


ARCHITECTURE = REPO / "docs" / "architecture.md"


def package_edges() -> dict[str, set[str]]:
    """``{package: packages it imports}`` over the library (a root module is its own
    package; the tools are left out: they may import anything but each other)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] == "cli" or parts == ("__init__.py",):
            continue
        source = parts[0].removesuffix(".py")
        for name in imported_modules(path):
            if name.startswith("acl_fairseq."):
                target = name.split(".")[1]
                if target != source:
                    edges.setdefault(source, set()).add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``edges`` as a list of nodes (first = last), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_packages_import_each_other_without_a_cycle():
    cycle = find_cycle(package_edges())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_the_root_holds_a_few_named_modules():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == [
        "__init__.py",
        "autocast.py",
        "cpu_features.py",
        "distributed.py",
        "errors.py",
    ]


def test_the_installed_package_holds_no_study_and_no_benchmark_code():
    for path in PACKAGE.rglob("*.py"):
        outside = {
            m for m in imported_modules(path) if m.split(".")[0] in ("studies", "benchmarks")
        }
        assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}"
    assert not (PACKAGE / "cli" / "study").exists()


def readme_layout() -> set[str]:
    """The ``.py`` files the layout block of docs/architecture.md lists, as paths from the
    repository root."""
    block = ARCHITECTURE.read_text(encoding="utf-8").split("## Layout")[1].split("```")[1]
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


def test_the_architecture_layout_lists_every_module_and_only_those():
    modules = {
        p.relative_to(REPO).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "__main__.py" and (p.name != "__init__.py" or p.parent == PACKAGE)
    }
    listed = readme_layout()
    assert not modules - listed, f"not in docs/architecture.md: {sorted(modules - listed)}"
    assert not listed - modules, (
        f"in docs/architecture.md, not in the tree: {sorted(listed - modules)}"
    )
