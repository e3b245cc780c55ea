"""The README's commands run as written: every code block of README.md is either run here, in
README order in one working folder, or listed with the reason it is not (``NOT_RUN``); a new
block fails the test until it is classified.

The blocks run on CPU on stand-ins that keep the commands' shape: a tiny random BERT converted
by ``acl-fairseq-convert-bert`` plays roberta.base and ``M`` (``--arch roberta_base`` becomes its
``fairseq_args.txt``), ``DATA`` is a small prepared folder of that model's WordPiece, and a few
sizes are cut (``SIZES``). The working folder plays the repository root (``--user-dir
acl_fairseq``). ``acl-fairseq-NAME`` runs as ``python -m acl_fairseq.cli.NAME`` (the
same command, README's "Usage"), so this checkout's code runs whatever is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from acl_fairseq.experiment.recipe import multi_exit_arch

from fairseq_helpers import REPO, fairseq_train, train_args, write_tsv
from tiny_bert import tiny_bert

README = REPO / "README.md"
TOOLS = sorted(p.name for p in (REPO / "acl_fairseq" / "cli").iterdir() if (p / "cli.py").is_file())
NOT_RUN = {
    "make demo": "the demo itself (tests/test_demo.py runs it on a tiny BERT); make test is "
    "this suite",
    "python -m benchmarks.train_cost": "benchmarks: minutes each, measured on an idle machine",
    "fairseq-train DATA --user-dir acl_fairseq --task acl_sentence_prediction \\": "its '...' "
    "stands for the recipe above, and TensorBoard is not a dependency",
    "acl_fairseq/": "the layout, checked against the tree by tests/test_layering.py",
}
RUN = [
    "# ACL (ACL-Embed + ACL-Grad) on a RoBERTa/BERT checkpoint",
    'echo "a gripping, beautifully acted film" | acl-fairseq-predict '
    "checkpoints/stage2/checkpoint_best.pt",
    "from acl_fairseq.models import MultiExitRobertaModel",
    "acl-fairseq-compare DATA --restore-file M/model.pt --arch-args-file M/fairseq_args.txt \\",
    "acl-fairseq-fewshot reviews.tsv --text-columns 1 --label-column 2 \\",
    "acl-fairseq-sweep CKPT DATA --split valid --dtypes int8,bf16,fp32 --max-accuracy-drop 1",
    "from acl_fairseq.models import MultiExitRobertaModel",  # the saved precision's policy
]
SIZES = [  # (as written, as run): fewer seeds, draws and updates on the tiny data
    ("--seeds 1,2,3", "--seeds 1 --max-update 2"),
    ("--test-size 2000 --per-class 16,64 --draws 5",
     "--test-size 30 --per-class 2 --draws 2 --lrs 1e-3 --updates 2 --validate-every 1 "
     "--methods ce,acl --cpu"),
]  # fmt: skip


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of README.md, in order."""
    text = README.read_text(encoding="utf-8")
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def key(block: str) -> str:
    return next(line.rstrip() for line in block.splitlines() if line.strip())


def test_every_readme_block_is_run_or_says_why_not():
    keys = [key(text) for _, text in readme_blocks()]
    classified = {k: any(k.startswith(n) for n in NOT_RUN) or k in RUN for k in keys}
    assert all(classified.values()), [k for k, ok in classified.items() if not ok]
    assert [k for k in keys if k in RUN] == RUN  # the run blocks, in README order


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """The stand-ins: tiny converted BERT ``M``, ``DATA`` and a pair model, input files."""
    root = tmp_path_factory.mktemp("readme")
    from acl_fairseq.experiment.demo_assets import prepare_tsv
    from acl_fairseq.hf_bert.convert import convert

    model = root / "M"
    convert(tiny_bert(root / "hf"), model)
    args = (model / "fairseq_args.txt").read_text().split()
    folders = {}
    for name, pair in (("reviews", False), ("pairs", True)):
        raw = root / "raw" / name
        raw.mkdir(parents=True)
        for split, (n, seed) in {"train": (64, 0), "dev": (24, 1), "test": (24, 2)}.items():
            write_tsv(raw / f"{split}.tsv", n, seed, pair)
        folders[name] = prepare_tsv(raw, name, model, root / "data", "1,2" if pair else "1")
    pair_args = train_args(multi_exit_arch(args), criterion="multi_exit_ce", max_update=2,
                           no_epoch_checkpoints=True)  # fmt: skip
    fairseq_train(folders["pairs"], root / "pair", *pair_args, "--separator-token", "2",
                  "--restore-file", str(model / "model.pt"), "--reset-optimizer")  # fmt: skip
    work = root / "work"  # as the repository root: --user-dir acl_fairseq is the plugin
    work.mkdir()
    (work / "acl_fairseq").symlink_to(REPO / "acl_fairseq")
    (work / "sentences.txt").write_text("Good1 good2 w3.\nbad1 bad2 w4\nw5 w6\n")
    (work / "pairs.tsv").write_text("evidence\tclaim\nGood1 w2.\tw3 w4\nbad1 w5\tw6 w7\n")
    write_tsv(work / "reviews.tsv", 120, 3)
    return {
        "work": str(work),
        "M": str(model),
        "M_ARGS": shlex.join(args),
        "M_MULTI_ARGS": shlex.join(multi_exit_arch(args)),
        "DATA": str(folders["reviews"]),
        "PAIR_CKPT": str(root / "pair" / "checkpoint_last.pt"),
    }


def as_run(block: str, world: dict[str, str]) -> str:
    """The block with the stand-ins and the cut sizes (every replacement listed here)."""
    for written, run in [
        ("--arch roberta_base", world["M_ARGS"]),
        ("--arch multi_exit_roberta_base", world["M_MULTI_ARGS"]),
        ("roberta.base/model.pt", f"{world['M']}/model.pt"),
        (re.compile(r"(?<![\w/.])M/"), f"{world['M']}/"),
        ("--model M ", f"--model {world['M']} "),
        ("PAIR_CKPT", world["PAIR_CKPT"]),
        ("CKPT", "checkpoints/stage2/checkpoint_best.pt"),
        ("DATA", world["DATA"]),
        *SIZES,
    ]:
        if isinstance(written, re.Pattern):
            block = written.sub(run, block)
        else:
            block = block.replace(written, run)
    return block


def run_block(language: str, block: str, cwd: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    if language == "python":
        cmd = [sys.executable, "-c", block]
    else:
        tools = "".join(
            f'acl-fairseq-{t.replace("_", "-")}() {{ "{sys.executable}" -m acl_fairseq.cli.{t} '
            '"$@"; }\n'
            for t in TOOLS
        )
        cmd = ["bash", "-e", "-o", "pipefail", "-c", tools + block]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"README block failed:\n{block}\n---\n{output[-5000:]}"
    return output


@pytest.mark.slow
def test_the_readme_commands_run_as_written(world):
    blocks = [(lang, text) for lang, text in readme_blocks() if key(text) in RUN]
    outputs = [run_block(lang, as_run(text, world), world["work"]) for lang, text in blocks]
    work = Path(world["work"])
    assert (work / "checkpoints/stage2/checkpoint_best.pt").is_file()
    assert "accuracy_exit1" in outputs[0]  # fairseq-validate: every exit
    assert "acl-fairseq-predict: 3 sentences" in outputs[1]  # sentences.txt
    assert "acl-fairseq-predict: 2 sentences" in outputs[1]  # pairs.tsv after its header
    assert "['pos']" in outputs[2] or "['neg']" in outputs[2]  # result.labels
    assert (work / "RESULTS/results.md").is_file() and (work / "FEWSHOT/fewshot.md").is_file()
    assert (work / "checkpoints/stage2/early_exit_policy.json").is_file()  # the sweep's
    assert "dtype: bf16" in outputs[5]
