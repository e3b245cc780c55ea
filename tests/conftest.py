import os
import shutil
from collections import Counter

import pytest
import torch
from fairseq import tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from filelock import FileLock

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


# the files with the most tests that train through fairseq run first: with pytest-xdist's
# --dist loadfile, the long files then do not start last on one worker while the other waits
def pytest_collection_modifyitems(items):
    """Runs files in the order of their number of slow tests (most first), each file's tests in
    their own order."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    first = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)
    items.sort(key=lambda item: (-slow[item.path], first[item.path]))


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
