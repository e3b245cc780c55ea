"""The tiny multi-exit models of the model and early-exit tests, built like fairseq-train
builds them: command-line args parsed by fairseq's training parser, ``sentence_prediction``
task on a tiny data dir, ``task.build_model``. The hydra conversion
(``convert_namespace_to_omegaconf``, ~1 s) runs once per module for the task (``setup`` in
conftest.py: ``tiny_task``); for a legacy model like this one it only copies the args into
``cfg.model = Namespace(...)`` with ``_name = arch``, which ``tiny_cfg`` reproduces for the
other variants.

A second kind, for agreement tests (precision, calibration, benchmarks): ``build_with_task``
builds a model with its own task on a dictionary-only folder (``write_dicts``), and
``train_tiny`` fits it to a synthetic rule (each word votes for a class; the label is the
majority, ``random_batch``) with every exit's cross-entropy summed, so that its predictions are
confident and deterministic functions of the input, as a fine-tuned model's are: agreement
between precisions then measures the precision, not ties between random logits.
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
from fairseq import options, tasks

HEAD = "sentence_classification_head"
NUM_CLASSES = 3
NUM_WORDS = 20
TINY_DIMS = [
    "--encoder-layers", "4", "--encoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
]  # fmt: skip
LENGTHS = [3, 9, 1, 14, 6, 11, 2, 7]
RULE_WORDS = 30  # the synthetic rule's vocabulary (write_dicts, random_batch)
MINILM_DIMS = ("--encoder-layers", "6", "--encoder-embed-dim", "384",
               "--encoder-ffn-embed-dim", "1536", "--encoder-attention-heads", "12")  # fmt: skip


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


def write_dicts(root: Path, num_words: int = RULE_WORDS, num_classes: int = NUM_CLASSES) -> Path:
    """A data folder with only ``input0/dict.txt`` and ``label/dict.txt``."""
    (root / "input0").mkdir(parents=True, exist_ok=True)
    (root / "label").mkdir(parents=True, exist_ok=True)
    (root / "input0" / "dict.txt").write_text(
        "".join(f"w{i} {1000 - i}\n" for i in range(num_words))
    )
    (root / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in range(num_classes)))
    return root


def build_with_task(
    data_dir: Path,
    arch: str = "multi_exit_roberta",
    dims: tuple[str, ...] = tuple(TINY_DIMS),
    extra: tuple[str, ...] = (),
    seed: int = 0,
):
    """``(untrained model in eval mode with HEAD registered, its own task)``."""
    import acl_fairseq  # noqa: F401  (registers the plugin)

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        [str(data_dir), "--task", "sentence_prediction", "--criterion", "sentence_prediction",
         "--num-classes", str(NUM_CLASSES), "--max-positions", "64", "--arch", arch,
         "--dropout", "0", "--attention-dropout", "0", *dims, *extra],
    )  # fmt: skip
    model_cfg = Namespace(**vars(args))
    model_cfg._name = args.arch
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(model_cfg)
    return model.eval(), task


def random_batch(task, batch: int, seed: int, min_len: int = 2, max_len: int = 12):
    """``(tokens B x T right-padded <s> words </s>, labels B)``: word ``w`` votes for class
    ``w % NUM_CLASSES``; the label is the class with the most votes (ties: the smallest)."""
    d = task.source_dictionary
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist()
    tokens = torch.full((batch, max(lengths) + 2), d.pad(), dtype=torch.long)
    labels = torch.empty(batch, dtype=torch.long)
    for i, n in enumerate(lengths):
        words = torch.randint(0, RULE_WORDS, (n,), generator=gen)
        tokens[i, : n + 2] = torch.cat(
            [torch.tensor([d.bos()]), words + d.nspecial, torch.tensor([d.eos()])]
        )
        counts = torch.bincount(words % NUM_CLASSES, minlength=NUM_CLASSES)
        labels[i] = int(counts.argmax())  # the first of the most frequent classes
    return tokens, labels


def train_tiny(model, task, steps: int = 80, batch: int = 32, lr: float = 3e-3, seed: int = 0):
    """A few seconds of Adam on the synthetic rule, every exit's CE summed; returns the model
    in eval mode."""
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        tokens, labels = random_batch(task, batch, seed=10_000 + step)
        if hasattr(model, "exit_outputs"):
            outs = [o.logits for o in model.exit_outputs(tokens, classification_head_name=HEAD)]
        else:
            outs = [model(tokens, classification_head_name=HEAD)[0]]
        loss = sum(torch.nn.functional.cross_entropy(o, labels) for o in outs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
