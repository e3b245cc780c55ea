"""What the recipe tests share: fairseq's published GLUE table, the methods, the environment of
scripts/glue/train.sh, and running its command in process."""

from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

from acl_fairseq.cli.glue import main as glue_main

from fairseq_helpers import BIN, REPO

TRAIN_SH = REPO / "scripts" / "glue" / "train.sh"
CONFIGS = REPO / "configs" / "finetuning"
CONFIGS_README = REPO / "configs" / "README.md"

# fairseq's RoBERTa GLUE table (examples/roberta/config/finetuning/*.yaml):
# task -> (yaml name, num_classes, lr, batch size, total updates, warmup updates, best metric)
TASKS = {
    "CoLA": ("cola", 2, 1e-5, 16, 5336, 320, "mcc"),
    "SST-2": ("sst_2", 2, 1e-5, 32, 20935, 1256, "accuracy"),
    "MRPC": ("mrpc", 2, 1e-5, 16, 2296, 137, "acc_and_f1"),
    "STS-B": ("sts_b", 1, 2e-5, 16, 3598, 214, "loss"),
    "QQP": ("qqp", 2, 1e-5, 32, 113272, 28318, "acc_and_f1"),
    "MNLI": ("mnli", 3, 1e-5, 32, 123873, 7432, "accuracy"),
    "QNLI": ("qnli", 2, 1e-5, 32, 33112, 1986, "accuracy"),
    "RTE": ("rte", 2, 2e-5, 16, 2036, 122, "accuracy"),
}
METHODS = {
    # method -> (task, criterion, multi-exit arch) of its (last) stage
    "ce": ("acl_sentence_prediction", "sentence_prediction", False),
    "ce_scl": ("acl_sentence_prediction", "ce_scl", False),
    "acl": ("acl_sentence_prediction", "acl_embed", False),
    "multi_exit_joint": ("acl_sentence_prediction", "multi_exit_ce", True),
    "acl_cl": ("acl_sentence_prediction", "acl_cross_layer", True),
}
ENV = {
    "FAIRSEQ_TRAIN": str(BIN / "fairseq-train"),
    "FP16": "0",
    "PRETRAINED": "/pretrained/model.pt",
    "DATA_DIR": "/nonexistent/glue-bin",
}


def glue(*args: str, cwd: Path | None = None, **env: str | None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``train.sh ARGS`` (``acl_fairseq.cli.glue``) run here,
    with ``ENV`` and ``env`` as its environment (None unsets), in ``cwd``."""
    full = {k: v for k, v in {**ENV, **env}.items() if v is not None}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with contextlib.chdir(cwd or Path.cwd()):
            code = glue_main(list(args), full)
    return code, out.getvalue(), err.getvalue()


def parse_commands(text: str) -> list[list[str]]:
    """The command lines of a dry run's output (``#`` lines left out, `` \\`` lines joined)."""
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip()]


def dry_run_commands(*args: str, **env: str | None) -> list[list[str]]:
    """The fairseq-train command lines that ``train.sh ... --dry-run`` prints."""
    code, out, err = glue(*args, "--dry-run", **env)
    assert code == 0, err
    return parse_commands(out)
