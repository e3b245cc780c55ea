"""Checks of the data by ``--task acl_sentence_prediction`` at set-up and load: a wrong flag
or a broken data folder fails before training, naming the fix.
"""

import logging
import os
import re

import numpy as np
from fairseq.data import data_utils

from ..checkpoint.training_data import dictionary_labels as _labels
from ..data.splits import raw_files
from ..errors import AclFileNotFoundError, AclValueError

logger = logging.getLogger(__name__)


def check_num_classes(num_classes: int, label_dictionary, data: str, loading: bool = False) -> None:
    """Fails fast when ``--num-classes`` disagrees with ``label/dict.txt`` (``loading``: the
    checkpoint's class count, when a checkpoint is loaded on ``data`` for inference)."""
    labels = _labels(label_dictionary)
    if len(labels) == num_classes:
        return
    listed = f"{', '.join(labels[:10])}{'...' if len(labels) > 10 else ''}"
    if loading:
        raise AclValueError(
            f"the checkpoint classifies into {num_classes} classes, but {data}/label/dict.txt "
            f"lists {len(labels)} labels ({listed}): give the prepared data folder it was "
            "trained on (acl-fairseq-predict --data, from_pretrained(data_name_or_path=...))"
        )
    raise AclValueError(
        f"--num-classes {num_classes} does not match {data}/label/dict.txt, which lists "
        f"{len(labels)} labels ({listed}); pass --num-classes {len(labels)}"
    )


# ----------------------------------------------------------------------- data checks
def check_dictionaries(cfg) -> None:
    """Fails fast, naming the layout, when ``DATA/input0`` or ``DATA/label`` is missing."""
    layout = (
        "--task acl_sentence_prediction reads DATA/input0/ (the inputs), DATA/label/ (the "
        "labels) and, for sentence pairs, DATA/input1/, each binarized with fairseq-preprocess "
        "--only-source (acl-fairseq-prepare writes this layout)"
    )
    path = os.path.join(cfg.data, "input0", "dict.txt")
    if not os.path.exists(path):
        raw = raw_files(cfg.data)
        if raw:
            raise AclFileNotFoundError(
                f"{cfg.data} holds raw files ({raw}), not binarized data: prepare it first "
                "with acl-fairseq-prepare (--task custom --train ... for your own TSV files, "
                "--glue-dir ... for GLUE) and train on the OUT/TASK-bin folder it writes"
            )
        raise AclFileNotFoundError(f"{path} not found: {layout}. Is {cfg.data} the data directory?")
    path = os.path.join(cfg.data, "label", "dict.txt")
    if not cfg.regression_target and not os.path.exists(path):
        raise AclFileNotFoundError(
            f"{path} not found: {layout}. Binarize the labels with fairseq-preprocess "
            f"--only-source --trainpref RAW/train.label --validpref RAW/valid.label --destdir "
            f"{cfg.data}/label (or pass --regression-target for a regression task)."
        )


def _load_split(data: str, key: str, split: str, dictionary, combine: bool):
    return data_utils.load_indexed_dataset(
        os.path.join(data, key, split), dictionary, combine=combine
    )


def _first_lines(mask: np.ndarray) -> str:
    lines = (np.flatnonzero(mask)[:5] + 1).tolist()
    return ", ".join(map(str, lines)) + (", ..." if mask.sum() > 5 else "")


def check_split_files(cfg, split: str, dictionary, label_dictionary, combine=False) -> None:
    """Checks one split's binarized files before fairseq builds the dataset: missing
    ``input0``/``label`` files, an ``input1`` split missing in a pair task, differing example
    counts, empty or multi-token label lines, unknown labels. Empty input lines are valid
    (QQP has some): counted in a warning."""
    data = cfg.data
    input0 = _load_split(data, "input0", split, dictionary, combine)
    if input0 is None:
        raise AclFileNotFoundError(
            f"{data}/input0/{split}.bin/.idx not found: binarize the inputs of split '{split}' "
            f"into {data}/input0 (fairseq-preprocess --only-source --srcdict "
            f"{data}/input0/dict.txt), or name the splits with --train-subset / --valid-subset"
        )
    input1 = _load_split(data, "input1", split, dictionary, combine)
    input1_dir = os.path.join(data, "input1")
    if input1 is None and os.path.isdir(input1_dir):
        if any(f.endswith(".idx") for f in os.listdir(input1_dir)):
            raise AclFileNotFoundError(
                f"{input1_dir}/{split}.bin/.idx not found, but {input1_dir}/ holds the second "
                f"sentences of other splits (a sentence-pair task): split '{split}' would be "
                f"read as single sentences. Binarize its second sentences with fairseq-preprocess "
                f"--only-source --srcdict {data}/input0/dict.txt --destdir {input1_dir}"
            )
    if input1 is None and cfg.separator_token is not None:
        logger.info(
            f"--separator-token is set but {input1_dir}/{split} does not exist: split '{split}' "
            "is read as single sentences (right for single-sentence tasks such as SST-2)"
        )
    label = None
    if not cfg.regression_target:
        label = _load_split(data, "label", split, label_dictionary, combine)
        if label is None:
            raise AclFileNotFoundError(
                f"{data}/label/{split}.bin/.idx not found: binarize the labels of split "
                f"'{split}' into {data}/label (fairseq-preprocess --only-source --srcdict "
                f"{data}/label/dict.txt --destdir {data}/label)"
            )
    counts = {"input0": len(input0)}
    if input1 is not None:
        counts["input1"] = len(input1)
    if label is not None:
        counts["label"] = len(label)
    if len(set(counts.values())) > 1:
        found = ", ".join(f"{n} in {data}/{key}/{split}" for key, n in counts.items())
        raise AclValueError(
            f"split '{split}' has different numbers of examples: {found}. The raw files must "
            "have one line per example each; fix them and binarize again"
        )
    if label is not None:
        sizes = np.asarray(label.sizes)  # one label + </s> per line
        empty, several = sizes < 2, sizes > 2
        if empty.any() or several.any():
            problems = []
            if empty.any():
                problems.append(f"{empty.sum()} empty (line {_first_lines(empty)})")
            if several.any():
                problems.append(
                    f"{several.sum()} with more than one token (line {_first_lines(several)})"
                )
            raise AclValueError(
                f"{data}/label/{split}: {' and '.join(problems)} of {len(sizes)} label lines; "
                f"every line of the raw {split}.label must hold exactly one label. Fix the raw "
                "file and binarize it again"
            )
    if label is not None:
        check_labels_known(data, split, label, label_dictionary)
    for key, ds in (("input0", input0), ("input1", input1)):
        if ds is not None:
            empty = np.asarray(ds.sizes) <= 1  # only </s>
            if empty.any():
                logger.warning(
                    f"split '{split}': {empty.sum()} of {len(empty)} lines of {data}/{key} are "
                    f"empty (line {_first_lines(empty)}); they are kept as '<s></s>'"
                )


def _label_tokens(ds) -> np.ndarray:
    """The first token of every line of a binarized label split (one label + </s> a line)."""
    if hasattr(ds, "datasets"):  # --combine: train, train1, ...
        return np.concatenate([_label_tokens(d) for d in ds.datasets])
    index = getattr(ds, "_index", None)
    if getattr(ds, "_bin_buffer", None) is not None and hasattr(index, "_pointers"):
        flat = np.frombuffer(ds._bin_buffer, dtype=index.dtype)
        return flat[np.asarray(index._pointers) // np.dtype(index.dtype).itemsize]
    return np.array([int(ds[i][0]) for i in range(len(ds))], dtype=np.int64)


def _raw_labels(data: str, n_lines: int, lines: list[int], label_dictionary) -> str:
    """The raw label file of a split and its labels on ``lines`` (1-based), as far as
    ``label/preprocess.log`` names a raw file of ``n_lines`` lines that still exists."""
    log = os.path.join(data, "label", "preprocess.log")
    if not os.path.exists(log):
        return ""
    with open(log, encoding="utf-8", errors="replace") as f:
        raw_files = re.findall(r"^\[\S+\] (.+): \d+ sents, \d+ tokens", f.read(), re.M)
    for raw in dict.fromkeys(reversed(raw_files)):  # the latest run first
        if not os.path.isfile(raw):
            continue
        with open(raw, encoding="utf-8", errors="replace") as f:
            values = [line.strip() for line in f]
        if len(values) != n_lines:
            continue
        found = [values[i - 1] for i in lines]
        if all(label_dictionary.index(v) == label_dictionary.unk_index for v in found):
            shown = ", ".join(f"line {i}: {v!r}" for i, v in zip(lines, found))
            return f" of {raw} ({shown})"
    return ""


def check_labels_known(data: str, split: str, label, label_dictionary) -> None:
    """Raises when a label of ``label/SPLIT`` is not in ``label/dict.txt`` (preprocessed as
    ``<unk>``: fairseq would train on it, or fail at validation)."""
    tokens = _label_tokens(label)
    unknown = tokens < label_dictionary.nspecial  # <unk> (or another special symbol)
    if not unknown.any():
        return
    lines = (np.flatnonzero(unknown)[:5] + 1).tolist()
    raw = _raw_labels(data, len(tokens), lines, label_dictionary)
    known = _labels(label_dictionary)
    more = ", ..." if unknown.sum() > len(lines) else ""
    raise AclValueError(
        f"{data}/label/{split}.bin: {unknown.sum()} of {len(tokens)} labels are not in "
        f"{data}/label/dict.txt (binarized as <unk>): line{'s' if len(lines) > 1 else ''} "
        f"{', '.join(map(str, lines))}{more}"
        f"{raw}. The dictionary lists {', '.join(known[:10])}{'...' if len(known) > 10 else ''}. "
        "Fix the label if it is a typo, or re-run the data preparation (acl-fairseq-prepare, "
        f"or fairseq-preprocess --only-source --srcdict DICT --destdir {data}/label) for every "
        "split with one label dictionary DICT that lists every label"
    )


def check_lengths(cfg, split: str, sizes) -> None:
    """Raises when an example is longer than ``--max-positions`` after any shortening
    (fairseq would drop it from training and stop at validation)."""
    sizes = np.asarray(sizes[0] if isinstance(sizes, (list, tuple)) else sizes)
    max_positions = cfg.max_positions
    too_long = sizes > max_positions
    if not too_long.any():
        return
    method = str(cfg.shorten_method)
    if method == "none":
        fix = f"pass --shorten-method truncate to cut them to {max_positions} tokens"
    else:
        fix = (
            f"--shorten-method {method} is not applied to '{split}' (--shorten-data-split-list "
            f"{cfg.shorten_data_split_list}): add it, or leave the list empty for every split"
        )
    raise AclValueError(
        f"split '{split}': {too_long.sum()} of {len(sizes)} examples are longer than "
        f"--max-positions {max_positions} tokens (the longest has {sizes.max()}, counting <s> "
        f"and separators); {fix}"
    )
