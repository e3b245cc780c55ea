"""Helpers for end-to-end tests: generated labelled text, binarization, running fairseq CLIs."""

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from fork_server import ForkServer

from acl_fairseq.experiment import recipe
from acl_fairseq.experiment.fairseq_log import json_records  # noqa: F401  (used by the tests)

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
USER_DIR = str(REPO / "acl_fairseq")

TINY_ROBERTA = (
    "--arch roberta --encoder-layers 2 --encoder-embed-dim 32 --encoder-ffn-embed-dim 64 "
    "--encoder-attention-heads 2 --max-positions 64"
).split()

TINY_MULTI_EXIT = ["--arch", "multi_exit_roberta_tiny", "--max-positions", "64"]


def train_args(
    arch: list[str] = TINY_ROBERTA,
    task: str | None = "acl_sentence_prediction",
    batch_size: int = 16,
    lr: str = "1e-3",
    seed: int = 1,
    **flags: object,
) -> list[str]:
    """The fairseq-train flags of a tiny test run: ``arch``, ``--task`` (unless None), Adam at
    ``lr``, ``--batch-size``, ``--seed``; every keyword becomes a flag (``max_update=2`` ->
    ``--max-update 2``, ``no_save=True`` -> ``--no-save``)."""
    args = [*arch, *(["--task", task] if task else [])]
    args += ["--batch-size", str(batch_size), "--optimizer", "adam", "--lr", lr]
    args += ["--seed", str(seed)]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def exact_train_args(updates: int, **flags: object) -> list[str]:
    """The flags (no architecture) of a run that two ways of training must reproduce update
    for update: every batch of 8 examples, seed 3, no dropout, ``updates`` updates, no epoch
    checkpoints; then ``flags`` (as :func:`train_args`)."""
    return train_args(
        [],
        batch_size=8,
        seed=3,
        required_batch_size_multiple=1,
        max_update=updates,
        dropout=0,
        attention_dropout=0,
        pooler_dropout=0,
        no_epoch_checkpoints=True,
        **flags,
    )


# a 3-layer multi-exit model: two shallow exits and the last
TINY_MULTI_EXIT_3 = [*TINY_MULTI_EXIT[:2], "--encoder-layers", "3", *TINY_MULTI_EXIT[2:]]


def fairseq_setup(argv: list, seed: int | None = None):
    """``(cfg, task, model)`` as fairseq-train sets them up from its command line ``argv`` (the
    data folder first), in this process; ``seed``: torch's seed before the model is built."""
    import torch
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parsed = options.parse_args_and_arch(options.get_training_parser(), [str(a) for a in argv])
    cfg = convert_namespace_to_omegaconf(parsed)
    task = tasks.setup_task(cfg.task)
    if seed is not None:
        torch.manual_seed(seed)
    return cfg, task, task.build_model(cfg.model)


POSITIVE = [f"good{i}" for i in range(12)]
NEGATIVE = [f"bad{i}" for i in range(12)]
NEUTRAL = [f"w{i}" for i in range(40)]


def write_sentiment_split(prefix: Path, n: int, seed: int, pair: bool = False) -> None:
    """A learnable 2-class task: the label is which of two word groups occurs more often,
    hidden among neutral words; 10% of the labels are flipped, so it is not trivial."""
    rng = random.Random(seed)
    with (
        open(f"{prefix}.input0", "w") as f0,
        open(f"{prefix}.input1", "w") if pair else open(os.devnull, "w") as f1,
        open(f"{prefix}.label", "w") as fl,
    ):
        for _ in range(n):
            label = rng.randint(0, 1)
            strong, weak = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
            words = [rng.choice(strong) for _ in range(rng.randint(2, 4))]
            words += [rng.choice(weak) for _ in range(rng.randint(0, 1))]
            words += [rng.choice(NEUTRAL) for _ in range(rng.randint(3, 12))]
            rng.shuffle(words)
            if rng.random() < 0.1:
                label = 1 - label
            f0.write(" ".join(words) + "\n")
            if pair:
                f1.write(" ".join(rng.choice(NEUTRAL) for _ in range(rng.randint(2, 6))) + "\n")
            fl.write(f"{label}\n")


def preprocess(raw: Path, dest: Path, pair: bool = False) -> Path:
    """Binarizes raw/{train,valid}.{input0,input1,label} into dest/{input0,input1,label}."""
    fields = ["input0", "input1", "label"] if pair else ["input0", "label"]
    for field in fields:
        cmd = [
            str(BIN / "fairseq-preprocess"),
            "--only-source",
            "--trainpref",
            str(raw / f"train.{field}"),
            "--validpref",
            str(raw / f"valid.{field}"),
            "--destdir",
            str(dest / field),
            "--workers",
            "1",
        ]
        if field == "input1":
            cmd += ["--srcdict", str(dest / "input0" / "dict.txt")]
        run(cmd)
    return dest


def make_dataset(
    root: Path, n_train: int = 384, n_valid: int = 128, seed: int = 0, pair: bool = False
) -> Path:
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    write_sentiment_split(raw / "train", n_train, seed, pair)
    write_sentiment_split(raw / "valid", n_valid, seed + 1, pair)
    return preprocess(raw, root / "bin", pair)


def make_dataset_with_test(root: Path, sizes: tuple[int, int, int] = (64, 32, 32)) -> Path:
    """train / valid (dev) / test of ``sizes`` examples, binarized in the sentence_prediction
    layout under ``root/bin``."""
    raw = root / "raw"
    raw.mkdir(parents=True)
    for (split, seed), n in zip((("train", 0), ("valid", 1), ("test", 2)), sizes):
        write_sentiment_split(raw / split, n, seed)
    dest = root / "bin"
    for field in ("input0", "label"):
        run(
            [
                str(BIN / "fairseq-preprocess"), "--only-source",
                "--trainpref", str(raw / f"train.{field}"),
                "--validpref", str(raw / f"valid.{field}"),
                "--testpref", str(raw / f"test.{field}"),
                "--destdir", str(dest / field), "--workers", "1",
            ]
        )  # fmt: skip
    return dest


def command_env(env: dict | None = None) -> dict:
    """The environment of a command run by the tests: one OpenMP thread, weights-only loads."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    return full_env


def run(cmd: list[str], env: dict | None = None, timeout: int = 900) -> str:
    """Runs a command (served, see fork_server.py); on failure raises with the tail of its
    output."""
    proc = subprocess.run(
        ForkServer.served(cmd), capture_output=True, text=True,
        env=command_env(ForkServer.served_env(env)),
        timeout=timeout, cwd=str(REPO),
    )  # fmt: skip
    returncode, out = proc.returncode, proc.stdout + proc.stderr
    if returncode != 0:
        raise AssertionError(f"command failed ({returncode}): {' '.join(cmd)}\n{out[-6000:]}")
    return out


def train_command(data: Path, save_dir: Path, *args: str) -> list[str]:
    """The ``fairseq-train`` command line of :func:`fairseq_train`: the recipe's builder with a
    test run's settings (CPU, a JSON log line per update, 2 classes), then ``args``."""
    return recipe.train_command(
        data,
        save_dir,
        task=None,
        num_classes=2,
        cpu=True,
        num_workers=0,
        log_format="json",
        log_interval=1,
        extra=args,
        fairseq_train=BIN / "fairseq-train",
        user_dir=USER_DIR,
    )


def fairseq_train(data: Path, save_dir: Path, *args: str, env: dict | None = None) -> str:
    return run(train_command(data, save_dir, *args), env=env)


def fails_with(
    data: Path, save_dir: Path, *args: str, message: str, env: dict | None = None
) -> str:
    """Runs fairseq-train (with ``env`` added to its environment), expects it to fail with
    ``message`` (a plain string) in its output; returns the output."""
    import pytest

    with pytest.raises(AssertionError, match=r"command failed") as info:
        fairseq_train(data, save_dir, *args, env=env)
    out = str(info.value)
    assert message in out, out[-3000:]
    return out


def trained_updates(out: str) -> list[int]:
    """The update counts of fairseq's JSON log records (none: no update was made)."""
    return [int(r["num_updates"]) for r in json_records(out) if "num_updates" in r]


def copy_data(src: Path, dst: Path, keep: tuple[str, ...] = ("input0", "label")) -> Path:
    """``dst`` with copies of the ``keep`` folders of the binarized dataset ``src``."""
    for key in keep:
        shutil.copytree(src / key, dst / key)
    return dst


def binarize(lines: list[str], dictionary, prefix: Path) -> None:
    """Writes lines as fairseq-preprocess would (mmap, </s> appended), with a fixed dict."""
    from fairseq.data import indexed_dataset

    builder = indexed_dataset.make_builder(f"{prefix}.bin", "mmap", vocab_size=len(dictionary))
    for line in lines:
        builder.add_item(dictionary.encode_line(line, add_if_not_exist=False, append_eos=True))
    builder.finalize(f"{prefix}.idx")


def raw_lines(data: Path, key: str, split: str) -> list[str]:
    """The text lines of a binarized split (``data/key/split``)."""
    from fairseq.data import Dictionary, indexed_dataset

    d = Dictionary.load(str(data / key / "dict.txt"))
    ds = indexed_dataset.make_dataset(str(data / key / split), impl="mmap")
    return [d.string(ds[i][:-1]) for i in range(len(ds))]


LAUNCHER = REPO / "scripts" / "launch_cpu_workers.sh"


def fairseq_train_workers(
    n: int, data: Path, save_dir: Path, *args: str, env: dict | None = None
) -> str:
    """``fairseq-train`` on ``n`` CPU worker processes (scripts/launch_cpu_workers.sh); the
    output has every line prefixed with ``[rank R] `` (see :func:`rank_output`)."""
    env = {"PYTHON": sys.executable, **(env or {})}
    return run(["bash", str(LAUNCHER), str(n), "--", *train_command(data, save_dir, *args)], env)


def rank_output(output: str, rank: int) -> str:
    """The lines one rank printed under scripts/launch_cpu_workers.sh, prefix removed."""
    prefix = f"[rank {rank}] "
    return "\n".join(line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix))


def fairseq_validate(data: Path, checkpoint: Path, *args: str) -> str:
    cmd = [
        str(BIN / "fairseq-validate"),
        str(data),
        "--user-dir",
        USER_DIR,
        "--path",
        str(checkpoint),
        "--cpu",
        "--num-workers",
        "0",
        "--log-format",
        "json",
        "--valid-subset",
        "valid",
        *args,
    ]
    return run(cmd)


def write_tsv(path: Path, n: int, seed: int, pair: bool = False) -> list[list[str]]:
    """``n`` labelled rows (text[, text2], label) of a learnable sentiment task, as TSV."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randint(0, 1)
        strong = POSITIVE if label else NEGATIVE
        words = [rng.choice(strong) for _ in range(3)] + rng.sample(NEUTRAL, rng.randint(2, 9))
        rng.shuffle(words)
        text = " ".join(words).capitalize() + "."
        row = [text, " ".join(rng.sample(NEUTRAL, 3))] if pair else [text]
        rows.append(row + ["pos" if label else "neg"])
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def prepare_tsv_task(root: Path, pair: bool = False) -> tuple[Path, list[list[str]]]:
    """A prepared (sentencepiece) custom task in ``root/out/sst-bin``; returns the test rows."""
    root.mkdir(parents=True, exist_ok=True)
    write_tsv(root / "train.tsv", 160, 0, pair)
    write_tsv(root / "valid.tsv", 40, 1, pair)
    test_rows = write_tsv(root / "test.tsv", 37, 2, pair)
    argv = ["--task", "custom", "--name", "sst", "--train", root / "train.tsv",
            "--valid", root / "valid.tsv", "--test", root / "test.tsv",
            "--text-columns", "1,2" if pair else "1", "--label-column", "3" if pair else "2",
            "--out-dir", root / "out", "--tokenizer", "sentencepiece",
            "--spm-vocab-size", "120", "--workers", "1"]  # fmt: skip
    from acl_fairseq.cli.prepare import main as prepare_main

    assert prepare_main([str(a) for a in argv]) == 0
    return root / "out" / "sst-bin", test_rows


PATCHED_TRAIN = REPO / "tests" / "patched_fairseq_train.py"


def fairseq_train_with(
    data: Path, save_dir: Path, *args: str, workers: int = 1, patches: tuple[str, ...] = ()
) -> str:
    """``fairseq-train`` on ``workers`` CPU processes (more than 1: through
    scripts/launch_cpu_workers.sh, see :func:`rank_output`), with the test-only ``patches`` of
    tests/patched_fairseq_train.py (e.g. ``("cpu_fp16",)``)."""
    cmd = train_command(data, save_dir, *args)
    env = {"PYTHON": sys.executable}
    if patches:
        cmd = [sys.executable, str(PATCHED_TRAIN), *cmd[1:]]
        env["ACL_TEST_PATCHES"] = ",".join(patches)
    if workers > 1:
        cmd = ["bash", str(LAUNCHER), str(workers), "--", *cmd]
    return run(cmd, env)
