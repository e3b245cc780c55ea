"""``--group-by-length``: batches of similar length, every example once per epoch, batch order
shuffled per epoch; without the flag the task's batches are fairseq's own."""

from collections import Counter

import numpy as np
import pytest
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

import acl_fairseq  # noqa: F401  (registers the task)
from acl_fairseq.data.splits import load_batches

from fairseq_helpers import TINY_ROBERTA, fairseq_train, json_records, train_args


def load_train(data, seed: int, *flags: str):
    parsed = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            str(data),
            "--num-classes",
            "2",
            "--criterion",
            "sentence_prediction",
            *train_args(seed=seed),
        ]
        + list(flags),
    )
    task = tasks.setup_task(convert_namespace_to_omegaconf(parsed).task)
    task.load_dataset("train")
    return task, task.dataset("train")


def epoch_batches(task, dataset, seed: int, epochs: int = 1) -> list[list[int]]:
    """The example ids of each batch of epoch ``epochs``, as fairseq-train iterates them."""
    itr = task.get_batch_iterator(dataset, max_sentences=16, seed=seed, epoch=1)
    for _ in range(epochs):
        batches = [b["id"].tolist() for b in itr.next_epoch_itr(shuffle=True)]
    return batches


def lengths(dataset) -> np.ndarray:
    return np.array([dataset.num_tokens(i) for i in range(len(dataset))])


def padded_tokens(dataset, batches: list[list[int]]) -> int:
    sizes = lengths(dataset)
    return sum(len(b) * int(sizes[b].max()) for b in batches)


def test_batches_group_similar_lengths_and_cover_every_example(sentiment_data):
    task, plain = load_train(sentiment_data, 1)
    task_g, grouped = load_train(sentiment_data, 1, "--group-by-length")
    n = len(plain)
    for t, ds in ((task, plain), (task_g, grouped)):
        ids = [i for b in epoch_batches(t, ds, 1) for i in b]
        assert sorted(ids) == list(range(n))  # every example exactly once

    batches = epoch_batches(task_g, grouped, 1)
    sizes = lengths(grouped)
    # consecutive chunks of the length order: a batch spans at most the lengths between its
    # neighbours, so the spread within batches is far below the random batches' spread
    spread = [int(sizes[b].max() - sizes[b].min()) for b in batches]
    spread_plain = [int(sizes[b].max() - sizes[b].min()) for b in epoch_batches(task, plain, 1)]
    assert max(spread) <= 2 and np.mean(spread_plain) > 5
    assert padded_tokens(grouped, batches) < 0.8 * padded_tokens(
        plain, epoch_batches(task, plain, 1)
    )
    # the order of the batches is shuffled (not shortest first) and differs between epochs
    first = [sizes[b].max() for b in batches]
    assert first != sorted(first)
    again = epoch_batches(task_g, grouped, 1, epochs=2)
    assert Counter(map(tuple, again)) == Counter(map(tuple, batches)) and again != batches


def test_ties_follow_the_seeded_shuffle(sentiment_data):
    _, one = load_train(sentiment_data, 1, "--group-by-length")
    _, two = load_train(sentiment_data, 2, "--group-by-length")
    a, b = one.ordered_indices(), two.ordered_indices()
    sizes = lengths(one)
    assert (np.diff(sizes[a]) >= 0).all() and (np.diff(sizes[b]) >= 0).all()
    assert (a != b).any()  # examples of one length are ordered by each seed's shuffle


def test_without_shuffle_the_file_order_breaks_ties(sentiment_data):
    _, ds = load_train(sentiment_data, 1, "--group-by-length", "--no-shuffle")
    order = ds.ordered_indices()
    sizes = lengths(ds)
    assert order.tolist() == sorted(range(len(ds)), key=lambda i: (sizes[i], i))


@pytest.mark.slow
def test_fairseq_train_with_group_by_length(sentiment_data, tmp_path):
    out = fairseq_train(
        sentiment_data, tmp_path, *train_args(TINY_ROBERTA, max_update=6),
        "--group-by-length", "--criterion", "acl_embed",
    )  # fmt: skip
    losses = [float(r["loss"]) for r in json_records(out, "train_inner")]
    assert len(losses) == 6 and all(np.isfinite(losses))


def test_evaluation_batches_take_the_first_examples_of_the_file_not_the_shortest(sentiment_data):
    """``load_batches(..., max_examples=n)``: the split's first n examples (as drawn), in the
    task's length order, the same for every batch size; not the n shortest of that order."""
    task, dataset = load_train(sentiment_data, 1)
    n = 40
    sizes = lengths(dataset)
    first = sorted(tuple(dataset[i]["net_input.src_tokens"].tolist()) for i in range(n))
    shortest = np.argsort(sizes, kind="stable")[:n]
    assert sizes[:n].mean() > sizes[shortest].mean() + 1  # the two would differ here
    pad = task.source_dictionary.pad()
    for batch_size in (1, 8, 64):
        batches = load_batches(task, "train", batch_size, n)
        rows = sorted(tuple(r[r.ne(pad)].tolist()) for tokens, _ in batches for r in tokens)
        assert rows == first
        assert all(len(t) <= batch_size for t, _ in batches)
    assert sum(len(t) for t, _ in load_batches(task, "train", 8)) == len(dataset)  # no limit
