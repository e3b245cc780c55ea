"""The documentation's commands run as written: every code block of README.md and of the user
pages under docs/ (``PAGES``) is either run here, in page order in one working folder, or listed
with the reason it is not (``NOT_RUN``); a new block fails the test until it is classified, and
so does a new docs/ page until it is in ``PAGES`` or ``NOT_PAGES``. Every relative link of these
pages resolves to a file or a heading.

The blocks run on CPU on stand-ins that keep the commands' shape: a tiny random BERT plays the
Hugging Face BERT of the README's path, and its conversion by ``acl-fairseq-convert-bert`` plays
roberta.base and ``M`` (``--arch roberta_base`` becomes its ``fairseq_args.txt``); ``DATA`` is
the folder the README's path prepares; a few sizes are cut (``SIZES``). The working folder plays
the repository root (``--user-dir acl_fairseq``). ``acl-fairseq-NAME`` runs as ``python -m
acl_fairseq.cli.NAME`` (the same command, docs/usage.md), so this checkout's code runs whatever
is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from fork_server import ForkServer

from acl_fairseq.experiment.recipe import multi_exit_arch

from fairseq_helpers import REPO, fairseq_train, train_args, write_tsv
from tiny_bert import tiny_bert

PAGES = [  # in the order their blocks run: the README's path prepares and trains first
    "README.md",
    "docs/usage.md",
    "docs/inference.md",
    "docs/gpus.md",
    "docs/acl_grad.md",
    "docs/architecture.md",
]
NOT_PAGES = {  # docs/*.md whose blocks are not run, and why
    "docs/results.md": "the lab notebook: its commands record how each number was made (hours "
    "of training in the study's work folder)",
    "docs/archive.md": "earlier measurements, kept as written: their commands name the tools and "
    "folders of their time",
}
TOOLS = sorted(
    p.stem
    for p in (REPO / "acl_fairseq" / "cli").iterdir()
    if (p.suffix == ".py" and not p.name.startswith("_")) or (p / "cli.py").is_file()
)
NOT_RUN = {
    "make demo": "the demo itself (tests/test_demo.py runs it on a tiny BERT); make test is "
    "this suite",
    "python -m benchmarks.train_cost": "benchmarks: minutes each, measured on an idle machine",
    "fairseq-train DATA --user-dir acl_fairseq --task acl_sentence_prediction \\": "its '...' "
    "stands for the recipe, and TensorBoard is not a dependency",
    "errors": "the layers, checked against the imports by tests/test_layering.py",
    "acl_fairseq/": "the layout, checked against the tree by tests/test_layering.py",
}
RUN = [  # (page, first line) of every block that runs, in page order
    ("README.md", "acl-fairseq-convert-bert path/to/hf-bert bert-fairseq   # model.pt, dict.txt, "
     "tokenizer, flags"),
    ("docs/usage.md", "acl-fairseq-compare DATA --restore-file M/model.pt --arch-args-file "
     "M/fairseq_args.txt \\"),
    ("docs/usage.md", "acl-fairseq-fewshot reviews.tsv --text-columns 1 --label-column 2 \\"),
    ("docs/inference.md", 'echo "a gripping, beautifully acted film" | acl-fairseq-predict '
     "checkpoints/stage2/checkpoint_best.pt"),
    ("docs/inference.md", "from acl_fairseq.models import MultiExitRobertaModel"),
    ("docs/inference.md", "acl-fairseq-sweep CKPT DATA --split valid --dtypes int8,bf16,fp32 "
     "--max-accuracy-drop 1"),
    ("docs/inference.md", "from acl_fairseq.models import MultiExitRobertaModel"),  # saved policy
    ("docs/inference.md", "acl-fairseq-export-hf checkpoints/stage2/checkpoint_best.pt hf-model"
     "            # the final exit"),
    ("docs/inference.md", "from transformers import pipeline"),
    ("docs/inference.md", "acl-fairseq-bundle checkpoints/stage2/checkpoint_best.pt bundle "
     "--dtype int8   # here: the saved policy"),
    ("docs/inference.md", "import sys"),  # the bundle's Python API
]  # fmt: skip
SIZES = [  # (as written, as run): fewer seeds, draws and updates on the tiny data
    ("--seeds 1,2,3", "--seeds 1 --max-update 2"),
    ("--test-size 2000 --per-class 16,64 --draws 5",
     "--test-size 30 --per-class 2 --draws 2 --lrs 1e-3 --updates 2 --validate-every 1 "
     "--methods ce,acl --cpu"),
]  # fmt: skip


def page_blocks(page: str) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of ``page``, in order."""
    text = (REPO / page).read_text(encoding="utf-8")
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def blocks() -> list[tuple[str, str, str]]:
    """(page, language, text) of every block of ``PAGES``, in run order."""
    return [(page, lang, text) for page in PAGES for lang, text in page_blocks(page)]


def key(block: str) -> str:
    return next(line.rstrip() for line in block.splitlines() if line.strip())


def test_every_docs_page_is_run_or_says_why_not():
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages <= set(PAGES) | set(NOT_PAGES), sorted(pages - set(PAGES) - set(NOT_PAGES))
    assert all((REPO / p).is_file() for p in [*PAGES, *NOT_PAGES])


def test_every_block_is_run_or_says_why_not():
    keys = [(page, key(text)) for page, _, text in blocks()]
    classified = {k: any(k[1].startswith(n) for n in NOT_RUN) or k in RUN for k in keys}
    assert all(classified.values()), [k for k, ok in classified.items() if not ok]
    assert [k for k in keys if k in RUN] == RUN  # the run blocks, in page order


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated heading gets -1, -2, ...)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", text, flags=re.M):
        anchor = github_anchor(heading)
        seen[anchor] = seen.get(anchor, 0) + 1
        if seen[anchor] > 1:
            seen[f"{anchor}-{seen[anchor] - 1}"] = 1
    return set(seen)


def test_every_relative_link_resolves():
    broken = []
    for page in [*PAGES, *NOT_PAGES]:
        path = REPO / page
        text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and anchor not in anchors(linked)):
                broken.append(f"{page}: {target}")
    assert not broken, broken


@pytest.fixture(scope="module")
def path_world(tmp_path_factory) -> dict[str, str]:
    """What the README's path needs: a tiny Hugging Face BERT and the input files in the
    working folder; ``DATA`` is where the path prepares its data."""
    root = tmp_path_factory.mktemp("readme")
    work = root / "work"  # as the repository root: --user-dir acl_fairseq is the plugin
    work.mkdir()
    tiny_bert(root / "hf")
    for split, (n, seed) in {"train": (64, 0), "dev": (24, 1), "test": (24, 2)}.items():
        write_tsv(work / f"{split}.tsv", n, seed)  # the README's train / dev / test TSVs
    (work / "acl_fairseq").symlink_to(REPO / "acl_fairseq")
    (work / "sentences.txt").write_text("Good1 good2 w3.\nbad1 bad2 w4\nw5 w6\n")
    return {
        "root": str(root),
        "work": str(work),
        "HF": str(root / "hf"),
        "DATA": str(work / "data" / "reviews-bin"),
    }


@pytest.fixture(scope="module")
def readme_path(path_world) -> str:
    """The output of the README's path (its blocks run first: the pages after it use its data
    and checkpoints)."""
    out = [
        run_block(lang, as_run(text, path_world), path_world["work"])
        for page, lang, text in blocks()
        if page == "README.md" and (page, key(text)) in RUN
    ]
    assert len(out) == len([r for r in RUN if r[0] == "README.md"])
    return "".join(out)


@pytest.fixture(scope="module")
def world(path_world, readme_path) -> dict[str, str]:
    """The other stand-ins, after the README's path: its conversion ``M``, a pair model, the
    other input files."""
    from acl_fairseq.experiment.demo_assets import prepare_tsv
    from acl_fairseq.hf_bert.convert import convert

    root, work = Path(path_world["root"]), Path(path_world["work"])
    model = root / "M"
    convert(root / "hf", model)
    args = (model / "fairseq_args.txt").read_text().split()
    raw = root / "raw" / "pairs"
    raw.mkdir(parents=True)
    for split, (n, seed) in {"train": (64, 0), "dev": (24, 1), "test": (24, 2)}.items():
        write_tsv(raw / f"{split}.tsv", n, seed, pair=True)
    pairs = prepare_tsv(raw, "pairs", model, root / "data", "1,2")
    pair_args = train_args(multi_exit_arch(args), criterion="multi_exit_ce", max_update=2,
                           no_epoch_checkpoints=True)  # fmt: skip
    fairseq_train(pairs, root / "pair", *pair_args, "--separator-token", "2",
                  "--restore-file", str(model / "model.pt"), "--reset-optimizer")  # fmt: skip
    (work / "pairs.tsv").write_text("evidence\tclaim\nGood1 w2.\tw3 w4\nbad1 w5\tw6 w7\n")
    write_tsv(work / "reviews.tsv", 120, 3)
    return {
        **path_world,
        "M": str(model),
        "M_ARGS": shlex.join(args),
        "M_MULTI_ARGS": shlex.join(multi_exit_arch(args)),
        "PAIR_CKPT": str(root / "pair" / "checkpoint_last.pt"),
    }


def as_run(block: str, world: dict[str, str]) -> str:
    """The block with the stand-ins and the cut sizes (every replacement listed here)."""
    w = defaultdict(lambda: "MISSING", world)  # the README's path: before M and the pair model
    for written, run in [
        ("--arch roberta_base", w["M_ARGS"]),
        ("--arch multi_exit_roberta_base", w["M_MULTI_ARGS"]),
        ("roberta.base/model.pt", f"{w['M']}/model.pt"),
        (re.compile(r"(?<![\w/.])M/"), f"{w['M']}/"),
        ("--model M ", f"--model {w['M']} "),
        ("path/to/hf-bert", w["HF"]),
        ("PAIR_CKPT", w["PAIR_CKPT"]),
        ("CKPT", "checkpoints/stage2/checkpoint_best.pt"),
        ("DATA", w["DATA"]),
        # offline: the runner's three requirements are installed here already
        (
            "pip install numpy onnxruntime tokenizers",
            'python -c "import numpy, onnxruntime, tokenizers"',
        ),
        # the sweep's deploy-time guard compares wall-clock times, which on a tiny model and a
        # busy machine go either way (tested with fakes in test_early_exit_sweep.py): untimed
        ("--max-accuracy-drop 1\n", "--max-accuracy-drop 1 --repeats 0\n"),
        *SIZES,
    ]:
        if isinstance(written, re.Pattern):
            block = written.sub(run, block)
        else:
            block = block.replace(written, run)
    assert "MISSING" not in block, block
    return block


def run_block(language: str, block: str, cwd: str) -> str:
    """Runs the block; its commands served (tests/fork_server.py): ``python`` and the
    commands after ``fairseq-`` and ``acl-fairseq-`` are the server's stand-ins."""
    python = ForkServer.served([sys.executable])[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    path = [str(Path(python).parent), str(Path(sys.executable).parent), env["PATH"]]
    env["PATH"] = os.pathsep.join(path)
    if language == "python":
        cmd = [python, "-c", block]
    else:
        tools = "".join(
            f'acl-fairseq-{t.replace("_", "-")}() {{ "{python}" -m acl_fairseq.cli.{t} "$@"; }}\n'
            for t in TOOLS
        )
        cmd = ["bash", "-e", "-o", "pipefail", "-c", tools + block]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"block failed:\n{block}\n---\n{output[-5000:]}"
    return output


@pytest.mark.slow
@pytest.mark.server_off
def test_the_readme_path_runs_as_written(path_world, readme_path):
    """The README's path: convert, prepare, the two trainings, fairseq-validate, predict."""
    work = Path(path_world["work"])
    assert (Path(path_world["DATA"]) / "label" / "dict.txt").is_file()  # prepared by the path
    assert (work / "bert-fairseq" / "model.pt").is_file()  # converted by the path
    assert (work / "checkpoints/stage2/checkpoint_best.pt").is_file()
    assert "accuracy_exit1" in readme_path  # fairseq-validate: every exit
    assert "acl-fairseq-predict: 3 sentences" in readme_path  # sentences.txt


@pytest.mark.slow
def test_the_documented_commands_run_as_written(world):
    """The other pages' blocks, in page order, in the folder the README's path left."""
    work = Path(world["work"])
    out = []  # the output of each RUN block after the README's, in RUN order
    for page, lang, text in blocks():
        if page != "README.md" and (page, key(text)) in RUN:
            out.append(run_block(lang, as_run(text, world), world["work"]))
    compare, fewshot, predict, hub, sweep, saved, export, classify, bundle, bundled = out
    assert (work / "RESULTS/results.md").is_file() and (work / "FEWSHOT/fewshot.md").is_file()
    assert "acl-fairseq-predict: 3 sentences" in predict  # sentences.txt
    assert "acl-fairseq-predict: 2 sentences" in predict  # pairs.tsv after its header
    assert "['pos']" in hub or "['neg']" in hub  # result.labels
    assert (work / "checkpoints/stage2/early_exit_policy.json").is_file()  # the sweep's
    assert "dtype: bf16" in sweep
    assert saved.startswith("int8 ")  # hub.dtype: the sweep's first precision is the default
    assert "exit 1 of 2 layers as BertForSequenceClassification" in export
    assert (work / "hf-model" / "model.safetensors").is_file()
    assert "'label': 'pos'" in classify or "'label': 'neg'" in classify
    assert "policy: " in bundle and "early-exit-runner: 3 sentences" in bundle  # sentences.txt
    assert (work / "bundle" / "bundle.json").is_file()
    assert str(work) not in (work / "bundle" / "bundle.json").read_text()  # no machine path
    assert "Prediction(label=" in bundled
