"""What the predict tests share: the checkpoints they train (the module-scoped ``trained``
fixture, imported by each test file), running acl-fairseq-predict in process, and the model's
own predictions to compare with."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from acl_fairseq.cli import predict
from acl_fairseq.data.splits import load_batches
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD

from fairseq_helpers import TINY_MULTI_EXIT, fairseq_train, prepare_tsv_task, train_args

MULTI_EXIT = train_args(
    TINY_MULTI_EXIT, criterion="multi_exit_ce", max_update=12, no_epoch_checkpoints=True
)
PLAIN = train_args(criterion="sentence_prediction", max_update=1, no_epoch_checkpoints=True)
STAGE1 = train_args(
    TINY_MULTI_EXIT, criterion="acl_embed", max_update=1, no_epoch_checkpoints=True
) + ["--exit-layers", "none"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("predict")
    data, test_rows = prepare_tsv_task(root)
    fairseq_train(data, root / "multi", *MULTI_EXIT)
    ckpt = root / "multi/checkpoint_last.pt"
    return {"root": root, "data": data, "rows": test_rows, "ckpt": ckpt}


@pytest.fixture
def timing_guard(monkeypatch) -> list[tuple]:
    """The sweep's deploy-time guard (``deploy.check_measured``: refuse a policy timed no
    faster than full depth) compares wall-clock times, which on a tiny model and a busy machine
    go either way; it is tested with fakes in test_early_exit_sweep.py. Here it records its
    calls ``(policy spec, early ms, full ms)`` and lets the policy through."""
    from acl_fairseq.inference import deploy

    calls: list[tuple] = []

    def record(policy, early_ms: float, full_ms: float, *_: object) -> None:
        calls.append((policy.spec, early_ms, full_ms))

    monkeypatch.setattr(deploy, "check_measured", record)
    return calls


def run_predict(*argv: str | Path, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = predict.main([str(a) for a in argv], io.StringIO(stdin), out, err)
    return code, out.getvalue(), err.getvalue()


def _model_predictions(trained, policy: str | None, dtype=None, batch_size=8) -> list[str]:
    """The model's own predictions on the binarized test split (label, layer)."""
    from acl_fairseq.early_exit.policies import parse_policy

    loaded = load_for_inference(trained["ckpt"], trained["data"], dtype=dtype)
    model, task = loaded.model, loaded.task
    labels = task.label_dictionary
    pad = task.source_dictionary.pad()
    out = []
    with torch.no_grad():
        for tokens, _ in load_batches(task, "test", batch_size):
            if batch_size == 1:
                tokens = tokens[:, : int(tokens.ne(pad).sum())]
            if policy is None:
                preds = model(tokens, classification_head_name=DEFAULT_HEAD)[0].argmax(-1)
                layers = [model.num_layers] * len(preds)
            else:
                result = model.early_exit(tokens, parse_policy(policy))
                preds, layers = result.predictions, result.exit_layers.tolist()
            out += [f"{labels[int(p) + labels.nspecial]}\t{n}" for p, n in zip(preds, layers)]
    return out
