"""The demo: its fine-tuning commands (the recipe's, with the precision asked for), and ``make
demo`` (``acl-fairseq-demo``) end to end in its own process, on a tiny BERT and tiny sentences
put where the demo caches its downloads: every step runs, and the output has no DEBUG line and
no argument namespace dump."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fork_server import ForkServer

from acl_fairseq.cli.demo import cli as demo
from acl_fairseq.cli.demo.clock import Clock
from acl_fairseq.cpu_features import has_native_bf16
from acl_fairseq.experiment.fairseq_log import test_metrics as validate_metrics
from acl_fairseq.experiment.paths import BIN, USER_DIR
from acl_fairseq.experiment.recipe import flag_value
from acl_fairseq.inference.saved_policy import read_policy

from fairseq_helpers import NEGATIVE, NEUTRAL, POSITIVE, REPO, run
from predict_helpers import trained  # noqa: F401 (a fixture: a tiny multi-exit checkpoint)
from tiny_bert import tiny_bert


def demo_train_command(tmp_path, monkeypatch, method: str, restore, epochs: int, **kwargs):
    """(the path ``demo.train`` returns, the one fairseq-train command it ran), the command
    recorded instead of run; ``kwargs``: ``autocast`` (default none) and ``train``'s own."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "fairseq_args.txt").write_text("--arch roberta --encoder-layers 2\n")
    commands = []

    def fake_run(cmd, log_file, threads=None, tag=""):
        commands.append(cmd)
        (log_file.parent / "checkpoint_best.pt").write_bytes(b"")

    monkeypatch.setattr(demo, "run_logged", fake_run)
    args = argparse.Namespace(force=False, train=32, batch_size=16, lr=5e-5, seed=1,
                              autocast=kwargs.pop("autocast", "none"))  # fmt: skip
    best = demo.train(tmp_path / "data", model, tmp_path / "run", method, args, restore, epochs,
                      **kwargs)  # fmt: skip
    (cmd,) = commands
    return best, cmd


@pytest.mark.parametrize("autocast", ["none", "bf16"])
def test_demo_trains_with_the_autocast_asked_for(tmp_path, monkeypatch, autocast):
    best, cmd = demo_train_command(tmp_path, monkeypatch, "acl", tmp_path, 1, autocast=autocast)
    assert best == tmp_path / "run" / "checkpoint_best.pt"
    assert flag_value(cmd, "--autocast") == (None if autocast == "none" else "bf16")
    assert flag_value(cmd, "--criterion") == "acl_embed" and flag_value(cmd, "--seed") == "1"


def test_stage_3_refits_the_shallow_heads_on_the_frozen_model(tmp_path, monkeypatch):
    stage2 = tmp_path / "acl_cl" / "checkpoint_best.pt"
    _, cmd = demo_train_command(tmp_path, monkeypatch, "multi_exit_joint", stage2, 10, refit=True)
    assert "--freeze-backbone" in cmd and flag_value(cmd, "--criterion") == "multi_exit_ce"
    assert flag_value(cmd, "--exit-head") == "linear"
    assert flag_value(cmd, "--self-distill-weight") == "1"
    assert flag_value(cmd, "--self-distill-temperature") == "2"
    assert flag_value(cmd, "--restore-file") == str(stage2)
    assert float(flag_value(cmd, "--lr")) == demo.REFIT_LR
    assert flag_value(cmd, "--max-epoch") == "10"
    # the final exit is frozen, so its dev accuracy cannot choose: the lowest dev loss does
    assert flag_value(cmd, "--best-checkpoint-metric") == "loss"
    assert "--maximize-best-checkpoint-metric" not in cmd


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512bw {flags}
vmx flags\t: vnmi preemption_timer avx512_bf16
bugs\t\t: sysret_ss_attrs

"""


@pytest.mark.parametrize(
    "flags, native",
    [("avx512_bf16 avx512_vnni", True), ("amx_bf16 amx_tile", True), ("avx512_vnni", False),
     ("", False)],
)  # fmt: skip
def test_native_bf16_is_read_from_the_cpu_flags(flags, native):
    assert has_native_bf16(CPUINFO.format(flags=flags)) is native  # not from "vmx flags"


def test_the_demo_trains_in_bf16_where_the_cpu_has_it(monkeypatch):
    monkeypatch.setattr(demo, "has_native_bf16", lambda: True)
    assert [demo.resolve_autocast(c) for c in ("auto", "none", "bf16")] == ["bf16", "none", "bf16"]
    monkeypatch.setattr(demo, "has_native_bf16", lambda: False)
    assert [demo.resolve_autocast(c) for c in ("auto", "none", "bf16")] == ["none", "none", "bf16"]


def snippets(path: Path, n: int) -> None:
    """``id<TAB>score<TAB>text`` as the movie-review snippets file has them."""
    rng = random.Random(0)
    lines = []
    for i in range(n):
        positive = i % 2 == 0
        words = rng.sample(POSITIVE if positive else NEGATIVE, 3) + rng.sample(NEUTRAL, 4)
        rng.shuffle(words)
        lines.append(f"{i}\t{'2.1' if positive else '-1.7'}\t{' '.join(words)} .\n")
    path.write_text("".join(lines), encoding="utf-8")


@pytest.mark.parametrize("cores, threads", [(4, 2), (2, 1), (1, None)])
def test_stage_1_trains_ce_and_acl_side_by_side_on_the_cores(tmp_path, monkeypatch, cores, threads):
    """CE and ACL stage 1 run at once, the cores shared, each line tagged by its method; on
    one core, one after the other on it."""
    ran = []

    def fake_run(cmd, log_file, threads=None, tag=""):
        ran.append((flag_value(cmd, "--criterion"), threads, tag, log_file.parent.name))
        (log_file.parent / "checkpoint_best.pt").write_bytes(b"")

    monkeypatch.setattr(demo, "run_logged", fake_run)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    model = tmp_path / "model"
    model.mkdir()
    (model / "fairseq_args.txt").write_text("--arch roberta --encoder-layers 2\n")
    args = argparse.Namespace(force=False, train=32, batch_size=16, lr=5e-5, seed=1,
                              autocast="none")  # fmt: skip
    common = dict(data=tmp_path / "data", model_dir=model, args=args, restore=model, epochs=1)
    jobs = [{**common, "save_dir": tmp_path / m, "method": m} for m in ("ce", "acl")]
    assert demo.train_side_by_side(jobs) == [tmp_path / m / "checkpoint_best.pt"
                                             for m in ("ce", "acl")]  # fmt: skip
    tags = ("[ce] ", "[acl] ") if threads else ("", "")
    assert sorted(ran) == sorted([("sentence_prediction", threads, tags[0], "ce"),
                                  ("acl_embed", threads, tags[1], "acl")])  # fmt: skip


def test_step_5_accuracy_is_fairseq_validates(trained):  # noqa: F811
    """Step 5's in-process accuracy of every exit equals fairseq-validate's on the same
    checkpoint and split (the command step 5 ran before)."""
    data, checkpoint = trained["data"], trained["ckpt"]
    ours = demo.exit_accuracy(data, checkpoint, "test")
    out = run([str(BIN / "fairseq-validate"), str(data), "--user-dir", str(USER_DIR),
               "--task", "acl_sentence_prediction", "--criterion", "acl_cross_layer",
               "--no-acl-grad", "--path", str(checkpoint), "--valid-subset", "test",
               "--batch-size", "64", "--required-batch-size-multiple", "1", "--cpu",
               "--num-workers", "0", "--log-format", "json"])  # fmt: skip
    theirs = validate_metrics(out, "test")
    layers = sorted(int(k[len("accuracy_exit") :]) for k in theirs if k.startswith("accuracy_exit"))
    assert len(layers) > 1 and sorted(ours) == layers
    for layer in layers:  # fairseq logs accuracy rounded to 0.1
        assert ours[layer] == pytest.approx(theirs[f"accuracy_exit{layer}"], abs=0.05 + 1e-9)


@pytest.mark.slow
def test_demo_runs_every_step_without_debug_lines_or_namespaces(tmp_path):
    work = tmp_path / "demo_work"
    tiny_bert(work / "minilm-hf")  # the demo's download folders, filled: nothing is fetched
    snippets(work / "movieReviewSnippets_GroundTruth.txt", 160)
    env = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    # a tiny random model: a wide --max-accuracy-drop, so that dev has a policy to choose
    cmd = [sys.executable, "-m", "acl_fairseq.cli.demo", "--work-dir", str(work),
           "--train", "64", "--dev", "32", "--test", "32", "--sweep-examples", "16",
           "--max-accuracy-drop", "50"]  # fmt: skip
    proc = subprocess.run(ForkServer.served(cmd), capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=900)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    for step in range(1, 9):
        assert f"=== {step}/8 " in output
    assert "| ACL + ACL-CL stage 2 |" in output and "| exits refitted (stage 3) |" in output
    assert "[ce] trained in " in output and "[acl] trained in " in output  # side by side
    # stage 3 trained the shallow exits' heads only: every other weight is stage 2's
    (stage2,) = (work / "runs").glob("*/acl_cl/checkpoint_best.pt")
    (ckpt,) = (work / "runs").glob("*/acl_cl_refit-ep20/checkpoint_best.pt")
    before, after = (torch.load(p, weights_only=False)["model"] for p in (stage2, ckpt))
    heads = {k for k in before if "_exit" in k}
    assert heads and all(k.startswith("classification_heads.") for k in heads)
    assert before.keys() - heads == after.keys() - heads
    assert all(torch.equal(before[k], after[k]) for k in before.keys() - heads)
    # the shallow heads are linear (--exit-head linear): out_proj only, trained from fresh
    linear = {k for k in after if "_exit" in k}
    assert linear == {k for k in heads if ".out_proj." in k}
    assert not any(torch.equal(before[k], after[k]) for k in linear)
    # the frozen part ran once per sentence, its outputs cached (models.frozen_backbone)
    said = "--freeze-backbone: the frozen part runs once per sentence"
    assert said in (ckpt.parent / "train.log").read_text()
    # the deployable path: int8 and a policy chosen on dev, saved, reported, run by predict
    saved = read_policy(ckpt)
    assert saved is not None and saved.dtype == "int8" and saved.policy.kind == "entropy"
    assert saved.fields["chosen_by"]["split"] == "valid"
    assert f"chosen on dev (predict's default): int8 + {saved.policy.spec}" in output
    table = [line for line in output.splitlines() if line.startswith("| ")]
    reference = next(line for line in table if "fp32 full depth (reference)" in line)
    assert reference.endswith(" | 1.00x | 1.00x |")  # its own speed-up, batch 32 and 1
    (chosen,) = [line for line in table if line.startswith("| chosen: int8 + entropy:")]
    cells = [c.strip() for c in chosen.strip("|").split("|")]
    assert len(cells) == 5 and all(c.endswith("x") for c in cells[3:])
    assert 0 <= float(cells[1]) <= 100 and 1 <= float(cells[2]) <= 2  # tiny_bert: 2 layers
    assert f"acl-fairseq-predict: policy: {saved.policy.spec} (saved in " in output
    assert "acl-fairseq-predict: dtype: int8" in output
    assert "acl-fairseq-predict: 5 sentences, " in output
    assert "chosen: int8 + entropy:" in (work / "results.md").read_text()
    assert "time per step, wall / CPU seconds" in output and "done in " in output
    assert "DEBUG" not in output
    assert "Namespace(" not in output and "pin_memory" not in output


@pytest.mark.parametrize(
    "flags, message",
    [(["--sweep-examples", "0"], "--sweep-examples must be >= 1, got 0"),
     (["--refit-epochs", "-1"], "--refit-epochs must be >= 0 (0: no stage 3), got -1")],
)  # fmt: skip
def test_demo_reports_a_bad_size_in_one_line(tmp_path, capsys, flags, message):
    assert demo.main(["--work-dir", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err == f"acl-fairseq-demo: error: {message}\n"
    assert not any(tmp_path.iterdir())  # checked before anything is fetched or written


def test_the_clock_counts_the_cpu_time_of_the_commands_a_step_ran():
    clock = Clock()
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    wall, cpu = clock.lap("1 burn")
    assert cpu >= 0.3 and wall >= 0  # the command's CPU seconds, by construction
    clock.lap("2 nothing")
    assert [label for label, _, _ in clock.laps] == ["1 burn", "2 nothing"]
    assert clock.summary().startswith(
        f"time per step, wall / CPU seconds (its commands "
        f"included): 1 burn {wall:.0f} / {cpu:.0f}, 2 nothing "
    )
    assert clock.total()[1] >= cpu
