"""The package's layering, read from the import statements and held equal to
docs/architecture.md: the packages import each other (at module level) exactly as its layer
block says, without a cycle; an import inside a function crosses packages only along a declared
edge or a listed delegate; the library never imports a tool and a tool imports no other tool;
what fairseq loads through ``--user-dir`` imports no inference, tool or ONNX code; the layout
block lists every module; the study and the benchmarks stay out of the installed package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_helpers import REPO

PACKAGE = REPO / "acl_fairseq"
CLI = PACKAGE / "cli"
ARCHITECTURE = REPO / "docs" / "architecture.md"
TOOLS = sorted(
    p.stem
    for p in CLI.iterdir()
    if (p.suffix == ".py" and not p.name.startswith("_")) or (p / "cli.py").is_file()
)
# imports inside a function that cross packages against the layer order: the model's thin
# delegates to the inference side, imported only when called
DELEGATES = {
    ("models", "inference"),  # MultiExitRobertaModel.from_pretrained -> inference.hub
    ("models", "runtime"),  # MultiExitRobertaModel.early_exit -> runtime.torch_loop
    ("models", "early_exit"),  # early_exit's policy parsing
}


def imported_modules(path: Path, where: str = "all") -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved): ``where``
    ``module`` (what runs at import: outside every function body), ``function`` (inside
    one) or ``all``."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            wanted = where == "all" or (where == "function") == inner
            if wanted and isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif wanted and isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return names


def test_imported_modules_resolves_relative_imports_and_tells_where():
    heads = imported_modules(PACKAGE / "models" / "heads.py")
    assert heads >= {"acl_fairseq.models.pooling", "fairseq.models.roberta.model"}
    model = PACKAGE / "models" / "multi_exit_roberta.py"
    assert "acl_fairseq.inference.hub" in imported_modules(model, "function")
    assert "acl_fairseq.inference.hub" not in imported_modules(model, "module")


def test_every_tool_is_one_module_or_a_package_of_parts():
    assert TOOLS == sorted(
        ["bundle", "compare", "convert_bert", "demo", "export_hf", "fewshot", "glue", "plots",
         "predict", "prepare", "sweep"]
    )  # fmt: skip
    for folder in (p for p in CLI.iterdir() if p.is_dir() and p.name != "__pycache__"):
        parts = {p.name for p in folder.glob("*.py")} - {"__init__.py", "__main__.py"}
        assert parts - {"cli.py"}, f"{folder.relative_to(REPO)} is one module: make it cli/NAME.py"


def test_the_library_never_imports_a_tool():
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts:
            continue
        tools = {m for m in imported_modules(path) if m.startswith("acl_fairseq.cli")}
        assert not tools, f"{path.relative_to(REPO)} imports {sorted(tools)}"


def _tool_of(module: str) -> str | None:
    """The tool a module name belongs to (``acl_fairseq.cli.NAME...``), None outside one."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["acl_fairseq", "cli"] else None


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_imports_no_other_tool(tool):
    paths = [CLI / f"{tool}.py"] if (CLI / f"{tool}.py").is_file() else (CLI / tool).rglob("*.py")
    for path in paths:
        others = {
            m
            for m in imported_modules(path)
            if _tool_of(m) not in (None, tool, "HelpFormatter")  # the cli package's own
        }
        assert not others, f"{path.relative_to(REPO)} imports {sorted(others)}"


def package_edges(where: str) -> dict[str, set[str]]:
    """``{package: packages it imports}`` over the library, the tools left out (a root module
    is its own package)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] == "cli" or parts == ("__init__.py",):
            continue
        source = parts[0].removesuffix(".py")
        edges.setdefault(source, set())
        for name in imported_modules(path, where):
            if name.startswith("acl_fairseq."):
                target = name.split(".")[1]
                if target != source:
                    edges[source].add(target)
    return edges


def declared_layers() -> dict[str, set[str]]:
    """The layer block of docs/architecture.md: ``{package: packages it imports}``."""
    block = ARCHITECTURE.read_text(encoding="utf-8").split("## Layers")[1].split("```")[1]
    layers: dict[str, set[str]] = {}
    for line in block.strip().splitlines():
        head = line.split("  ")[0]  # the description starts after two spaces
        name, _, targets = head.partition(" -> ")
        layers[name.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    return layers


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


def test_the_layer_block_is_the_imports():
    declared = declared_layers()
    actual = package_edges("module")
    assert set(declared) - {"cli"} == set(actual), "packages in the tree vs the layer block"
    for package, targets in actual.items():
        assert targets == declared[package], (
            f"{package} imports {sorted(targets)}; docs/architecture.md says "
            f"{sorted(declared[package])}"
        )


def test_the_packages_import_each_other_without_a_cycle():
    cycle = find_cycle(package_edges("module"))
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_imports_inside_functions_follow_the_layers_or_a_listed_delegate():
    declared = declared_layers()
    reachable = {p: set(t) for p, t in declared.items()}
    changed = True
    while changed:  # what each package may import, directly or through another
        changed = False
        for targets in reachable.values():
            more = set().union(*(reachable.get(t, set()) for t in targets)) - targets
            if more:
                targets |= more
                changed = True
    for package, targets in package_edges("function").items():
        for target in targets:
            ok = target in reachable.get(package, set()) or (package, target) in DELEGATES
            assert ok, f"{package} imports {target} inside a function, against the layers"


def test_what_fairseq_loads_imports_no_inference_tool_or_onnx_code():
    """The plugin imported as fairseq's ``--user-dir`` imports it, in a fresh process."""
    code = (
        "import argparse, sys\n"
        "from fairseq import utils\n"
        "utils.import_user_module(argparse.Namespace(user_dir=sys.argv[1]))\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(PACKAGE)], capture_output=True, text=True, check=True
    ).stdout.split()
    ours = [m for m in out if m.startswith("acl_fairseq")]
    assert "acl_fairseq.models.multi_exit_roberta" in ours  # the plugin did load
    banned = ("acl_fairseq.inference", "acl_fairseq.runtime", "acl_fairseq.cli",
              "acl_fairseq.experiment", "acl_fairseq.hf_bert")  # fmt: skip
    assert not [m for m in ours if m.startswith(banned)]
    assert not [m for m in out if m.split(".")[0] in ("onnx", "onnxruntime", "onnxscript")]


def test_the_portable_runner_imports_only_numpy_and_its_siblings():
    """``acl_fairseq/portable`` is copied verbatim into every bundle and runs without torch,
    fairseq or the plugin: at module level it imports the standard library, numpy and its own
    modules (relatively); onnxruntime and tokenizers only inside the functions that need them."""
    folder = PACKAGE / "portable"
    modules = sorted(folder.glob("*.py"))
    assert {p.name for p in modules} >= {"decide.py", "rows.py", "ort_loop.py", "lines.py",
                                         "bundle.py", "__main__.py"}  # fmt: skip
    for path in modules:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):  # a relative import stays inside the package
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name}: import from outside the package"
        for name in imported_modules(path, "module"):
            top = name.split(".")[0]
            allowed = top in sys.stdlib_module_names | {"numpy", "__future__"}
            assert allowed or name.startswith("acl_fairseq.portable"), f"{path.name}: {name}"
        for name in imported_modules(path, "function"):
            top = name.split(".")[0]
            assert top in ("onnxruntime", "tokenizers") or name.startswith(
                "acl_fairseq.portable"
            ), f"{path.name} imports {name} in a function"


def test_the_root_holds_a_few_named_modules():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == [
        "__init__.py",
        "atomic_write.py",
        "autocast.py",
        "cpu_features.py",
        "distributed.py",
        "errors.py",
        "fairseq_patches.py",
        "launch.py",
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


@pytest.mark.parametrize("root", ["acl_fairseq", "tests", "benchmarks", "studies"])
def test_no_source_or_test_file_is_over_550_lines(root):
    long = {
        p.relative_to(REPO).as_posix(): n
        for p in (REPO / root).rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 550
    }
    assert not long, f"split these files (the house keeps files under ~500 lines): {long}"
