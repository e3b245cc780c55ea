"""The tiny multi-exit models of the model and early-exit tests, built like fairseq-train
builds them: command-line args parsed by fairseq's training parser, ``sentence_prediction``
task on a tiny data dir, ``task.build_model``. The hydra conversion
(``convert_namespace_to_omegaconf``, ~1 s) runs once per module for the task (``setup`` in
conftest.py: ``tiny_task``); for a legacy model like this one it only copies the args into
``cfg.model = Namespace(...)`` with ``_name = arch``, which ``tiny_cfg`` reproduces for the
other variants.
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
from fairseq import options

HEAD = "sentence_classification_head"
NUM_CLASSES = 3
NUM_WORDS = 20
TINY_DIMS = [
    "--encoder-layers", "4", "--encoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
]  # fmt: skip
LENGTHS = [3, 9, 1, 14, 6, 11, 2, 7]


def write_tiny_data(root: Path) -> Path:
    """A data dir with just the dictionaries (``NUM_WORDS`` words, ``NUM_CLASSES`` labels)."""
    (root / "input0").mkdir()
    (root / "label").mkdir()
    (root / "input0" / "dict.txt").write_text(
        "".join(f"w{i} {100 - i}\n" for i in range(NUM_WORDS))
    )
    (root / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in range(NUM_CLASSES)))
    return root


def tiny_args(data_dir, arch="multi_exit_roberta_tiny", extra=()) -> Namespace:
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser,
        [
            str(data_dir), "--task", "sentence_prediction", "--criterion", "sentence_prediction",
            "--num-classes", str(NUM_CLASSES), "--max-positions", "64", "--arch", arch, *extra,
        ],
    )  # fmt: skip


def tiny_cfg(data_dir, arch="multi_exit_roberta_tiny", extra=()) -> Namespace:
    """``cfg.model`` as ``convert_namespace_to_omegaconf`` builds it for a legacy model."""
    args = tiny_args(data_dir, arch, extra)
    model_cfg = Namespace(**vars(args))
    model_cfg._name = args.arch
    return model_cfg


def sharpen(model):
    """Larger weights: input-dependent, confident and varied exits at random init."""
    with torch.no_grad():
        for param in model.encoder.sentence_encoder.layers.parameters():
            if param.dim() == 2:
                param.mul_(10.0)
        for head in model.classification_heads.values():
            head.out_proj.weight.mul_(8.0)


def build_tiny(data_dir, task, arch="multi_exit_roberta_tiny", extra=(), seed=0, sharp=True):
    """(model in eval mode with the task's head registered, its model cfg)."""
    model_cfg = tiny_cfg(data_dir, arch, extra)
    torch.manual_seed(seed)
    model = task.build_model(model_cfg)
    if sharp:
        sharpen(model)
    return model.eval(), model_cfg


def tiny_batch(task, lengths, seed=1):
    """Right-padded B x T batch: <s> words </s> pad..., and the unpadded rows."""
    d = task.source_dictionary
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        words = torch.randint(d.nspecial, d.nspecial + NUM_WORDS, (n,), generator=gen)
        rows.append(torch.cat([torch.tensor([d.bos()]), words, torch.tensor([d.eos()])]))
    tokens = torch.full((len(rows), max(len(r) for r in rows)), d.pad(), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, rows
