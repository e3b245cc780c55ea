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
"""

import os
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


PATCHES = {"cpu_fp16": cpu_fp16, "frozen_lm_head": frozen_lm_head}

if __name__ == "__main__":
    for name in filter(None, os.environ.get("ACL_TEST_PATCHES", "").split(",")):
        PATCHES[name]()
    from fairseq_cli.train import cli_main

    sys.argv[0] = "fairseq-train"
    sys.exit(cli_main())
