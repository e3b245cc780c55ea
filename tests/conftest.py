import pytest

from fairseq_helpers import make_dataset


@pytest.fixture(scope="session")
def sentiment_data(tmp_path_factory):
    """A small binarized single-sentence 2-class dataset (train 384 / valid 128)."""
    return make_dataset(tmp_path_factory.mktemp("sentiment"))
