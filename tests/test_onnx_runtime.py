"""The ONNX Runtime backend (``acl_fairseq.runtime.onnx_runtime``) against the fairseq model's
own early-exit loop, the reference: at fp32 the same exits and predictions and the same logits
(to float32's rounding) on padded batches of mixed lengths and on single rows, for every policy
kind; int8 close to fp32; the exported segments cached; onnxruntime's absence named. The slow
test of ``acl-fairseq-predict --backend onnxruntime`` is in test_predict.py."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from acl_fairseq.early_exit.learned import FEATURES, LearnedPolicy, exit_features, feature_state
from acl_fairseq.early_exit.per_exit import PerExitEntropyPolicy, PerExitMaxProbPolicy
from acl_fairseq.early_exit.policies import (
    EntropyPolicy,
    MaxProbPolicy,
    PatiencePolicy,
    softmax_entropy,
)
from acl_fairseq.errors import AclFairseqError
from acl_fairseq.portable import ort_loop
from acl_fairseq.portable.decide import Decision
from acl_fairseq.runtime import onnx_runtime
from acl_fairseq.runtime.onnx_runtime import INSTALL, OnnxRuntimeMissing, OrtEarlyExit
from acl_fairseq.runtime.precision import prepare_for_inference

from tiny_models import HEAD, LENGTHS, build_tiny, tiny_batch

MORE_LENGTHS = LENGTHS + [5, 8, 4, 12, 10, 3]


def _midpoint(values: torch.Tensor) -> float:
    """A threshold halfway between the two middle values (rows on both sides, none close)."""
    v = values.sort().values
    mid = len(v) // 2
    return float((v[mid - 1] + v[mid]) / 2)


def _policies(model, tokens) -> dict[str, object]:
    """Each kind, with thresholds that split the batch at the exits they name."""
    with torch.no_grad():
        exits = model.exit_outputs(tokens)
    entropy = [softmax_entropy(o.logits) for o in exits[:-1]]
    top = [MaxProbPolicy.score(o.logits) for o in exits[:-1]]
    weights = {"maxprob": 4.0, "margin": 2.0, "entropy": -1.0, "agree": 1.0, "run": 0.5}
    learned = LearnedPolicy(0.5, tuple(weights.get(f, 0.3) for f in FEATURES), -3.0)
    z = learned.logit(exit_features(exits[0].logits, feature_state(len(tokens)))[0])
    return {
        "entropy": EntropyPolicy(_midpoint(entropy[0])),
        "maxprob": MaxProbPolicy(_midpoint(top[1])),
        "patience": PatiencePolicy(1),
        "per_exit_entropy": PerExitEntropyPolicy(
            (1, 3), (_midpoint(entropy[0]), _midpoint(entropy[2]))
        ),
        "per_exit_maxprob_patience": PerExitMaxProbPolicy(
            (2, 3), (_midpoint(top[1]), _midpoint(top[2])), patience=1
        ),
        "learned": learned.with_threshold(float(torch.sigmoid(torch.tensor(_midpoint(z))))),
        "nobody_leaves": EntropyPolicy(1e-30),  # evaluated at every exit, no row leaves
        "never_exits": EntropyPolicy(0.0),
        "never_exits_patience": PatiencePolicy(3),
    }


@pytest.fixture(scope="module")
def ort(tiny_built, tmp_path_factory):
    """``(model, task, fp32 runner)``, the exports cached for the module."""
    model, task, _ = tiny_built
    return model, task, OrtEarlyExit(model, HEAD, tmp_path_factory.mktemp("onnx"), threads=1)


def assert_same(runner, model, tokens, policy):
    """The runner's result equals the model's loop on ``tokens``; returns it."""
    with torch.inference_mode():
        want = model.early_exit(tokens, policy, classification_head_name=HEAD)
    got = runner.early_exit(tokens, policy, classification_head_name=HEAD)
    assert got.logits.dtype == torch.float32 and got.logits.shape == want.logits.shape
    assert torch.equal(got.exit_layers, want.exit_layers), (policy, got.exit_layers)
    assert torch.equal(got.predictions, want.predictions), policy
    assert torch.allclose(got.logits, want.logits, atol=1e-4), policy
    return got


@pytest.mark.parametrize(
    "name",
    ["entropy", "maxprob", "patience", "per_exit_entropy", "per_exit_maxprob_patience",
     "learned", "nobody_leaves", "never_exits", "never_exits_patience"],
)  # fmt: skip
def test_fp32_equals_the_torch_loop(ort, name):
    """Padded batch of mixed lengths, each row alone (batch 1, no padding), and a row with
    padding: the same exits, predictions and logits as the fairseq model's loop."""
    model, task, runner = ort
    tokens, rows = tiny_batch(task, MORE_LENGTHS)
    policy = _policies(model, tokens)[name]
    batch = assert_same(runner, model, tokens, policy)
    layers = set(batch.exit_layers.tolist())
    used = set(policy.exits(model.shallow_exit_layers))
    assert layers <= used | {model.num_layers}
    if name.startswith(("never", "nobody")):
        assert layers == {model.num_layers}
    else:
        assert len(layers) >= 2, layers  # rows leave at several exits: not vacuous
    pad = task.source_dictionary.pad()
    for i, row in enumerate(rows):
        alone = assert_same(runner, model, row.unsqueeze(0), policy)
        assert alone.exit_layers.item() == batch.exit_layers[i].item()
    padded = torch.cat([rows[1], torch.full((3,), pad, dtype=rows[1].dtype)]).unsqueeze(0)
    assert_same(runner, model, padded, policy)
    assert_same(runner, model, tokens[2:5], policy)  # a sub-batch, padded


@pytest.mark.parametrize(
    "extra",
    [["--exit-pooling", "mean"], ["--encoder-normalize-before"],
     ["--exit-head", "linear", "--exit-pooling", "mean"]],
    ids=["mean", "prenorm", "linear-mean"],
)  # fmt: skip
def test_fp32_equals_the_torch_loop_mean_pooling_and_prenorm(tiny_task, tiny_data, tmp_path, extra):
    _, task = tiny_task
    model, _ = build_tiny(tiny_data, task, extra=extra)
    runner = OrtEarlyExit(model, HEAD, tmp_path, threads=1)
    tokens, rows = tiny_batch(task, MORE_LENGTHS)
    policies = _policies(model, tokens)
    for name in ("entropy", "patience"):
        result = assert_same(runner, model, tokens, policies[name])
        assert len(set(result.exit_layers.tolist())) >= 2, name
        for row in rows[:4]:
            assert_same(runner, model, row.unsqueeze(0), policies[name])


def test_full_depth_and_every_exit_equal_the_model(ort):
    model, task, runner = ort
    tokens, _ = tiny_batch(task, MORE_LENGTHS)
    with torch.no_grad():
        full = model(tokens, classification_head_name=HEAD)[0]
        exits = model.exit_outputs(tokens, classification_head_name=HEAD)
    assert torch.allclose(runner(tokens, classification_head_name=HEAD)[0], full, atol=1e-4)
    got = runner.exit_outputs(tokens, classification_head_name=HEAD)
    assert [o.layer for o in got] == [o.layer for o in exits] == [1, 2, 3, 4]
    for mine, theirs in zip(got, exits):
        assert torch.allclose(mine.logits, theirs.logits, atol=1e-4), mine.layer


def test_never_exits_runs_one_full_depth_session(tiny_built, tmp_path):
    model, task, _ = tiny_built
    runner = OrtEarlyExit(model, HEAD, tmp_path, threads=1)
    tokens, _ = tiny_batch(task, LENGTHS)
    with torch.inference_mode():  # exported on first use, under inference mode too
        runner.prepare(PatiencePolicy(5))
    result = assert_same(runner, model, tokens, PatiencePolicy(5))
    assert result.exit_layers.tolist() == [4] * len(LENGTHS)
    assert sorted(p.name for p in runner.folder.iterdir()) == [
        "layers1-4.fp32.onnx",
        "layers1-4.fp32.onnx.sha256",  # its checksum, written at export
    ]


def test_a_single_unpadded_row_needs_no_row_bookkeeping(ort, monkeypatch):
    """One unpadded row: no RunningRows, the policy's rule deciding (``portable.decide``)."""
    model, task, runner = ort
    tokens, rows = tiny_batch(task, MORE_LENGTHS)
    policy = _policies(model, tokens)["entropy"]

    def refuse(*args, **kwargs):
        raise AssertionError("row bookkeeping for one unpadded row")

    decided = []
    real = Decision.decide

    def counting(self, logits, state):
        decided.append(logits.shape)
        return real(self, logits, state)

    monkeypatch.setattr(ort_loop, "RunningRows", refuse)
    monkeypatch.setattr(Decision, "decide", counting)
    for row in rows:
        assert_same(runner, model, row.unsqueeze(0), policy)
    assert len(decided) >= 2 * len(rows) and set(decided) == {(1, 3)}  # both loops, one row
    with pytest.raises(AssertionError, match="row bookkeeping"):
        runner.early_exit(tokens, policy)


POOL_SCRIPT = """
import sys
from acl_fairseq.runtime import onnx_runtime as O
path = sys.argv[1]
def own(session):
    return session.get_session_options().use_per_session_threads
assert O.global_pool() is None and own(O.ort_session(path, 2))  # no pool yet: its own threads
assert not own(O.ort_session(path, 2, shared=True)) and O.global_pool() == 2
assert O.global_pool(1) == 2  # made once, size fixed
assert not own(O.ort_session(path, 1))  # every later session on the pool (ONNX Runtime's rule)
print("pool ok")
"""


def test_segments_share_the_process_thread_pool(ort, monkeypatch):
    """``shared_pool``: the segments' sessions on the process's global thread pool (made
    by the first one); without it, each its own threads. In a fresh process: the pool is one
    per process and changes every session made after it."""
    model, task, runner = ort
    path = runner.segment_file(1, model.num_layers)
    if onnx_runtime.global_pool() is None:  # this process: no pool made by the tests
        runner.prepare(PatiencePolicy(1))
        assert all(
            s.get_session_options().use_per_session_threads for s in runner._sessions.values()
        )
    done = subprocess.run(
        [sys.executable, "-c", POOL_SCRIPT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "pool ok" in done.stdout, done.stderr[-2000:]
    asked = []

    def recording(path, threads, spinning=True, shared=False, disabled_optimizers=()):
        asked.append((threads, spinning, shared, tuple(disabled_optimizers)))
        return real(path, threads, spinning, shared=False)  # no pool in this process

    real = onnx_runtime.ort_session
    monkeypatch.setattr(onnx_runtime, "ort_session", recording)
    OrtEarlyExit(model, HEAD, runner.folder.parent, threads=3, shared_pool=True).prepare(
        PatiencePolicy(1)
    )
    assert asked and set(asked) == {(3, False, True, ())}
    asked.clear()  # int8: every session without the fusions that slow its layers
    OrtEarlyExit(model, HEAD, runner.folder.parent, "int8", threads=3).prepare(PatiencePolicy(1))
    assert asked and set(asked) == {(3, False, False, onnx_runtime.INT8_DISABLED)}


def test_int8_sessions_leave_out_the_skip_layer_norm_fusion(ort, tmp_path, monkeypatch):
    """``INT8_DISABLED`` names a fusion ONNX Runtime applies to the int8 segments (a wrong name
    would be ignored without a word): with it disabled the optimized graph keeps its Add and
    LayerNormalization; the logits move only by that rounding."""
    import numpy as np
    import onnx
    import onnxruntime

    model, task, runner = ort
    int8 = OrtEarlyExit(model, HEAD, runner.folder.parent, "int8", threads=1)
    path = int8.segment_file(2, 2)
    ops, outputs = {}, {}
    channels = model.encoder.sentence_encoder.embed_tokens.embedding_dim
    x = np.random.default_rng(0).standard_normal((7, 5, channels), dtype=np.float32)
    feeds = {"x": x, "padding_mask": np.zeros((5, 7), dtype=bool)}  # T x B x C hidden states
    for name, disabled in (("default", ()), ("ours", onnx_runtime.INT8_DISABLED)):
        options = onnxruntime.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        if onnx_runtime.global_pool() is not None:  # made by another test of this process
            options.use_per_session_threads = False
        session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"],
            disabled_optimizers=list(disabled),
        )  # fmt: skip
        outputs[name] = session.run(None, feeds)[-1]
        ops[name] = {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}
    assert "SkipLayerNormalization" in ops["default"]
    assert "SkipLayerNormalization" not in ops["ours"] and "LayerNormalization" in ops["ours"]
    assert np.allclose(outputs["default"], outputs["ours"], atol=0.1)
    made = []  # ort_session hands the names to ONNX Runtime
    real = onnxruntime.InferenceSession
    monkeypatch.setattr(
        onnxruntime, "InferenceSession", lambda *a, **k: made.append(k) or real(*a, **k)
    )
    onnx_runtime.ort_session(path, 1, disabled_optimizers=onnx_runtime.INT8_DISABLED)
    onnx_runtime.ort_session(path, 1)
    assert [k.get("disabled_optimizers") for k in made] == [["SkipLayerNormFusion"], None]


def test_int8_runs_and_agrees_with_fp32(ort):
    model, task, runner = ort
    int8 = OrtEarlyExit(model, HEAD, runner.folder.parent, "int8", threads=1)
    lengths = torch.randint(1, 15, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens, _ = tiny_batch(task, lengths, seed=7)
    policy = _policies(model, tokens)["entropy"]
    fp32, quantized = runner.early_exit(tokens, policy), int8.early_exit(tokens, policy)
    assert quantized.logits.dtype == torch.float32 and quantized.logits.shape == (64, 3)
    assert float(quantized.predictions.eq(fp32.predictions).double().mean()) >= 0.9
    assert float(quantized.exit_layers.eq(fp32.exit_layers).double().mean()) >= 0.85
    assert not torch.equal(quantized.logits, fp32.logits)  # another model: int8 weights
    tag = onnx_runtime.segment_tag("int8")  # int8w7 on a CPU without VNNI
    files = sorted(p.name for p in int8.folder.glob(f"*.{tag}.onnx"))
    assert files == [f"layers{i}-{i}.{tag}.onnx" for i in (1, 2, 3, 4)]  # entropy: every exit
    import onnx

    ops = {n.op_type for n in onnx.load(str(int8.folder / files[0])).graph.node}
    assert ops & {"MatMulInteger", "DynamicQuantizeMatMul"}, ops  # int8 weights


def test_exports_are_cached_by_weights_and_shared_by_exit_sets(tiny_built, tmp_path, monkeypatch):
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, LENGTHS)
    exported = []
    real = onnx_runtime.export_segment
    monkeypatch.setattr(
        onnx_runtime, "export_segment", lambda *a: exported.append(a[2:4]) or real(*a)
    )
    first = OrtEarlyExit(model, HEAD, tmp_path, threads=1)
    want = first.early_exit(tokens, "per_exit_entropy:1=0.3,3=0.5")
    assert exported == [(1, 1), (2, 3), (4, 4)]
    first.early_exit(tokens, "per_exit_entropy:1=0.3")  # shares layers 1-1 with the first
    assert exported[3:] == [(2, 4)]
    exported.clear()
    second = OrtEarlyExit(model, HEAD, tmp_path, threads=1)  # a second load: no export
    assert second.folder == first.folder
    got = second.early_exit(tokens, "per_exit_entropy:1=0.3,3=0.5")
    assert exported == []
    assert torch.equal(got.logits, want.logits)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.classification_heads[HEAD].out_proj.bias.add_(1.0)
    assert OrtEarlyExit(other, HEAD, tmp_path).folder != first.folder  # other weights
    named = OrtEarlyExit(model, HEAD, tmp_path, fingerprint="ab" * 32)
    assert named.folder.name.startswith("onnx-abababab") and named.folder != first.folder


def test_missing_onnxruntime_names_the_install_command(tiny_built, tmp_path, monkeypatch):
    model, _, _ = tiny_built
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime fails
    with pytest.raises(OnnxRuntimeMissing) as caught:
        OrtEarlyExit(model, HEAD, tmp_path)
    assert INSTALL in str(caught.value) and INSTALL == "pip install onnxruntime onnx onnxscript"
    assert isinstance(caught.value, AclFairseqError) and isinstance(caught.value, ImportError)
    assert not list(tmp_path.iterdir())


def test_bad_uses_are_named(tiny_built, tmp_path):
    model, task, _ = tiny_built
    with pytest.raises(ValueError, match="fp32 or int8"):
        OrtEarlyExit(model, HEAD, tmp_path, "bf16")
    with pytest.raises(ValueError, match="fp32 model"):
        OrtEarlyExit(prepare_for_inference(copy.deepcopy(model), "bf16"), HEAD, tmp_path)
    runner = OrtEarlyExit(model, HEAD, tmp_path)
    tokens, _ = tiny_batch(task, [3])
    with pytest.raises(ValueError, match="head"):
        runner.early_exit(tokens, "entropy:0.3", classification_head_name="other")
    with pytest.raises(ValueError):  # the policy's own check: no exit at layer 7
        runner.early_exit(tokens, "per_exit_entropy:7=0.3")


def test_a_damaged_cached_segment_is_exported_again(tiny_built, tmp_path, caplog):
    """A cached segment cut short or emptied (a disk that filled, a copy that failed) was an
    InvalidProtobuf traceback on every later load; now it is exported again, with a note."""
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, LENGTHS)
    policy = "per_exit_entropy:1=0.3,3=0.5"
    want = OrtEarlyExit(model, HEAD, tmp_path, threads=1).early_exit(tokens, policy)
    runner = OrtEarlyExit(model, HEAD, tmp_path, threads=1)
    cut, empty = runner.folder / "layers1-1.fp32.onnx", runner.folder / "layers2-3.fp32.onnx"
    cut.write_bytes(cut.read_bytes()[:300])
    empty.write_bytes(b"")
    with caplog.at_level("WARNING"):
        got = runner.early_exit(tokens, policy)
    assert torch.equal(got.logits, want.logits)
    for path in (cut, empty):
        assert f"{path}: the cached ONNX segment could not be loaded (" in caplog.text
    assert caplog.text.count("exported again") == 2
    # int8: quantized from the fp32 file, which is damaged (the int8 one was never made)
    empty.write_bytes(b"")
    int8 = OrtEarlyExit(model, HEAD, tmp_path, "int8", threads=1)
    int8.early_exit(tokens, policy)  # quantizes layers 2-3 from a fresh fp32 export
    assert empty.stat().st_size > 0


def test_another_segments_file_in_the_cache_is_exported_again(tiny_built, tmp_path, caplog):
    """A valid ONNX file under another segment's name (a copy over it) ran silently and
    changed the predictions; its checksum, written beside it at export, now says so."""
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, LENGTHS)
    policy = "per_exit_entropy:1=0.3,2=0.4,3=0.5"
    want = OrtEarlyExit(model, HEAD, tmp_path, threads=1).early_exit(tokens, policy)
    runner = OrtEarlyExit(model, HEAD, tmp_path, threads=1)
    middle, next_one = runner.folder / "layers2-2.fp32.onnx", runner.folder / "layers3-3.fp32.onnx"
    assert (runner.folder / "layers2-2.fp32.onnx.sha256").is_file()
    next_one.write_bytes(middle.read_bytes())  # the same inputs and outputs, other weights
    with caplog.at_level("WARNING"):
        got = runner.early_exit(tokens, policy)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.exit_layers, want.exit_layers)
    assert (
        f"{next_one}: the cached ONNX segment could not be loaded (not the file exported here: "
        "its checksum differs): exported again"
    ) in caplog.text
    assert next_one.read_bytes() != middle.read_bytes()


def test_a_segment_that_never_loads_names_the_command_that_clears_it(tiny_built, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    model, task, _ = tiny_built
    tokens, _ = tiny_batch(task, [4])
    runner = OrtEarlyExit(model, HEAD, tmp_path, threads=1)

    def garbage(model, head, first, last, path):
        path.write_bytes(b"not onnx")

    monkeypatch.setattr(onnx_runtime, "export_segment", garbage)
    with pytest.raises(AclFairseqError) as caught:
        runner.early_exit(tokens, "entropy:0.3")
    message = str(caught.value)
    assert message.startswith(f"{runner.folder / 'layers1-1.fp32.onnx'}: ONNX Runtime cannot load")
    assert message.endswith(f"clear the cache (rm -r {runner.folder}) and run again")


def test_a_cache_folder_that_cannot_be_made_is_named(tiny_built, tmp_path):
    model, _, _ = tiny_built
    (tmp_path / "file").write_text("")
    for folder in (tmp_path / "file" / "cache", tmp_path / "file"):
        with pytest.raises(OSError, match=rf"^--onnx-cache {folder}: cannot create the folder"):
            OrtEarlyExit(model, HEAD, folder)
