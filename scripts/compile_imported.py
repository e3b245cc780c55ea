"""Writes the bytecode of the modules that acl-fairseq's commands import, once, at install.

pip installs with ``--no-compile`` (most of torch's modules are never imported), so Python
compiles a module when a process first imports it; where ``PYTHONDONTWRITEBYTECODE`` is set,
as containers often do, it never keeps the result, and every ``fairseq-train`` compiles
torch's and fairseq's modules again. Usage (scripts/install.sh)::

    python scripts/compile_imported.py [PACKAGE ...]

imports the modules every fairseq command imports, and each PACKAGE with all its submodules
(``__main__`` modules excepted), writing their bytecode whatever the environment says. A module
that cannot be imported (an extra not installed) is skipped.
"""

import importlib
import pkgutil
import sys

# what fairseq-train / fairseq-validate / fairseq-preprocess import: torch's optimizers import
# torch._dynamo when the first one is built
COMMANDS = (
    "torch",
    "torch._dynamo",
    "torch.optim",
    "fairseq_cli.train",
    "fairseq_cli.validate",
    "fairseq_cli.preprocess",
    "fairseq_cli.hydra_train",
)


def _import(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except Exception:  # an optional dependency absent: nothing to compile
        return None


def compile_imported(packages: list[str]) -> int:
    """Imports ``COMMANDS`` and every module of ``packages`` with bytecode writing on; returns
    how many of ``packages``' modules imported."""
    sys.dont_write_bytecode = False
    for name in COMMANDS:
        _import(name)
    imported = 0
    for package in packages:
        module = _import(package)
        if module is None:
            continue
        imported += 1
        path = getattr(module, "__path__", None)
        if path is None:
            continue
        for info in pkgutil.walk_packages(path, f"{package}.", onerror=lambda name: None):
            if info.name.rsplit(".", 1)[-1] != "__main__" and _import(info.name) is not None:
                imported += 1
    return imported


def main(argv: list[str]) -> int:
    print(f"bytecode written for {compile_imported(argv)} modules and their imports")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
