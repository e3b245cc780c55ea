import os
import shutil
from collections import Counter

import pytest
import torch
from fairseq import tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from filelock import FileLock
from fork_server import serve_tools

from fairseq_helpers import make_dataset
from tiny_models import sharpen, tiny_args, write_tiny_data


def shared_dir(tmp_path_factory, name: str):
    """``(folder, lock)``: a folder that every pytest-xdist worker of this run shares (each
    worker's temporary folder is inside one folder per run), and a lock for making it once."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return root / name, FileLock(str(root / f"{name}.lock"))


@pytest.fixture(scope="session")
def sentiment_data(tmp_path_factory):
    """A small binarized single-sentence 2-class dataset (train 384 / valid 128), made once
    per test run (shared by the xdist workers; read only)."""
    folder, lock = shared_dir(tmp_path_factory, "sentiment")
    with lock:
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            make_dataset(folder)
            (folder / "done").touch()
    return folder / "bin"


# the longest files run first (their order from `pytest --durations`, one process): with
# pytest-xdist's --dist loadfile each file runs on one worker, and a long file that starts last
# keeps one worker busy while the other waits; the other files follow by their number of slow
# tests. A stale list only costs time.
LONGEST_FIRST = (
    "studies/tests/test_study.py",
    "tests/test_readme.py",
    "tests/test_distributed.py",
    "tests/test_gpu_check.py",
    "tests/test_plan.py",
    "tests/test_save_dir_safety.py",
    "tests/test_precision.py",
    "tests/test_plots.py",
    "tests/test_fewshot_tool.py",
    "tests/test_crash_safety.py",
    "tests/test_frozen_cache.py",
    "tests/test_exit_cost_batch1.py",
    "tests/test_e2e_single_exit.py",
    "tests/test_recipes_run.py",
    "tests/test_demo.py",
)


def pytest_collection_modifyitems(config, items):
    """Runs the files of ``LONGEST_FIRST`` first, in that order, then the others by their
    number of slow tests (most first); each file's tests in their own order."""
    root = config.rootpath
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    first = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)

    def order(item) -> tuple:
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return (rank.get(name, len(rank)), -slow[item.path], first[item.path])

    items.sort(key=order)


def pytest_configure(config):
    """One torch thread per pytest-xdist worker: two workers share the two cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A data dir with the tiny models' dictionaries (tiny_models.py)."""
    return write_tiny_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tiny_task(tiny_data):
    """(full fairseq cfg, task) for the tiny multi-exit model."""
    cfg = convert_namespace_to_omegaconf(tiny_args(tiny_data))
    return cfg, tasks.setup_task(cfg.task)


@pytest.fixture(scope="module")
def tiny_built(tiny_task):
    """(model, task, full cfg): the model built from the full cfg, as fairseq-train does."""
    cfg, task = tiny_task
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    sharpen(model)
    return model.eval(), task, cfg


@pytest.fixture(autouse=True)
def _served_tool_commands(monkeypatch):
    """The tools' fairseq-train / fairseq-validate commands forked from one process that has
    imported fairseq (tests/fork_server.py)."""
    serve_tools(monkeypatch)


@pytest.fixture
def plugin_run(monkeypatch):
    """This process counts as a plugin run (fairseq_patches.mark_in_use): the guard rails act on
    fairseq's functions called in-process, as they do once fairseq-train builds the plugin's task,
    criterion or model. Reset after the test: nothing leaks into the next one."""
    from acl_fairseq import fairseq_patches

    monkeypatch.setattr(fairseq_patches, "_in_use", {"test"})


@pytest.fixture
def stock_run(monkeypatch):
    """This process counts as a stock fairseq run: none of the plugin's components built."""
    from acl_fairseq import fairseq_patches

    monkeypatch.setattr(fairseq_patches, "_in_use", set())


@pytest.fixture
def one_thread():
    """Tiny tensors: a second OpenMP thread only adds wake-up latency on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
