"""Exact resume: N updates, stop, resume from checkpoint_last.pt for M more == N + M at once.

The stop is mid-epoch (12 updates per epoch here, N = 5) and the resumed run crosses the
epoch boundary. What makes this exact in fairseq: ``--max-update`` saves
``checkpoint_last.pt`` when it stops, with the data iterator's position in the epoch
(``extra_state["train_iterator"]["iterations_in_epoch"]``), the optimizer and lr-scheduler
state; the trainer re-seeds torch before every update with ``seed + num_updates`` (so dropout
resumes exactly); the epoch's batch order only depends on ``seed + epoch``. ACL-Grad keeps no
state across updates (its buffer is emptied with ``.grad``), so nothing plugin-specific needs
saving. Two ways to stop: ``--max-update N`` (saves when it stops), and a preempted job,
which resumes from the last checkpoint it *saved*: mid-epoch, that needs
``--save-interval-updates`` (the test copies ``checkpoint_1_N.pt`` of the uninterrupted run).
"""

import shutil

import pytest
import torch

from fairseq_helpers import TINY_ROBERTA, fairseq_train, json_records, train_args

N, M = 5, 10
MULTI_EXIT = ["--arch", "multi_exit_roberta_tiny", "--encoder-layers", "3", "--max-positions", "64"]
CASES = {
    # update-freq 2: the ACL-Grad buffer accumulates over two micro-batches per update
    "acl_embed": [*TINY_ROBERTA, "--criterion", "acl_embed", "--update-freq", "2"],
    "acl_cross_layer": [*MULTI_EXIT, "--criterion", "acl_cross_layer", "--batch-size", "32"],
}
BASE = train_args(
    [],
    seed=2,
    lr_scheduler="polynomial_decay",
    total_num_update=40,
    warmup_updates=3,
    no_epoch_checkpoints=True,
    best_checkpoint_metric="accuracy",
    maximize_best_checkpoint_metric=True,
)
# everything a train_inner record holds that does not measure time
TIMING = {"wps", "ups", "wall", "train_wall"}


def train_inner(output: str) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in TIMING}
        for r in json_records(output)
        if "num_updates" in r and "epoch" in r
    ]


def run(data, save_dir, args, max_update: int) -> tuple[str, list[dict]]:
    out = fairseq_train(
        data,
        save_dir,
        *args,
        "--max-update",
        str(max_update),
        "--acl-grad-log",
        str(save_dir / "angles.tsv"),
    )
    return out, train_inner(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,how",
    [
        ("acl_embed", "stop"),  # --max-update N, then --max-update N+M from checkpoint_last.pt
        ("acl_cross_layer", "preempt"),  # resume from the --save-interval-updates checkpoint
    ],
)
def test_resume_mid_epoch_is_exact(sentiment_data, tmp_path, case, how):
    args = [*BASE, *CASES[case], "--save-interval-updates", str(N)]
    full_dir, split_dir = tmp_path / "full", tmp_path / "split"
    _, full_rec = run(sentiment_data, full_dir, args, N + M)
    assert [int(r["num_updates"]) for r in full_rec] == list(range(1, N + M + 1))
    assert int(full_rec[-1]["epoch"]) == 2  # the resumed part crosses an epoch boundary
    assert "acl_grad_angle" in full_rec[0]

    if how == "stop":
        _, first_rec = run(sentiment_data, split_dir, args, N)
        assert first_rec == full_rec[:N]
        first_angles = (split_dir / "angles.tsv").read_text()
    else:  # as if the full run had been killed after update N
        split_dir.mkdir()
        shutil.copy(full_dir / f"checkpoint_1_{N}.pt", split_dir / "checkpoint_last.pt")
        first_angles = "".join((full_dir / "angles.tsv").read_text().splitlines(True)[:N])
    state = torch.load(split_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    itr = state["extra_state"]["train_iterator"]
    assert itr["epoch"] == 1 and itr["iterations_in_epoch"] > 0  # a mid-epoch checkpoint

    second, second_rec = run(sentiment_data, split_dir, args, N + M)
    assert f"(epoch 1 @ {N} updates)" in second
    # every logged number (losses, accuracy, ACL-Grad angle and drop, gnorm, lr) is identical
    assert second_rec == full_rec[N:]
    # the same decisions with the same angles, update by update
    resumed_angles = (split_dir / "angles.tsv").read_text()
    if how == "stop":
        assert resumed_angles.startswith(first_angles)
    else:
        resumed_angles = first_angles + resumed_angles
    assert resumed_angles == (full_dir / "angles.tsv").read_text()

    a = torch.load(full_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    b = torch.load(split_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["extra_state"]["train_iterator"] == b["extra_state"]["train_iterator"]
