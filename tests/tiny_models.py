"""Tiny fairseq RoBERTa / multi-exit models built in-process, and a few seconds of training.

``build_tiny(data_dir, arch, dims)`` builds a model as ``fairseq-train`` would (training parser,
``sentence_prediction`` task on a dictionary-only data folder, ``task.build_model``).
``train_tiny`` fits it to a synthetic rule (each word votes for a class; the label is the majority)
with every exit's cross-entropy summed, so that the model's predictions are confident and
deterministic functions of the input, as a fine-tuned model's are: agreement between
precisions then measures the precision, not ties between random logits.
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
from fairseq import options, tasks

HEAD = "sentence_classification_head"
NUM_CLASSES = 3
NUM_WORDS = 30
TINY_DIMS = ("--encoder-layers", "4", "--encoder-embed-dim", "32",
             "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4")  # fmt: skip
MINILM_DIMS = ("--encoder-layers", "6", "--encoder-embed-dim", "384",
               "--encoder-ffn-embed-dim", "1536", "--encoder-attention-heads", "12")  # fmt: skip


def write_dicts(root: Path, num_words: int = NUM_WORDS, num_classes: int = NUM_CLASSES) -> Path:
    """A data folder with only ``input0/dict.txt`` and ``label/dict.txt``."""
    (root / "input0").mkdir(parents=True, exist_ok=True)
    (root / "label").mkdir(parents=True, exist_ok=True)
    (root / "input0" / "dict.txt").write_text(
        "".join(f"w{i} {1000 - i}\n" for i in range(num_words))
    )
    (root / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in range(num_classes)))
    return root


def build_tiny(
    data_dir: Path,
    arch: str = "multi_exit_roberta",
    dims: tuple[str, ...] = TINY_DIMS,
    extra: tuple[str, ...] = (),
    seed: int = 0,
):
    """``(model in eval mode with HEAD registered, task)``."""
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
        words = torch.randint(0, NUM_WORDS, (n,), generator=gen)
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
