"""The demo's fine-tuning commands: the recipe's, with the precision asked for."""

import argparse

import pytest

from acl_fairseq.cli.demo import cli as demo
from acl_fairseq.recipe import flag_value


@pytest.mark.parametrize("autocast", ["none", "bf16"])
def test_demo_trains_with_the_autocast_asked_for(tmp_path, monkeypatch, autocast):
    model = tmp_path / "model"
    model.mkdir()
    (model / "fairseq_args.txt").write_text("--arch roberta --encoder-layers 2\n")
    commands = []

    def fake_run(cmd, log_file):
        commands.append(cmd)
        (log_file.parent / "checkpoint_best.pt").write_bytes(b"")

    monkeypatch.setattr(demo, "run_logged", fake_run)
    args = argparse.Namespace(
        force=False, train=32, batch_size=16, lr=5e-5, seed=1, autocast=autocast
    )
    best = demo.train(tmp_path / "data", model, tmp_path / "run", "acl", args, tmp_path, 1)
    assert best == tmp_path / "run" / "checkpoint_best.pt"
    (cmd,) = commands
    assert flag_value(cmd, "--autocast") == (None if autocast == "none" else "bf16")
    assert flag_value(cmd, "--criterion") == "acl_embed" and flag_value(cmd, "--seed") == "1"
