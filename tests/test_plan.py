"""What runs at inference, decided once (``acl_fairseq.inference.plan``): the rules on their own,
then acl-fairseq-predict and the hub held against each other on one checkpoint for every
combination of a saved choice and the backend, precision and policy asked for."""

from __future__ import annotations

import copy
import hashlib
import itertools
import shutil
from pathlib import Path

import pytest
import torch

from acl_fairseq.checkpoint.fingerprint import model_fingerprint
from acl_fairseq.early_exit.policies import parse_policy
from acl_fairseq.inference.loader import CheckpointError, read_checkpoint
from acl_fairseq.inference.plan import FULL_DEPTH, Plan, PlanError, Request, decide
from acl_fairseq.inference.saved_policy import SavedPolicy, write_policy
from acl_fairseq.models.heads import DEFAULT_HEAD
from acl_fairseq.models.multi_exit_roberta import MultiExitRobertaModel

from predict_helpers import run_predict, trained  # noqa: F401  (trained: a fixture)

SAVED = parse_policy("entropy:0.4")
FP32_SAVED = parse_policy("maxprob:0.8")


def saved_choice(dtype: str = "int8", backend: str | None = "onnxruntime") -> SavedPolicy:
    """A file chosen at ``dtype`` (the default) on ``backend``, and at fp32 on fairseq."""
    entries = {"fp32": {"backend": "fairseq"}, dtype: {"backend": backend} if backend else {}}
    fields = {"backend": backend, "by_dtype": entries} if backend else {"by_dtype": entries}
    return SavedPolicy(SAVED, Path("early_exit_policy.json"), fields, dtype,
                       {dtype: SAVED, "fp32": FP32_SAVED})  # fmt: skip


def plan(request: Request, saved: SavedPolicy | None = None, note: str = "", **facts) -> Plan:
    return decide(request.checked(), saved, note, **facts)


def test_without_a_saved_choice_the_default_is_full_depth_on_fairseq_at_fp32():
    got = plan(Request())
    assert (got.backend, got.dtype, got.policy, got.label) == ("fairseq", "fp32", None, FULL_DEPTH)
    assert "no early_exit_policy.json" in got.why


def test_the_saved_choice_is_the_default_precision_backend_and_policy():
    got = plan(Request(), saved_choice())
    assert (got.backend, got.dtype, got.policy) == ("onnxruntime", "int8", SAVED)
    assert got.why.startswith("entropy:0.4 (saved in early_exit_policy.json: dtype int8")


def test_a_precision_asked_for_takes_its_own_saved_policy_and_backend():
    got = plan(Request(dtype="fp32"), saved_choice())
    assert (got.backend, got.dtype, got.policy) == ("fairseq", "fp32", FP32_SAVED)
    got = plan(Request(dtype="bf16"), saved_choice())  # none chosen at bf16: the default's
    assert (got.backend, got.dtype, got.policy) == ("fairseq", "bf16", SAVED)
    assert "none for bf16 in the file" in got.why


def test_a_policy_asked_for_runs_on_fairseq_at_the_saved_precision():
    got = plan(Request(policy="patience:1"), saved_choice())
    assert (got.backend, got.dtype, got.policy) == ("fairseq", "int8", parse_policy("patience:1"))
    got = plan(Request(policy="none"), saved_choice())
    assert (got.backend, got.dtype, got.policy, got.why) == (
        "fairseq", "int8", None, "full depth (--policy none)"
    )  # fmt: skip


def test_onnxruntime_runs_fp32_or_int8():
    got = plan(Request(backend="onnxruntime"), saved_choice("bf16", backend=None))
    assert (got.backend, got.dtype) == ("onnxruntime", "fp32")
    with pytest.raises(
        PlanError, match="--backend onnxruntime runs fp32 or int8, not --dtype bf16"
    ):
        Request(backend="onnxruntime", dtype="bf16").checked()


@pytest.mark.parametrize(
    "request_, message",
    [
        (Request(backend="tensorrt"), "--backend tensorrt: must be one of fairseq, onnxruntime"),
        (Request(dtype="fp8"), "--dtype fp8: must be one of fp32, bf16, int8"),
        (Request(policy="entropy:x"), "--policy: "),
    ],
)
def test_bad_requests_name_their_flag(request_, message):
    with pytest.raises(PlanError, match=message):
        request_.checked()


def test_saved_asked_for_without_a_usable_file_says_why():
    with pytest.raises(PlanError, match="--policy saved: no early_exit_policy.json next to"):
        plan(Request(policy="saved"))
    note = "early_exit_policy.json was chosen on other weights"
    with pytest.raises(PlanError, match=f"--policy saved: {note}"):
        plan(Request(policy="saved"), None, note)
    got = plan(Request(), None, note)  # the default: full depth, with the reason
    assert got.policy is None and got.why == f"full depth, not the saved policy: {note}"


def test_a_model_without_shallow_exits_or_a_regression_runs_full_depth():
    got = plan(Request(), saved_choice(), shallow_exits=False)
    assert got.policy is None and "needs a multi-exit classifier" in got.why
    assert got.backend == "fairseq"  # the saved backend came with the saved policy
    with pytest.raises(PlanError, match="holds a model without shallow exits, so only full"):
        plan(Request(policy="entropy:0.3"), shallow_exits=False)
    with pytest.raises(PlanError, match="needs a classification"):
        plan(Request(policy="saved"), saved_choice(), regression=True)


# ------------------------------------------------------- acl-fairseq-predict against the hub

SENTENCES = ["a fine film", "a bad film", "an odd , long film", "good"]


def _variants(trained, root: Path) -> dict[str, Path]:  # noqa: F811
    """Copies of the trained checkpoint, each with another saved choice next to it."""
    state = read_checkpoint(trained["ckpt"])
    weights = model_fingerprint(state["model"])
    folders = {}
    for name in ("none", "fairseq_int8", "onnxruntime_int8", "other_weights"):
        folder = root / name
        folder.mkdir()
        shutil.copy(trained["ckpt"], folder / "model.pt")
        folders[name] = folder
    fast = parse_policy("entropy:0.6")
    write_policy(folders["fairseq_int8"] / "model.pt", fast, dtype="int8", fingerprint=weights,
                 by_dtype={"int8": {"policy": fast}, "fp32": {"policy": SAVED}})  # fmt: skip
    write_policy(folders["onnxruntime_int8"] / "model.pt", fast, dtype="int8",
                 fingerprint=weights, backend="onnxruntime",
                 by_dtype={"int8": {"policy": fast, "backend": "onnxruntime"},
                           "fp32": {"policy": SAVED, "backend": "fairseq"}})  # fmt: skip
    write_policy(folders["other_weights"] / "model.pt", fast, dtype="int8", fingerprint="0" * 64)
    return folders


def _predict(folder: Path, data: Path, asked: dict) -> tuple:
    """``("ok", outputs, policy line, dtype, backend)`` of acl-fairseq-predict, or its error."""
    flags = [x for k, v in asked.items() if v is not None for x in (f"--{k}", v)]
    text = "".join(f"{s}\n" for s in SENTENCES)
    code, out, err = run_predict(folder / "model.pt", "--data", data, "--cpu", *flags, stdin=text)
    if code != 0:
        return ("error", err.strip().split("error: ", 1)[-1])
    lines = dict(line.split(": ", 2)[1:] for line in err.splitlines() if line.count(": ") >= 2)
    rows = [tuple(line.split("\t")[::2]) for line in out.splitlines()]  # (label, exit layer)
    backend = "onnxruntime" if "backend" in lines else "fairseq"
    return ("ok", rows, lines["policy"], lines["dtype"], backend)


def _hub(folder: Path, data: Path, asked: dict) -> tuple:
    """The same of the hub: ``from_pretrained`` with the same arguments."""
    try:
        hub = MultiExitRobertaModel.from_pretrained(str(folder), "model.pt", str(data), **asked)
    except CheckpointError as e:
        return ("error", str(e))
    from fairseq.data import data_utils

    tokens = [hub.encode(s) for s in SENTENCES]
    order = sorted(range(len(tokens)), key=lambda i: tokens[i].numel())  # as predict batches
    pad = hub.task.source_dictionary.pad()
    batch = data_utils.collate_tokens([tokens[i] for i in order], pad)
    result = hub.predict_early_exit(DEFAULT_HEAD, batch)
    rows = [None] * len(tokens)
    for i, label, layer in zip(order, result.labels, result.exit_layers.tolist()):
        rows[i] = (label, str(layer))
    return ("ok", rows, hub.plan.why, hub.dtype, hub.backend)


@pytest.fixture
def read_once(monkeypatch) -> None:
    """Each checkpoint unpickled once (keyed by its bytes' hash), a copy of the state per load:
    the grid loads the same weights twice per combination (predict, hub); what is decided from
    them and the model built from them are as without the cache."""
    from fairseq import checkpoint_utils

    load = checkpoint_utils.load_checkpoint_to_cpu
    states: dict[tuple, dict] = {}

    def read(path, *args, **kwargs) -> dict:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        key = (digest, repr(args), repr(sorted(kwargs.items())))
        if key not in states:
            states[key] = load(path, *args, **kwargs)
        return copy.deepcopy(states[key])

    monkeypatch.setattr(checkpoint_utils, "load_checkpoint_to_cpu", read)


GRID = list(
    itertools.product(
        ("none", "fairseq_int8", "onnxruntime_int8", "other_weights"),
        (None, "fairseq", "onnxruntime"),
        (None, "fp32", "int8"),
        (None, "none", "saved", "entropy:0.5"),
    )
)


@pytest.mark.slow
def test_the_hub_runs_what_predict_runs_for_every_combination(
    trained,
    tmp_path,
    read_once,  # noqa: F811
):
    """Every saved choice x asked backend x precision x policy: the same plan (the policy
    line, the precision, the backend) and the same labels and exit layers, or the same
    error."""
    torch.manual_seed(0)
    folders = _variants(trained, tmp_path)
    checked = 0
    for saved, backend, dtype, policy in GRID:
        asked = {"backend": backend, "dtype": dtype, "policy": policy}
        by_predict = _predict(folders[saved], trained["data"], asked)
        by_hub = _hub(folders[saved], trained["data"], asked)
        case = f"saved {saved}, asked {asked}"
        assert by_hub == by_predict, case
        checked += by_hub[0] == "ok"
    assert checked >= len(GRID) // 2  # most combinations run (the others: the same error)
