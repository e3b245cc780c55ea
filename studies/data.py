"""Data of the converged study (docs/results.md): the movie-review sentences with all the
labelled training data, the sentence-pair task, and the few-shot subsets.

Every split is fixed and reproducible:

* ``movie``: the demo's Rotten Tomatoes sentences, shuffled as the demo shuffles them; dev and
  test are exactly the demo's (600 and 2,000 sentences after the demo's first 1,600), train is
  every other labelled sentence (the demo's 1,600 plus the rest: 7,968).
* ``pair``: ``vitaminc_pairs_10k.tsv`` (evidence, claim, label True/False/Neither; already
  shuffled), rows 1-6,000 train, 6,001-7,000 dev, 7,001-10,000 test.
* ``fewshot``: for each size k and seed s, k training sentences per class drawn from the movie
  train split (seeded by s: ``acl_fairseq.data.splits.fewshot_train``), with the movie dev and
  test splits.
* ``fewshotdev`` (``--fewshot-dev``): for k in 16, 64 and draws 1-10, the same training draw
  and a dev split of k sentences per class drawn from the rest of the movie train split
  (``fewshot_train_dev``, the draws of ``acl-fairseq-fewshot``); the movie test split.

Usage::

    python -m studies data --work-dir study_work \
        --pair-tsv ../shared/data/vitaminc_pairs_10k.tsv
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from acl_fairseq.data.splits import fewshot_train, fewshot_train_dev
from acl_fairseq.experiment.demo_assets import (
    converted_model,
    fetch_assets,
    polarity_rows,
    prepare_tsv,
)

REPO = Path(__file__).resolve().parents[1]  # the checkout
DEMO_TRAIN, DEV, TEST = 1600, 600, 2000
PAIR_SPLITS = {"train": (0, 6000), "dev": (6000, 7000), "test": (7000, 10000)}
FEWSHOT_SIZES = (16, 64, 256, 1024)
FEWSHOT_SEEDS = (1, 2, 3, 4, 5)
FEWSHOT_DEV_SIZES = (16, 64)
FEWSHOT_DEV_DRAWS = tuple(range(1, 11))


def movie_rows(snippets: Path) -> list[tuple[str, str]]:
    """(text, label) of every non-zero-score sentence, in the demo's shuffled order."""
    return polarity_rows(snippets)


def movie_splits(rows: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """The demo's dev and test; train = every other sentence."""
    dev_end = DEMO_TRAIN + DEV
    return {
        "train": rows[:DEMO_TRAIN] + rows[dev_end + TEST :],
        "dev": rows[DEMO_TRAIN:dev_end],
        "test": rows[dev_end : dev_end + TEST],
    }


def write_tsv(path: Path, rows: list[tuple[str, ...]]) -> None:
    """Plain TSV, no quoting (as GLUE's files and acl-fairseq-prepare read them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            if any("\t" in field or "\n" in field for field in row):
                raise ValueError(f"a tab or newline inside a field: {row!r}")
            f.write("\t".join(row) + "\n")


def pair_splits(tsv: Path) -> dict[str, list[tuple[str, str, str]]]:
    lines = tsv.read_text(encoding="utf-8").split("\n")
    if lines[0].split("\t")[:3] != ["evidence", "claim", "label"]:
        raise SystemExit(f"{tsv}: expected the header evidence<TAB>claim<TAB>label")
    rows = [tuple(line.split("\t")[:3]) for line in lines[1:] if line]
    if len(rows) < PAIR_SPLITS["test"][1]:
        raise SystemExit(f"{tsv}: {len(rows)} rows, expected {PAIR_SPLITS['test'][1]}")
    return {name: rows[a:b] for name, (a, b) in PAIR_SPLITS.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies data",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--work-dir", type=Path, default=REPO / "study_work")
    p.add_argument("--pair-tsv", type=Path, help="vitaminc_pairs_10k.tsv (skip the pair task)")
    p.add_argument("--no-fewshot", action="store_true", help="skip the few-shot subsets")
    p.add_argument(
        "--fewshot-dev",
        action="store_true",
        help="also the second round's few-shot draws with a dev split of their own size",
    )
    args = p.parse_args(argv)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)

    hf_dir, snippets = fetch_assets(work)
    model_dir = converted_model(hf_dir, work)
    print(f"model: {model_dir}\ndata:  {snippets}")
    data = work / "data"

    movie = movie_splits(movie_rows(snippets))
    raw = work / "raw" / "movie"
    for split, rows in movie.items():
        write_tsv(raw / f"{split}.tsv", rows)
    print({k: len(v) for k, v in movie.items()})
    prepare_tsv(raw, "movie", model_dir, data)

    if args.pair_tsv:
        raw = work / "raw" / "pair"
        for split, rows in pair_splits(args.pair_tsv).items():
            write_tsv(raw / f"{split}.tsv", rows)
        prepare_tsv(raw, "pair", model_dir, data, "1,2")

    if not args.no_fewshot:
        for k in FEWSHOT_SIZES:
            for seed in FEWSHOT_SEEDS:
                name = f"fewshot{k}-s{seed}"
                raw = work / "raw" / name
                write_tsv(raw / "train.tsv", fewshot_train(movie["train"], k, seed))
                for split in ("dev", "test"):
                    shutil.copyfile(work / "raw" / "movie" / f"{split}.tsv", raw / f"{split}.tsv")
                prepare_tsv(raw, name, model_dir, data)
    if args.fewshot_dev:
        for k in FEWSHOT_DEV_SIZES:
            for draw in FEWSHOT_DEV_DRAWS:
                name = f"fewshotdev{k}-d{draw}"
                raw = work / "raw" / name
                train, dev = fewshot_train_dev(movie["train"], k, draw)
                write_tsv(raw / "train.tsv", train)
                write_tsv(raw / "dev.tsv", dev)
                shutil.copyfile(work / "raw" / "movie" / "test.tsv", raw / "test.tsv")
                prepare_tsv(raw, name, model_dir, data)
    print(f"data in {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
