"""The one inference loader (``acl_fairseq.inference.loader``) and what goes through it: the
hub (``from_pretrained``) on a tiny checkpoint saved like fairseq-train saves one, the saved
policy tied to the weights it was chosen on, precisions refused before the checkpoint is read.
The commands on trained checkpoints are tested in test_predict.py and test_training_data.py."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from acl_fairseq.checkpoint.fingerprint import model_fingerprint
from acl_fairseq.cli import predict as predict
from acl_fairseq.early_exit.policies import EntropyPolicy, MaxProbPolicy
from acl_fairseq.inference import loader
from acl_fairseq.inference.loader import CheckpointError, load_for_inference, read_checkpoint
from acl_fairseq.inference.saved_policy import (
    FINGERPRINT,
    POLICY_FILE,
    read_policy,
    write_policy,
)
from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel
from acl_fairseq.runtime.precision import model_precision

from fairseq_helpers import REPO
from tiny_models import HEAD, LENGTHS, tiny_batch


# ------------------------------------------------------------------- one place, one order
def test_the_library_calls_fairseqs_model_loading_in_one_place():
    """Every inference path goes through load_for_inference: fairseq's model loading
    (``load_model_ensemble*``, ``hub_utils.from_pretrained``) is called once, in loader.py."""
    calls = re.compile(r"\b(load_model_ensemble\w*|hub_utils\.from_pretrained)\s*\(")
    found = []
    for folder in ("acl_fairseq", "benchmarks", "studies"):
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            found += [(str(path.relative_to(REPO)), m.group(1)) for m in calls.finditer(text)]
    assert found == [("acl_fairseq/inference/loader.py", "load_model_ensemble_and_task")]
    assert "hub_utils" not in (REPO / "acl_fairseq/models/multi_exit_roberta.py").read_text()


def test_int8_on_cuda_stops_before_the_checkpoint_is_read(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoint_best.pt"
    ckpt.write_bytes(b"never read")

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(loader, "read_checkpoint", never)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out, err = io.StringIO(), io.StringIO()
    code = predict.main([str(ckpt), "--dtype", "int8"], io.StringIO("a film\n"), out, err)
    assert code == 2 and out.getvalue() == ""
    assert err.getvalue() == (
        "acl-fairseq-predict: error: --dtype int8 runs on the CPU only (torch's dynamic "
        "quantization), not on cuda: add --cpu, or use --dtype bf16\n"
    )
    with pytest.raises(CheckpointError, match=r"^dtype='int8' runs on the CPU only .* on cuda"):
        load_for_inference(ckpt, device="cuda", dtype="int8", dtype_flag="dtype")


# ------------------------------------------------------------------- the saved policy's tie
def test_model_fingerprint_names_the_weights_not_the_file():
    state = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.zeros(2)}
    same = {"b.bias": torch.zeros(2), "a.weight": torch.arange(6.0).view(2, 3).clone()}
    assert model_fingerprint(state) == model_fingerprint(same)  # order, storage: no matter
    moved = dict(state, **{"a.weight": state["a.weight"] + 1e-6})
    assert model_fingerprint(moved) != model_fingerprint(state)
    renamed = {"c.weight": state["a.weight"], "b.bias": state["b.bias"]}
    assert model_fingerprint(renamed) != model_fingerprint(state)
    reshaped = dict(state, **{"a.weight": state["a.weight"].view(3, 2)})
    assert model_fingerprint(reshaped) != model_fingerprint(state)
    half = {k: v.to(torch.bfloat16) for k, v in state.items()}
    assert model_fingerprint(half) != model_fingerprint(state)
    assert re.fullmatch(r"[0-9a-f]{64}", model_fingerprint(half))


def test_a_saved_policy_names_why_it_is_not_for_a_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoint_best.pt"
    ckpt.write_bytes(b"")
    write_policy(ckpt, EntropyPolicy(0.3), fingerprint="abc")
    saved = read_policy(ckpt)
    assert saved.fields[FINGERPRINT] == "abc" and saved.mismatch("abc", ckpt) == ""
    last = tmp_path / "checkpoint_last.pt"
    assert saved.mismatch("def", last) == (
        f"{tmp_path / POLICY_FILE} was chosen on other weights (checkpoint_best.pt as it was "
        f"then) than {last}'s: rerun acl-fairseq-sweep {last} DATA --max-accuracy-drop D to "
        "choose one for it"
    )
    write_policy(ckpt, EntropyPolicy(0.3))  # as older sweeps wrote it
    old = read_policy(ckpt).mismatch("abc", ckpt)
    assert old.startswith(
        f"{tmp_path / POLICY_FILE} does not record the model it was chosen on (written by an "
        f"older acl-fairseq-sweep), so it may not be {ckpt}'s: rerun acl-fairseq-sweep"
    )


# ------------------------------------------------------------------- the hub, on a tiny model
@pytest.fixture
def tiny_checkpoint(tiny_built, tiny_data, tmp_path, monkeypatch) -> Path:
    """``tmp_path/model/model.pt`` with its dictionaries beside it (a released model's
    layout); the data folder also at ``tmp_path/data-bin``."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    model, _, cfg = tiny_built
    folder = tmp_path / "model"
    for root in (folder, tmp_path / "data-bin"):
        for sub in ("input0", "label"):
            (root / sub).mkdir(parents=True)
            shutil.copy(tiny_data / sub / "dict.txt", root / sub / "dict.txt")
    torch.save(
        {
            "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "model": model.state_dict(),
            "optimizer_history": [{"criterion_name": "SentencePredictionCriterion",
                                   "optimizer_name": "FairseqAdam",
                                   "lr_scheduler_state": {"best": None}, "num_updates": 0}],
            "extra_state": {},
        },
        folder / "model.pt",
    )  # fmt: skip
    return folder / "model.pt"


def test_hub_data_folder_relative_to_the_current_directory(tiny_checkpoint, monkeypatch):
    folder = str(tiny_checkpoint.parent)
    monkeypatch.chdir(tiny_checkpoint.parent.parent)
    for given in ("./data-bin", "data-bin"):
        hub = MultiExitRobertaModel.from_pretrained(folder, "model.pt", given, bpe=None)
        assert Path(hub.task.cfg.data) == tiny_checkpoint.parent.parent / "data-bin"
    hub = MultiExitRobertaModel.from_pretrained(folder, "model.pt", ".", bpe=None)
    assert Path(hub.task.cfg.data) == tiny_checkpoint.parent  # fairseq's: the model's folder
    with pytest.raises(ValueError) as info:
        MultiExitRobertaModel.from_pretrained(folder, "model.pt", "./dta-bin", bpe=None)
    assert str(info.value) == (
        f"data_name_or_path ./dta-bin: no such folder in the current directory "
        f"({Path.cwd() / 'dta-bin'}) or in the model's folder ({tiny_checkpoint.parent / 'dta-bin'}"
        "): give the prepared data folder, absolute or relative to the current directory"
    )
    missing = tiny_checkpoint.parent.parent / "nowhere-bin"
    with pytest.raises(ValueError, match=f"^data_name_or_path {missing}: no such folder$"):
        MultiExitRobertaModel.from_pretrained(folder, "model.pt", str(missing), bpe=None)
    with pytest.raises(ValueError, match="^model_name_or_path .*/nothing: no such folder"):
        MultiExitRobertaModel.from_pretrained(folder + "/nothing", "model.pt", bpe=None)


def test_hub_dtype_is_read_only_and_int8_stays_on_the_cpu(tiny_checkpoint):
    folder = str(tiny_checkpoint.parent)
    hub = MultiExitRobertaModel.from_pretrained(folder, "model.pt", ".", bpe=None, dtype="int8")
    assert hub.dtype == "int8"
    with pytest.raises(AttributeError) as info:
        hub.dtype = "fp32"
    assert str(info.value) == (
        "hub.dtype is read-only: the model runs at int8; to run at fp32, load it again with "
        "from_pretrained(..., dtype='fp32')"
    )
    assert hub.dtype == "int8"
    for move in (lambda: hub.cuda(), lambda: hub.to("cuda:0")):
        with pytest.raises(ValueError, match=r"^hub.dtype int8 runs on the CPU only .*: keep it"):
            move()
    assert hub.to("cpu") is hub and hub.device.type == "cpu"


def test_hub_accepts_the_policy_none(tiny_checkpoint, tiny_built):
    _, task, _ = tiny_built
    hub = MultiExitRobertaModel.from_pretrained(str(tiny_checkpoint.parent), "model.pt", ".",
                                                bpe=None)  # fmt: skip
    tokens, _ = tiny_batch(task, LENGTHS)
    full = hub.predict_early_exit(HEAD, tokens, "none")
    assert full.exit_layers.tolist() == [4] * len(LENGTHS)
    assert torch.allclose(full.logits, hub.predict(HEAD, tokens, return_logits=True), atol=1e-5)
    hub.default_policy = "none"
    assert hub.predict_early_exit(HEAD, tokens).exit_layers.tolist() == [4] * len(LENGTHS)


def test_hub_names_empty_and_wrong_tokens(tiny_checkpoint, tiny_built):
    """``predict_early_exit(head, [])`` was an AttributeError traceback ('list' has no
    'dim'); now empty or unusable tokens are one ValueError naming the fix, and a list of
    ids predicts as its tensor does."""
    _, task, _ = tiny_built
    hub = MultiExitRobertaModel.from_pretrained(str(tiny_checkpoint.parent), "model.pt", ".",
                                                bpe=None)  # fmt: skip
    for empty in ([], torch.zeros(0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        for call in (hub.predict_early_exit, hub.exit_logits, hub.predict):
            with pytest.raises(ValueError, match=r"^tokens is empty \(shape .*hub.encode\(text\)"):
                call(HEAD, empty)
    with pytest.raises(ValueError, match="^tokens must be fairseq ids, .* not str"):
        hub.predict_early_exit(HEAD, "a text")
    size = len(task.source_dictionary)
    for outside in ([0, size, 2], [0, -3, 2], torch.tensor([[0, 5, 2], [0, size + 7, 2]])):
        with pytest.raises(ValueError, match=r"^tokens holds id -?\d+, outside the dictionary"):
            hub.predict_early_exit(HEAD, outside)
    for fractional in ([0, 5.5, 2], torch.tensor([0.0, 5.0, 2.0]), torch.tensor([True, False])):
        with pytest.raises(ValueError, match=r"^tokens must be whole-number fairseq ids"):
            hub.predict_early_exit(HEAD, fractional)
    tokens, _ = tiny_batch(task, [5])
    as_list = hub.predict_early_exit(HEAD, tokens[0].tolist(), "none")
    assert torch.equal(as_list.logits, hub.predict_early_exit(HEAD, tokens, "none").logits)


def test_hub_uses_a_saved_policy_only_for_its_weights(tiny_checkpoint, caplog):
    folder = str(tiny_checkpoint.parent)
    weights = model_fingerprint(read_checkpoint(tiny_checkpoint)["model"])
    policy = MaxProbPolicy(0.0)  # everything leaves at the first exit
    write_policy(tiny_checkpoint, policy, dtype="bf16", fingerprint=weights, accuracy=99.0)
    hub = MultiExitRobertaModel.from_pretrained(folder, "model.pt", ".", bpe=None)
    assert hub.default_policy == policy and hub.dtype == "bf16"

    # the same folder, another checkpoint (retrained after the sweep): full depth, fp32
    state = torch.load(tiny_checkpoint, weights_only=False)
    state["model"][next(iter(state["model"]))].add_(0.01)
    torch.save(state, tiny_checkpoint.with_name("checkpoint_last.pt"))
    with caplog.at_level(logging.WARNING):
        other = MultiExitRobertaModel.from_pretrained(folder, "checkpoint_last.pt", ".", bpe=None)
    assert other.default_policy is None and other.dtype == "fp32"
    file = tiny_checkpoint.parent / POLICY_FILE
    assert (
        f"early exit: full depth by default, not the saved policy: {file} was chosen on other "
        f"weights (model.pt as it was then) than {tiny_checkpoint.with_name('checkpoint_last.pt')}"
    ) in caplog.text
    # an older file without the fingerprint: full depth, said in one line
    record = json.loads(file.read_text())
    del record[FINGERPRINT]
    file.write_text(json.dumps(record))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        old = MultiExitRobertaModel.from_pretrained(folder, "model.pt", ".", bpe=None)
    assert old.default_policy is None and old.dtype == "fp32"
    assert f"{file} does not record the model it was chosen on" in caplog.text
    assert "99.0" not in caplog.text


def test_one_load_gives_everything_a_user_needs(tiny_checkpoint, tiny_built):
    model, task, _ = tiny_built
    loaded = load_for_inference(tiny_checkpoint, tiny_checkpoint.parent, dtype="bf16",
                                fingerprint=True)  # fmt: skip
    assert loaded.dtype == "bf16" and not loaded.model.training
    assert loaded.data == str(tiny_checkpoint.parent) and loaded.num_inputs == 1
    assert loaded.labels == ["0", "1", "2"] and "does not record the data" in loaded.notes[0]
    assert loaded.meta is None and loaded.text is None and loaded.examples is None
    assert loaded.fingerprint == model_fingerprint(model.state_dict())
    assert loaded.max_positions == 64 and loaded.cfg.task.data == str(tiny_checkpoint.parent)
    tokens, _ = tiny_batch(task, LENGTHS)
    fp32 = load_for_inference(tiny_checkpoint, tiny_checkpoint.parent, dtype="fp32")
    with torch.no_grad():
        theirs = model(tokens, classification_head_name=HEAD)[0]
        assert torch.allclose(fp32.model(tokens, classification_head_name=HEAD)[0], theirs,
                              atol=1e-5)  # fmt: skip
        ours = loaded.model(tokens, classification_head_name=HEAD)[0]
    assert ours.dtype == torch.float32 and model_precision(loaded.model) == "bf16"
    with pytest.raises(CheckpointError, match="no prepare_glue.json, so new text cannot be"):
        load_for_inference(tiny_checkpoint, tiny_checkpoint.parent, text="required")
