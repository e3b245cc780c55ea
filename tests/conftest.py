import pytest
import torch
from fairseq import tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from fairseq_helpers import make_dataset
from tiny_models import sharpen, tiny_args, write_tiny_data


@pytest.fixture(scope="session")
def sentiment_data(tmp_path_factory):
    """A small binarized single-sentence 2-class dataset (train 384 / valid 128)."""
    return make_dataset(tmp_path_factory.mktemp("sentiment"))


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
