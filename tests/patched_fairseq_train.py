"""``fairseq-train`` with test-only patches for what the CPU test machine lacks.

Usage: ``python tests/patched_fairseq_train.py FAIRSEQ-TRAIN-ARGS...`` with the patches named
in ``$ACL_TEST_PATCHES`` (a comma list). The plugin itself never applies them.

* ``cpu_fp16``: fairseq's fp16 training assumes CUDA in two places.
  ``FP16Optimizer.build_fp32_params`` keys its flat fp32 copy of the parameters by
  ``torch.cuda.current_device()`` and later finds the parameters of that key by their
  ``.device.index``; the trainer's overflow branch sets ``grad_norm = torch.tensor(0.0).cuda()``.
  Here ``torch.cuda.current_device()`` returns None (the ``.device.index`` of a CPU tensor)
  and ``Tensor.cuda()`` returns the tensor itself, so ``--fp16`` and
  ``--memory-efficient-fp16`` run fairseq's real optimizers and dynamic loss scaler on CPU.
* ``frozen_lm_head``: RoBERTa's LM head (``encoder.lm_head``, never used by sentence
  classification) is built frozen, except its weight, which is the token embedding's. torch's
  DistributedDataParallel then has no unused parameter and runs without
  ``--find-unused-parameters``.
* ``kill_at``: kills the process (SIGKILL, as ``kill -9``) at one moment named by
  ``$ACL_TEST_KILL_AT`` = ``EVENT:FILE:N``, the N-th EVENT on checkpoint file FILE (``*``: any):
  ``update`` (before the N-th training update), ``save`` (``torch.save`` of a checkpoint, after
  half of its bytes are written), ``copy`` (``shutil.copyfile`` of a checkpoint, after half of
  its bytes), ``replace`` (just before a checkpoint file is renamed into place). FILE is the
  final name (``checkpoint_last.pt``; a ``.tmp`` being written counts as its file). Works the
  same on fairseq's own saving code and on the plugin's.
"""

import io
import os
import shutil
import signal
import sys


def cpu_fp16() -> None:
    import torch

    torch.cuda.current_device = lambda: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def frozen_lm_head() -> None:
    from fairseq.models.roberta.model import RobertaEncoder

    build_lm_head = RobertaEncoder.build_lm_head

    def build_frozen_lm_head(self, *args, **kwargs):
        head = build_lm_head(self, *args, **kwargs)
        head.dense.requires_grad_(False)
        head.layer_norm.requires_grad_(False)
        head.bias.requires_grad_(False)
        return head

    RobertaEncoder.build_lm_head = build_frozen_lm_head


def kill_at() -> None:
    import torch
    from fairseq.trainer import Trainer

    event, name, nth = os.environ["ACL_TEST_KILL_AT"].split(":")
    seen = {"count": 0}

    def now(kind: str, path: object = "") -> bool:
        """Whether this is the moment: the N-th ``kind`` on the file named."""
        if kind != event:
            return False
        if kind != "update":
            base = os.path.basename(str(path)).removesuffix(".tmp")
            if not base.endswith(".pt") or name not in ("*", base):
                return False
        seen["count"] += 1
        return seen["count"] == int(nth)

    def die() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def half(data: bytes, f) -> None:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())

    real_save, real_copy = torch.save, shutil.copyfile
    real_rename, real_replace = os.rename, os.replace
    train_step = Trainer.train_step

    def save(obj, f, *args, **kwargs):
        if now("save", getattr(f, "name", f)):
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            if hasattr(f, "write"):
                half(buffer.getvalue(), f)
            else:
                with open(f, "wb") as out:
                    half(buffer.getvalue(), out)
            die()
        return real_save(obj, f, *args, **kwargs)

    def copyfile(src, dst, *args, **kwargs):
        if now("copy", dst):
            with open(src, "rb") as f, open(dst, "wb") as out:
                half(f.read(), out)
            die()
        return real_copy(src, dst, *args, **kwargs)

    def renamer(real):
        def rename(src, dst, *args, **kwargs):
            if now("replace", dst):
                die()
            return real(src, dst, *args, **kwargs)

        return rename

    def step(self, *args, **kwargs):
        if now("update"):
            die()
        return train_step(self, *args, **kwargs)

    torch.save, shutil.copyfile = save, copyfile
    os.rename, os.replace = renamer(real_rename), renamer(real_replace)
    Trainer.train_step = step


PATCHES = {"cpu_fp16": cpu_fp16, "frozen_lm_head": frozen_lm_head, "kill_at": kill_at}

if __name__ == "__main__":
    for name in filter(None, os.environ.get("ACL_TEST_PATCHES", "").split(",")):
        PATCHES[name]()
    from fairseq_cli.train import cli_main

    sys.argv[0] = "fairseq-train"
    sys.exit(cli_main())
