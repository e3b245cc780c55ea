"""fairseq's own tests, run as stock fairseq and with the plugin loaded, compared per test.

Usage: python scripts/fairseq_conformance.py FAIRSEQ_SRC [--out DIR] [--python PY]
(``scripts/fairseq_conformance.sh`` runs it with the project's ``.venv``).

FAIRSEQ_SRC is a checkout of the fairseq repository (its ``tests/`` are not in the wheel, and
the sdist lacks ``tests/utils.py``). Its ``tests/`` folder is copied out of the checkout (a
``fairseq/`` source folder beside it would shadow the installed build), with a ``conftest.py``
that imports the plugin the way ``--user-dir`` does (``fairseq.utils.import_user_module``)
when ``ACL_CONFORMANCE_PLUGIN=1``. Both passes set ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
(stock fairseq cannot load its own checkpoints under torch >= 2.6 without it), so what differs
is the plugin's alone; ``--as-users-run`` leaves it unset in both (then the plugin's loading
fix shows as "fixed by the plugin"). A test that passes on stock and fails with the plugin is
run again alone, three times on each side (as does one that fails on stock and passes with the
plugin): broken (or fixed) only when it fails every time on one side and passes every time on
the other; else it is flaky or depends on the tests before it ("flaky" column).

Prints a Markdown table (passed both, fixed by the plugin, broken by the plugin, failed both,
skipped; the failures by reason class) and lists the tests in the middle columns; exits 1 when
anything is broken by the plugin.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

LEFT_OUT = {
    "test_average_checkpoints.py": "needs the repository's scripts/ folder",
    "test_dataclass_utils.py": "does not collect on Python 3.11 (with or without the plugin)",
}
REASONS = (  # (reason class, pattern of the failure message), first match wins
    ("xformers absent", r"xformers"),
    ("numpy 2", r"numpy|np\.(float|int|bool|object)\b|np\.\w+ was removed"),
    ("Python 3.11 dataclasses", r"mutable default|dataclass"),
    ("torch weights_only", r"weights[_ ]only|Unsupported global"),
    ("no GPU", r"CUDA|cuda|NCCL|nccl|GPU"),
    ("network / hub", r"HTTP|urlopen|Connection|download"),
)
CONFTEST = """
import argparse
import os

if os.environ.get("ACL_CONFORMANCE_PLUGIN") == "1":
    from fairseq import utils

    utils.import_user_module(argparse.Namespace(user_dir=os.environ["ACL_CONFORMANCE_USER_DIR"]))
"""


def reason_of(message: str) -> str:
    for name, pattern in REASONS:
        if re.search(pattern, message):
            return name
    return "other"


def copy_tests(src: Path, dest: Path) -> Path:
    """``src/tests`` copied to ``dest/tests`` with the plugin-loading conftest."""
    tests = dest / "tests"
    shutil.copytree(src / "tests", tests)
    (tests / "__init__.py").touch()
    conftest = tests / "conftest.py"
    old = conftest.read_text() if conftest.is_file() else ""
    conftest.write_text(CONFTEST + "\n" + old)
    return tests


def selection(tests: Path) -> list[str]:
    files = sorted(p.name for p in tests.glob("test_*.py") if p.name not in LEFT_OUT)
    return [f"tests/{name}" for name in files] + ["tests/tasks"]


def run_pass(python: str, root: Path, targets: list[str], plugin: bool, env: dict, xml: Path):
    """One pytest pass over ``targets`` in ``root``; ``{test id: (outcome, message)}``."""
    full = {**env, "ACL_CONFORMANCE_PLUGIN": "1" if plugin else "0"}
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--junitxml", str(xml), *targets]  # fmt: skip
    subprocess.run(cmd, cwd=root, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", f"{child.get('message', '')}\n{child.text or ''}"
            elif child.tag == "skipped":
                outcome = "skipped"
        results[name] = (outcome, message)
    return results


def rerun(python: str, root: Path, test: str, plugin: bool, env: dict, tmp: Path) -> int:
    """How many of three runs of one test pass."""
    module, _, name = test.rpartition("::")
    target = module.replace(".", "/") + ".py::" + name.split("[")[0]
    passed = 0
    for i in range(3):
        got = run_pass(python, root, [target], plugin, env, tmp / f"rerun{i}.xml")
        passed += any(o == "passed" for o, _ in got.values())
    return passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("fairseq_src", type=Path, help="a checkout of the fairseq repository")
    p.add_argument("--python", default=sys.executable, help="the Python that has fairseq")
    p.add_argument("--user-dir", type=Path, default=Path(__file__).resolve().parents[1]
                   / "acl_fairseq", help="the plugin's folder")  # fmt: skip
    p.add_argument("--as-users-run", action="store_true",
                   help="leave TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD unset in both passes")  # fmt: skip
    args = p.parse_args(argv)
    if not (args.fairseq_src / "tests" / "utils.py").is_file():
        p.error(f"{args.fairseq_src}: no tests/utils.py: give a checkout of the fairseq repository")
    env = {**os.environ, "ACL_CONFORMANCE_USER_DIR": str(args.user_dir.resolve())}
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    if not args.as_users_run:
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tests = copy_tests(args.fairseq_src, root)
        targets = selection(tests)
        stock = run_pass(args.python, root, targets, False, env, root / "stock.xml")
        plugin = run_pass(args.python, root, targets, True, env, root / "plugin.xml")
        columns: dict[str, list[str]] = {
            k: [] for k in ("both", "fixed", "broken", "flaky", "neither", "skip")
        }
        reasons: Counter = Counter()
        for test in sorted(stock.keys() | plugin.keys()):
            s, pl = stock.get(test, ("missing", "")), plugin.get(test, ("missing", ""))
            if s[0] == "skipped" and pl[0] == "skipped":
                columns["skip"].append(test)
            elif s[0] == "passed" and pl[0] == "passed":
                columns["both"].append(test)
            elif s[0] != "passed" and pl[0] == "passed":  # alone, three times on each side
                stock_again = (
                    rerun(args.python, root, test, False, env, root) if s[0] == "failed" else 0
                )
                plugin_again = rerun(args.python, root, test, True, env, root)
                fixed = stock_again == 0 and plugin_again == 3
                columns["fixed" if fixed else "flaky"].append(test)
            elif s[0] == "passed":
                plugin_again = rerun(args.python, root, test, True, env, root)
                stock_again = rerun(args.python, root, test, False, env, root)
                broken = plugin_again == 0 and stock_again == 3
                columns["broken" if broken else "flaky"].append(test)
            else:
                columns["neither"].append(test)
                reasons[reason_of(pl[1] or s[1])] += 1
    total = sum(len(v) for v in columns.values())
    print(f"fairseq tests: {total} cases from {len(targets)} targets; left out: "
          + "; ".join(f"{k} ({v})" for k, v in LEFT_OUT.items()))  # fmt: skip
    print("weights_only: " + ("as users run (unset)" if args.as_users_run else
                              "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in both passes"))  # fmt: skip
    print("\n| passed both | fixed by the plugin | broken by the plugin | flaky | failed both "
          "| skipped both |\n|---|---|---|---|---|---|")  # fmt: skip
    print(
        "| "
        + " | ".join(
            str(len(columns[k])) for k in ("both", "fixed", "broken", "flaky", "neither", "skip")
        )
        + " |"
    )
    print("\nfailed both, by reason: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common()))
    for key, title in (("fixed", "fixed by the plugin"), ("broken", "BROKEN by the plugin"),
                       ("flaky", "flaky or order-dependent: not the same alone")):  # fmt: skip
        if columns[key]:
            print(f"\n{title}:\n" + "\n".join(f"  {t}" for t in columns[key]))
    return 1 if columns["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())
