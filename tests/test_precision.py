"""Mixed precision: ``--autocast bf16`` (the task's, CPU or CUDA) and fairseq's ``--fp16`` /
``--memory-efficient-fp16`` (its FP16 optimizers and dynamic loss scaler) with ACL-Grad."""

import math
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils
from test_acl_grad import PlainOptimizer, TwoTermCriterion, TwoTermModel, make_task

from acl_fairseq.acl_grad import read_angle_log

from fairseq_helpers import (
    TINY_MULTI_EXIT_3,
    TINY_ROBERTA,
    USER_DIR,
    exact_train_args,
    fairseq_setup,
    fairseq_train_with,
    fairseq_validate,
    json_records,
    rank_output,
)


# ------------------------------------------------------------------ --autocast bf16, in process
class RecordingModel(TwoTermModel):
    """TwoTermModel plus a linear layer whose output dtype is recorded at every forward."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        y = self.linear(x)
        self.seen.append(y.dtype)
        return y


class RecordingCriterion(TwoTermCriterion):
    """An ACL-Grad criterion whose CE and contrastive terms go through the model's forward."""

    def loss_terms(self, model, sample):
        ce, con, n, log = super().loss_terms(model, sample)
        y = model(torch.tensor([sample["a"]]))
        return ce + y.float().sum(), con + y.float().pow(2).sum(), n, log

    def __call__(self, model, sample):  # validation
        ce, con, n, log = self.loss_terms(model, sample)
        return ce + con, n, log


class PlainRecordingCriterion:
    """A criterion without terms: fairseq's own train_step path."""

    def __call__(self, model, sample):
        return model(torch.tensor([sample["a"]])).float().sum(), 1, {}


class AutocastCheckingOptimizer(PlainOptimizer):
    """Records whether autocast is on while the optimizer runs a backward pass."""

    def __init__(self, params):
        super().__init__(params)
        self.backward_under_autocast: list[bool] = []

    def backward(self, loss):
        self.backward_under_autocast.append(torch.is_autocast_enabled("cpu"))
        super().backward(loss)


def autocast_task(mode: str):
    task = make_task()
    task.autocast = task.acl_grad.autocast = mode
    return task


@pytest.mark.parametrize("mode,dtype", [("bf16", torch.bfloat16), ("none", torch.float32)])
@pytest.mark.parametrize("criterion", [RecordingCriterion, PlainRecordingCriterion])
def test_autocast_runs_the_forward_in_bf16_and_nothing_else(mode, dtype, criterion):
    model, task = RecordingModel(), autocast_task(mode)
    opt = AutocastCheckingOptimizer(model.parameters())
    opt.zero_grad()
    sample = {"a": [1.0, 0.5], "b": [1.0, 1.0]}
    task.train_step(sample, model, criterion(), opt, update_num=0)
    assert model.seen and set(model.seen) == {dtype}  # the forward (matmul) ran in dtype
    assert opt.backward_under_autocast == [False]  # the backward pass outside autocast
    for p in model.parameters():  # fp32 weights and gradients
        assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
    model.seen.clear()
    task.valid_step(sample, model, criterion())
    assert set(model.seen) == {dtype}


def build_from_flags(tmp_path: Path, *flags: str):
    """The task, model and criterion fairseq-train builds from ``flags`` (in this process)."""
    (tmp_path / "input0").mkdir(exist_ok=True)
    (tmp_path / "label").mkdir(exist_ok=True)
    (tmp_path / "input0" / "dict.txt").write_text("".join(f"t{i} 1\n" for i in range(20)))
    (tmp_path / "label" / "dict.txt").write_text("0 1\n1 1\n")
    args = [tmp_path, "--user-dir", USER_DIR, "--cpu", "--num-classes", "2", *flags]
    cfg, task, model = fairseq_setup(args)
    return task, model, task.build_criterion(cfg.criterion)


@pytest.mark.parametrize(
    "flags",
    [
        ["--fp16"],
        ["--memory-efficient-fp16"],
        ["--bf16"],
        ["--memory-efficient-bf16"],
        ["--amp"],
        ["--fp16", "--amp"],
    ],
)
def test_autocast_refuses_other_mixed_precision_flags_at_set_up(tmp_path, flags):
    task_flags = ["--task", "acl_sentence_prediction", *TINY_ROBERTA, "--criterion", "acl_embed"]
    with pytest.raises(ValueError) as error:
        build_from_flags(tmp_path, *task_flags, "--autocast", "bf16", *flags)
    message = str(error.value)
    assert message.startswith(f"--autocast bf16 cannot be combined with {' '.join(flags)}:")
    assert "fairseq's --bf16 means TPU" in message
    build_from_flags(tmp_path, *task_flags, *flags)  # without --autocast: fairseq's business


def test_autocast_with_a_real_criterion_and_model(tmp_path):
    """acl_embed on a tiny RoBERTa under --autocast bf16: the classification head's matmul
    runs in bf16, the loss terms, the weights and both gradients stay fp32."""
    task, model, criterion = build_from_flags(
        tmp_path,
        *["--task", "acl_sentence_prediction", *TINY_ROBERTA, "--criterion", "acl_embed"],
        *["--autocast", "bf16", "--acl-grad-log", str(tmp_path / "angles.tsv")],
    )
    seen = []
    head = model.classification_heads["sentence_classification_head"]
    head.out_proj.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 20, (8, 10), generator=g)
    tokens[:, 0] = 0
    sample = {
        "net_input": {"src_tokens": tokens, "src_lengths": torch.full((8,), 10)},
        "target": torch.tensor([0, 1] * 4),
        "ntokens": 80,
        "nsentences": 8,
    }
    terms = criterion.loss_terms(model, sample)
    assert terms.ce_loss.dtype == terms.contrastive_loss.dtype == torch.float32  # no autocast
    assert seen == [torch.float32]
    opt = PlainOptimizer(model.parameters())
    opt.zero_grad()
    loss, _, _ = task.train_step(sample, model, criterion, opt, update_num=0)
    assert seen[-1] == torch.bfloat16 and loss.dtype == torch.float32
    assert task.acl_grad._buffer is not None  # the exact scope's contrastive gradient
    assert all(v.dtype == torch.float32 for v in task.acl_grad._buffer._views)
    opt.all_reduce_grads(model)
    task.optimizer_step(opt, model, 0)
    (row,) = read_angle_log(tmp_path / "angles.tsv")
    assert 0 < row.angle < 180


def test_autocast_choices_are_checked_by_the_parser(tmp_path):
    with pytest.raises(SystemExit):
        build_from_flags(
            tmp_path, "--task", "acl_sentence_prediction", *TINY_ROBERTA, "--autocast", "fp16"
        )


# ------------------------------------------------------------------ end to end (fairseq-train)
UPDATES = 24
COMMON = exact_train_args(UPDATES)
CRITERIONS = {
    "acl_embed": [*TINY_ROBERTA, "--criterion", "acl_embed"],
    "acl_cross_layer": [*TINY_MULTI_EXIT_3, "--criterion", "acl_cross_layer"],
    "ce_scl_acl_grad": [*TINY_ROBERTA, "--criterion", "ce_scl", "--acl-grad"],
    "ce": [*TINY_ROBERTA, "--criterion", "sentence_prediction"],
}


def train_inner(output: str) -> list[dict]:
    return [r for r in json_records(output) if "num_updates" in r and "epoch" in r]


def valid_records(output: str) -> list[dict]:
    return [r for r in json_records(output) if "valid_accuracy" in r]


@pytest.fixture(scope="module")
def trained(sentiment_data, tmp_path_factory):
    """``trained(criterion, *flags, workers=1, patches=())``: (rank-0 output, save dir), once
    per test module."""
    cache = {}

    def train(criterion: str, *flags: str, workers: int = 1, patches: tuple[str, ...] = ()):
        key = (criterion, flags, workers, patches)
        if key not in cache:
            save_dir = tmp_path_factory.mktemp("run")
            args = [*COMMON, *CRITERIONS[criterion], *flags]
            if criterion != "ce":
                args += ["--acl-grad-log", str(save_dir / "angles.{rank}.tsv")]
            out = fairseq_train_with(
                sentiment_data, save_dir, *args, workers=workers, patches=patches
            )
            cache[key] = (rank_output(out, 0) if workers > 1 else out, save_dir)
        return cache[key]

    return train


def angles(save_dir: Path, rank: int = 0) -> list[tuple[int, float, bool]]:
    return [(r.update, r.angle, r.kept) for r in read_angle_log(save_dir / f"angles.{rank}.tsv")]


def assert_angles_close(reference, other, mean_tol: float, max_tol: float) -> float:
    """Both logs decide every update once; the angles of the same updates differ by at most
    ``max_tol`` degrees, ``mean_tol`` on average. Returns the mean |difference|."""
    assert [u for u, _, _ in reference] == list(range(UPDATES))
    assert [u for u, _, _ in other] == list(range(UPDATES))
    diffs = [abs(a - b) for (_, a, _), (_, b, _) in zip(reference, other)]
    print(f"|angle difference| mean {sum(diffs) / len(diffs):.3f}, max {max(diffs):.3f} deg")
    assert max(diffs) <= max_tol and sum(diffs) / len(diffs) <= mean_tol
    return sum(diffs) / len(diffs)


@pytest.mark.slow
@pytest.mark.parametrize("criterion", ["acl_embed", "acl_cross_layer", "ce"])
def test_autocast_bf16_trains_like_fp32_and_saves_fp32_weights(trained, sentiment_data, criterion):
    out32, dir32 = trained(criterion)
    out16, dir16 = trained(criterion, "--autocast", "bf16")
    r32, r16 = train_inner(out32), train_inner(out16)
    assert [int(r["num_updates"]) for r in r16] == list(range(1, UPDATES + 1))
    assert all(math.isfinite(float(r["loss"])) for r in r16)
    losses32 = [float(r["loss"]) for r in r32]
    losses16 = [float(r["loss"]) for r in r16]
    assert losses16 == pytest.approx(losses32, abs=0.05)
    if criterion != "ce":
        # measured here: mean 0.13, max 0.43 degrees
        assert_angles_close(angles(dir32), angles(dir16), mean_tol=1.0, max_tol=3.0)
        assert [a for _, a, _ in angles(dir16)] != [a for _, a, _ in angles(dir32)]  # not fp32

    # the checkpoint holds fp32 weights; fairseq-validate loads it and, under the task's
    # saved --autocast bf16, reports what training's own validation reported
    checkpoint = dir16 / "checkpoint_last.pt"
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert state["cfg"]["task"]["autocast"] == "bf16"
    assert {v.dtype for v in state["model"].values() if v.is_floating_point()} == {torch.float32}
    last_valid = valid_records(out16)[-1]
    name = CRITERIONS[criterion][CRITERIONS[criterion].index("--criterion") + 1]
    flags = ["--task", "acl_sentence_prediction", "--criterion", name, "--batch-size", "8"]
    validated = valid_records(fairseq_validate(sentiment_data, checkpoint, *flags))[-1]
    assert float(validated["valid_accuracy"]) == float(last_valid["valid_accuracy"])
    # in fp32: the saved task flag overridden (fairseq-validate --model-overrides does so)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"autocast": "none"}
    )
    assert task.autocast == "none"
    assert {p.dtype for p in models[0].parameters()} == {torch.float32}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pytorch_ddp", "legacy_ddp"])
def test_autocast_bf16_with_two_workers_equals_update_freq(trained, backend):
    """--autocast bf16 on 2 workers with --update-freq 2 (fairseq's no_sync path under
    pytorch_ddp) decides like 1 worker with --update-freq 4: the same batches, in bf16."""
    flags = ("--autocast", "bf16", "--max-update", "6")
    one_out, one_dir = trained("acl_embed", *flags, "--update-freq", "4")
    ddp = ("--ddp-backend", backend, "--find-unused-parameters")
    two_out, two_dir = trained("acl_embed", *flags, "--update-freq", "2", *ddp, workers=2)
    assert "training on 2 devices" in two_out
    reference = angles(one_dir)
    assert [u for u, _, _ in reference] == list(range(6))
    for rank in (0, 1):
        rows = angles(two_dir, rank)
        assert [(u, k) for u, _, k in rows] == [(u, k) for u, _, k in reference]
        assert [a for _, a, _ in rows] == pytest.approx([a for _, a, _ in reference], abs=0.05)
    s1 = torch.load(one_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    s2 = torch.load(two_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    for k, v in s1["model"].items():
        torch.testing.assert_close(s2["model"][k], v, rtol=1e-3, atol=1e-4, msg=k)


# ------------------------------------------------------------------ --fp16 on CPU (patched)
FP16 = {"fp16": ("--fp16",), "memory_efficient_fp16": ("--memory-efficient-fp16",)}
OVERFLOW_NOTE = "NOTE: gradient overflow detected, ignoring gradient"


@pytest.mark.slow
@pytest.mark.parametrize("precision", list(FP16))
@pytest.mark.parametrize("criterion", ["acl_embed", "acl_cross_layer", "ce_scl_acl_grad"])
def test_fp16_trains_with_angles_close_to_fp32(trained, criterion, precision):
    """fairseq's FP16 optimizers (loss scale 128, no overflow here): the same batches as
    fp32 in every update, finite losses, every update decided once, angles within a few
    degrees of fp32's."""
    _, dir32 = trained(criterion)
    out, dir16 = trained(criterion, *FP16[precision], patches=("cpu_fp16",))
    assert OVERFLOW_NOTE not in out  # else the batches would shift against fp32's
    records = train_inner(out)
    assert [int(r["num_updates"]) for r in records] == list(range(1, UPDATES + 1))
    assert all(math.isfinite(float(r["loss"])) for r in records)
    assert {float(r["loss_scale"]) for r in records} == {128.0}
    # measured here: mean 0.02-0.13 degrees (ce_scl's SupCon over 8 examples drifts most:
    # mean 0.9, max 4.8 by update 24)
    assert_angles_close(angles(dir32), angles(dir16), mean_tol=1.5, max_tol=7.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "criterion,flags",
    [
        ("acl_embed", ("--fp16",)),
        ("acl_embed", ("--memory-efficient-fp16", "--acl-grad-scope", "head")),
        ("acl_cross_layer", ("--fp16", "--acl-grad-scope", "top:1")),
    ],
)
def test_fp16_overflows_are_skipped_and_enter_no_statistic(trained, criterion, flags):
    """A loss scale of 2^22 overflows: fairseq skips those updates (zeroes the gradients and
    halves the scale), and ACL-Grad keeps their decisions out of the angle log and the
    logged means, also for the scopes that decide before the backward pass overflows."""
    scale = ("--fp16-init-scale", str(2**22))
    out, save_dir = trained(criterion, *flags, *scale, patches=("cpu_fp16",))
    skips = out.count(OVERFLOW_NOTE)
    records = train_inner(out)
    print(f"{criterion} {' '.join(flags)}: {skips} overflowing updates skipped")
    assert skips >= 3 and float(records[-1]["loss_scale"]) <= 2.0 ** (22 - skips)
    assert [int(r["num_updates"]) for r in records] == list(range(1, UPDATES + 1))
    assert all(math.isfinite(float(r["loss"])) for r in records)
    rows = angles(save_dir)  # one decision per applied update (--update-freq 1), any scope
    assert [u for u, _, _ in rows] == list(range(UPDATES))
    for record, (_, angle, kept) in zip(records, rows):
        assert float(record["acl_grad_angle"]) == pytest.approx(angle, abs=0.051)
        assert float(record["acl_grad_drop"]) == (0.0 if kept else 1.0)
