"""What the early-exit benchmarks share (``benchmarks/inference_speed.py``,
``benchmarks/early_exit_overhead.py``): the machine's description, a MiniLM-L6-sized BERT in
``transformers`` and the same weights as a ``multi_exit_roberta``, random BERT batches, shallow
exits spread like trained ones, entropy thresholds for a mean exit layer, single-row batches,
and the loop's goals. Needs ``transformers`` (the test extra)."""

from __future__ import annotations

import argparse
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from acl_fairseq.cpu_features import cpu_model_name
from acl_fairseq.early_exit.policies import EntropyPolicy, softmax_entropy
from acl_fairseq.early_exit.thresholds import ExitLogits, simulate_exits
from acl_fairseq.hf_bert import state as cv
from acl_fairseq.hf_bert import vocab as hf_vocab
from acl_fairseq.models.heads import DEFAULT_HEAD

__all__ = [
    "GOAL_FRACTION",
    "GOAL_FRACTION_BATCHED",
    "GOAL_OVERHEAD",
    "build_fairseq_model",
    "build_hf_model",
    "entropy_candidates",
    "entropy_for_mean_exit",
    "machine_description",
    "random_bert_batch",
    "single_rows",
    "stagger_exit_heads",
    "synthetic_vocab",
]

HEAD = DEFAULT_HEAD
GOAL_OVERHEAD = 0.03
"""Time of ``early_exit`` when no row leaves, over the plain forward: at most 3% more."""
GOAL_FRACTION = {1: 0.9}
"""Fraction of the layer-count ideal that the wall-clock speed-up reaches, per batch size."""
GOAL_FRACTION_BATCHED = 0.95
"""... at the other batch sizes."""
Batch = tuple[Tensor, Tensor]


def checkpoint_parser(doc: str | None, dev: str, test: str) -> argparse.ArgumentParser:
    """A benchmark's parser with its positional ``checkpoint`` and ``data`` and its ``--dev`` /
    ``--test`` splits (``dev`` / ``test``: their help)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint", help="multi-exit fairseq checkpoint")
    p.add_argument("data", help="its binarized data folder")
    p.add_argument("--dev", default="valid", help=dev)
    p.add_argument("--test", default="test", help=test)
    return p


def machine_description(device: torch.device) -> str:
    """CPU (and GPU) name, thread count and library versions."""
    import transformers

    cpu = cpu_model_name() or platform.processor() or platform.machine()
    text = f"CPU: {cpu}; torch threads: {torch.get_num_threads()}"
    if device.type == "cuda":
        text += f"; GPU: {torch.cuda.get_device_name(device)}"
    return (
        f"{text}; device: {device.type}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def synthetic_vocab(size: int) -> list[str]:
    """A BERT-like vocabulary: [PAD], [unused*], [UNK] [CLS] [SEP] [MASK] at 100..103, words."""
    specials = ["[PAD]"] + [f"[unused{i}]" for i in range(99)]
    specials += ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    return specials + [f"w{i}" for i in range(size - len(specials))]


def build_hf_model(hf_dir: str | None, classes: int) -> tuple[Any, list[str], dict[str, str]]:
    """(BertForSequenceClassification in eval mode, vocab, special tokens): the model of
    ``hf_dir``, or random MiniLM-L6-sized weights without one."""
    import transformers

    torch.manual_seed(0)
    if hf_dir:
        path = Path(hf_dir)
        model = transformers.BertForSequenceClassification.from_pretrained(path, num_labels=classes)
        tokens = hf_vocab.read_vocab(path / "vocab.txt")
        return model.eval(), tokens, hf_vocab.read_special_tokens(path)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        num_labels=classes,
    )
    model = transformers.BertForSequenceClassification(config)
    return model.eval(), synthetic_vocab(config.vocab_size), dict(hf_vocab.DEFAULT_SPECIAL_TOKENS)


def build_fairseq_model(
    hf_model: Any, vocab: list[str], special_tokens: dict[str, str], work: Path, classes: int
) -> tuple[Any, Any, list[int]]:
    """Convert ``hf_model``'s weights into a ``multi_exit_roberta`` of the same size.

    Returns ``(model in eval mode, task, bert_to_fairseq ids)``. Every LayerNorm gets BERT's
    eps; the shallow exit heads keep fairseq's random initialisation.
    """
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    config = hf_model.config.to_dict()
    spec = cv.arch_from_config(config, source="hf config")
    mapping = hf_vocab.build_vocab_mapping(vocab, special_tokens)
    state = cv.bert_state_to_fairseq(
        hf_model.state_dict(), spec, mapping.fairseq_to_bert, classification_head=HEAD
    )
    (work / "input0").mkdir(parents=True, exist_ok=True)
    (work / "label").mkdir(parents=True, exist_ok=True)
    hf_vocab.write_dict(work / "input0" / "dict.txt", mapping)
    (work / "label" / "dict.txt").write_text("".join(f"{i} 1\n" for i in range(classes)))
    parser = options.get_training_parser()
    fs_args = options.parse_args_and_arch(
        parser,
        [str(work), "--task", "sentence_prediction", "--criterion", "sentence_prediction"]
        + ["--num-classes", str(classes), *spec.fairseq_args(arch="multi_exit_roberta")],
    )
    cfg = convert_namespace_to_omegaconf(fs_args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    model.load_state_dict(state, strict=True, model_cfg=cfg.model)
    eps = float(config.get("layer_norm_eps", 1e-12))
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = eps
    return model.eval(), task, mapping.bert_to_fairseq


@torch.no_grad()
def stagger_exit_heads(model: Any, tokens: Tensor, spread: float = 1.5) -> None:
    """Make the random shallow exits behave like trained ones, for threshold picking.

    With random weights every row gets nearly the same exit logits, so any threshold sends
    the whole batch out at one layer. On a calibration batch, each shallow exit's ``out_proj``
    is rescaled so that its logits vary across rows with std ``spread`` around a margin that
    grows with depth (class 0 favoured by ``0.6 * layer``); the final exit is left as converted.
    """
    outputs = model.exit_outputs(tokens, classification_head_name=HEAD)
    for out, (layer, head) in zip(outputs[:-1], model.exit_heads(HEAD)[:-1]):
        mean = out.logits.mean(dim=0)
        scale = spread / float((out.logits - mean).std(dim=0).mean().clamp(min=1e-6))
        target = torch.zeros_like(mean)
        target[0] = 0.6 * layer
        head.out_proj.weight.mul_(scale)
        head.out_proj.bias.copy_(scale * (head.out_proj.bias - mean) + target)


def random_bert_batch(
    vocab: list[str], batch: int, length: int, seed: int = 0, min_length: int | None = None
) -> tuple[Tensor, Tensor]:
    """BERT ids ``[CLS] words [SEP] [PAD]...`` (B x T) and attention mask; rows have lengths in
    ``[min_length, length]`` (all ``length`` by default)."""
    index = {tok: i for i, tok in enumerate(vocab)}
    words = [i for i, tok in enumerate(vocab) if not (tok.startswith("[") and tok.endswith("]"))]
    gen = torch.Generator().manual_seed(seed)
    word_ids = torch.tensor(words)
    ids = torch.full((batch, length), index["[PAD]"], dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    lengths = torch.randint(min_length or length, length + 1, (batch,), generator=gen)
    for b, n in enumerate(lengths.tolist()):
        body = word_ids[torch.randint(len(words), (n - 2,), generator=gen)]
        ids[b, :n] = torch.cat(
            [torch.tensor([index["[CLS]"]]), body, torch.tensor([index["[SEP]"]])]
        )
        mask[b, :n] = 1
    return ids, mask


def entropy_candidates(logits: ExitLogits, limit: int = 2000) -> list[float]:
    """0 and thresholds just above the shallow exits' entropies (at most ``limit`` of them)."""
    values = torch.cat([softmax_entropy(x) for _, x in logits[:-1]]).unique()
    if values.numel() > limit:
        values = values.quantile(torch.linspace(0, 1, limit, dtype=values.dtype))
    return [0.0] + (values + 1e-6).tolist()


def entropy_for_mean_exit(logits: ExitLogits, target: float) -> float:
    """The entropy threshold whose mean exit layer is closest to ``target``."""
    candidates = entropy_candidates(logits)
    best, best_gap = 0.0, float("inf")
    for threshold in candidates:
        layers, _ = simulate_exits(logits, EntropyPolicy(threshold))
        gap = abs(float(layers.float().mean()) - target)
        if gap < best_gap:
            best, best_gap = threshold, gap
    return best


def single_rows(batches: Sequence[Batch], pad: int, limit: int) -> list[Batch]:
    """Up to ``limit`` batches of one row each, trailing padding removed."""
    out: list[Batch] = []
    for tokens, target in batches:
        for row, label in zip(tokens, target):
            width = int(row.ne(pad).sum())
            out.append((row[:width].unsqueeze(0), label.view(1)))
            if len(out) == limit:
                return out
    return out
