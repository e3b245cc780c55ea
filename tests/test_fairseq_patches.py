"""The register of fairseq patches (``acl_fairseq.fairseq_patches``): every patch is installed
from it and from nowhere else, its table is the one in docs/usage.md, its scope is what it says
(a stock run of fairseq with the plugin loaded runs as fairseq), ``ACL_FAIRSEQ_GUARD_RAILS``
switches the guard rails, and fairseq's own contracts hold with the plugin loaded."""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import sys
from pathlib import Path
from unittest.mock import MagicMock, patch

import pytest
import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf

from acl_fairseq import fairseq_patches
from acl_fairseq.errors import AclValueError

from fairseq_helpers import BIN, REPO, USER_DIR, run, train_args

PACKAGE = REPO / "acl_fairseq"
USAGE = REPO / "docs" / "usage.md"


def resolve(target: str) -> object:
    """The object a dotted ``target`` names now (``fairseq.file_io.PathManager.copy``)."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


def defined_in(obj: object) -> Path:
    """The file that defines ``obj`` (a wrapper's own file, not the function it wraps)."""
    code = getattr(obj, "__code__", None)
    return Path(code.co_filename if code is not None else inspect.getfile(obj)).resolve()


@pytest.mark.parametrize("patch_", fairseq_patches.PATCHES, ids=lambda p: p.target)
def test_every_patch_is_installed_from_the_register(patch_):
    if patch_.target == "sys.excepthook":  # only in fairseq's commands (test_errors.py)
        return
    assert defined_in(resolve(patch_.target)) == _module_file(patch_.replacement)
    before = resolve(patch_.target)
    fairseq_patches.install()  # idempotent: nothing wrapped twice
    assert resolve(patch_.target) is before


def _module_file(name: str) -> Path:
    """The file of the module ``name`` names, or of the module that holds it."""
    while name not in sys.modules:
        name = name.rpartition(".")[0]
    return Path(sys.modules[name].__file__).resolve()


def _fairseq_names(tree: ast.Module) -> set[str]:
    """The names a module binds to fairseq modules or objects (and ``sys``)."""
    names = {"sys"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fairseq"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if "fairseq" in a.name}
    return names


def test_no_module_patches_fairseq_outside_the_register():
    """An assignment to an attribute of fairseq (or ``sys``), or a ``setattr`` on one, appears
    only in the modules the register names as replacements."""
    allowed = {_module_file(p.replacement) for p in fairseq_patches.PATCHES}
    found = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = _fairseq_names(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                targets = node.args[:1]
            for target in targets:
                base = target
                while isinstance(base, ast.Attribute):
                    base = base.value
                if target is not base and isinstance(base, ast.Name) and base.id in names:
                    found.append((path, ast.unparse(target)))
    outside = [(str(p.relative_to(REPO)), t) for p, t in found if p.resolve() not in allowed]
    assert found and not outside, outside


def test_the_docs_table_is_the_register():
    assert fairseq_patches.markdown_table() in USAGE.read_text(encoding="utf-8")
    assert fairseq_patches.CHECKED_AGAINST in USAGE.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "value, in_use, expected",
    [
        (None, False, False),  # a stock run: fairseq's own behaviour
        (None, True, True),  # a plugin run
        ("plugin", True, True),
        ("all", False, True),  # a stock run that opts in
        ("off", True, False),  # none, also for the plugin's runs
        ("OFF ", True, False),
    ],
)
def test_the_guard_rails_act_where_the_setting_says(monkeypatch, value, in_use, expected):
    monkeypatch.setattr(fairseq_patches, "_in_use", {"task"} if in_use else set())
    if value is None:
        monkeypatch.delenv(fairseq_patches.GUARD_RAILS_ENV, raising=False)
    else:
        monkeypatch.setenv(fairseq_patches.GUARD_RAILS_ENV, value)
    assert fairseq_patches.guard_rails() is expected
    assert fairseq_patches.plugin_run() is in_use


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(fairseq_patches.GUARD_RAILS_ENV, "sometimes")
    with pytest.raises(AclValueError, match="ACL_FAIRSEQ_GUARD_RAILS=sometimes: must be one of"):
        fairseq_patches.install()


# --------------------------------------------------- fairseq's contracts, with the plugin loaded


def minimal_checkpoint_cfg(**changes: object):
    """The partial checkpoint config fairseq's own tests pass to ``load_checkpoint``
    (tests/test_train.py of the fairseq repository): no ``no_save``, ``save_dir`` None."""
    return OmegaConf.create(
        {
            "save_dir": None,
            "optimizer_overrides": "{}",
            "reset_dataloader": False,
            "reset_meters": False,
            "reset_optimizer": False,
            "reset_lr_scheduler": False,
            "finetune_from_model": None,
            "model_parallel_size": 1,
            "restore_file": "checkpoint_last.pt",
            **changes,
        }
    )


def _load(function, cfg) -> tuple[str, object]:
    """``("ok", the epoch iterator's epoch)`` or ``("error", its type and message)`` of
    ``function(cfg, trainer)`` with fairseq's test mocks (a trainer whose checkpoint is at
    epoch 2)."""
    trainer = MagicMock()
    trainer.load_checkpoint.return_value = {
        "train_iterator": {"epoch": 2, "iterations_in_epoch": 5, "shuffle": False}
    }
    trainer.get_num_updates.return_value = 7
    trainer.checkpoint_suffix = ""
    mocks = {
        "os.makedirs": MagicMock(),
        "os.path.join": MagicMock(),
        "os.path.isfile": MagicMock(return_value=True),
        "os.path.isabs": MagicMock(return_value=False),
        "fairseq.file_io.PathManager.exists": MagicMock(return_value=False),
    }
    started = [patch(name, mock) for name, mock in mocks.items()]
    for p in started:
        p.start()
    try:
        function(cfg, trainer)
        return "ok", trainer.get_train_iterator.call_args
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"
    finally:
        for p in started:
            p.stop()


@pytest.mark.parametrize("in_use", [False, True], ids=["stock_run", "plugin_run"])
@pytest.mark.parametrize(
    "changes",
    [{}, {"finetune_from_model": "/x/model.pt", "restore_file": "/y/model.pt"}],
    ids=["minimal", "finetune_and_restore"],
)
def test_load_checkpoint_with_fairseqs_minimal_config_is_fairseqs(monkeypatch, in_use, changes):
    """The wrapper reads optional keys with defaults and lets fairseq's own errors through:
    the same outcome (or the same error) as fairseq's function, in a stock and a plugin run."""
    monkeypatch.setattr(fairseq_patches, "_in_use", {"task"} if in_use else set())
    monkeypatch.delenv(fairseq_patches.GUARD_RAILS_ENV, raising=False)
    wrapper = checkpoint_utils.load_checkpoint
    assert getattr(wrapper, "__wrapped__", None) is not None
    cfg = minimal_checkpoint_cfg(**changes)
    ours, fairseqs = _load(wrapper, cfg), _load(wrapper.__wrapped__, cfg)
    assert ours == fairseqs
    if changes:
        assert fairseqs[0] == "error" and "can not be specified together" in fairseqs[1]


def write_lm_data(folder: Path) -> Path:
    """A tiny language-modelling corpus, binarized by fairseq-preprocess."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(30)]
    raw = folder / "raw"
    raw.mkdir(parents=True)
    for split, n in (("train", 120), ("valid", 30)):
        lines = (" ".join(rng.choices(words, k=rng.randint(4, 12))) for _ in range(n))
        (raw / f"{split}.txt").write_text("\n".join(lines) + "\n")
    run(
        [
            str(BIN / "fairseq-preprocess"), "--only-source", "--trainpref",
            str(raw / "train.txt"), "--validpref", str(raw / "valid.txt"), "--destdir",
            str(folder / "bin"), "--workers", "1",
        ]
    )  # fmt: skip
    return folder / "bin"


LM = [
    "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "1",
    "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads",
    "2", "--tokens-per-sample", "16", "--batch-size", "8", "--optimizer", "adam", "--lr",
    "1e-3", "--max-update", "4", "--seed", "1", "--cpu", "--num-workers", "0",
]  # fmt: skip


def train_stock(data: Path, save_dir: Path, args: list[str], plugin: bool, env: dict) -> None:
    """fairseq-train, with or without ``--user-dir acl_fairseq`` (served: the tests' fork
    server imports torch and fairseq's entry points, nothing of the plugin)."""
    cmd = [str(BIN / "fairseq-train"), str(data), "--save-dir", str(save_dir), *args]
    run(cmd + (["--user-dir", str(USER_DIR)] if plugin else []), env=env)


def what_was_saved(save_dir: Path) -> tuple[list[str], dict]:
    """The files of ``save_dir`` and what its last checkpoint holds besides its configuration
    (which records ``--user-dir``) and the meters (wall-clock times)."""
    files = sorted(p.name for p in save_dir.iterdir())
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    extra = {k: v for k, v in state["extra_state"].items() if k in ("train_iterator", "epoch")}
    return files, {
        "model": state["model"],
        "optimizer": state["last_optimizer_state"],
        "extra": extra,
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, guard_rails",
    [("language_modeling", None), ("sentence_prediction", None), ("sentence_prediction", "off")],
)
def test_a_stock_run_saves_the_same_with_the_plugin_loaded(
    sentiment_data, tmp_path, kind, guard_rails
):
    """A run whose task, criterion and architecture are all fairseq's: the same files in
    --save-dir and bit-identical weights, optimizer state and data position, with and without
    ``--user-dir acl_fairseq`` (by default, and with the guard rails switched off)."""
    if kind == "language_modeling":
        data, args = write_lm_data(tmp_path / "lm"), LM
    else:
        data = sentiment_data
        args = [*train_args(task="sentence_prediction"), "--criterion", "sentence_prediction",
                "--num-classes", "2", "--max-update", "4", "--cpu",
                "--num-workers", "0"]  # fmt: skip
    env = {fairseq_patches.GUARD_RAILS_ENV: guard_rails} if guard_rails else {}
    train_stock(data, tmp_path / "stock", args, plugin=False, env=env)
    train_stock(data, tmp_path / "plugin", args, plugin=True, env=env)
    stock_files, stock = what_was_saved(tmp_path / "stock")
    plugin_files, plugin = what_was_saved(tmp_path / "plugin")
    assert plugin_files == stock_files and "checkpoint_last.pt" in stock_files
    assert not [f for f in plugin_files if f.endswith((".tmp", ".lock"))]
    assert _same(plugin, stock)
