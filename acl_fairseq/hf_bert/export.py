"""A fine-tuned checkpoint as a Hugging Face ``transformers`` sequence-classification folder.

``export_checkpoint(CKPT, OUTDIR)`` (``acl-fairseq-export-hf``) writes ``config.json``
(``BertForSequenceClassification``, ``id2label`` from the labels the checkpoint recorded),
``model.safetensors`` and the tokenizer (``data.tokenizer.hf_json``), which
``AutoModelForSequenceClassification`` and ``AutoTokenizer`` load with no custom code. The
final exit by default; ``layer=l``: the exit at layer ``l`` as a BERT of ``l`` layers (an exit
reads the hidden states after its layer, as a shallower encoder's output).

A stock class holds only what BERT computes, so this is refused, one line naming the cause:
mean pooling (``--exit-pooling mean``: no stock sequence-classification head averages the real
tokens of a BERT encoder), a linear exit head (``--exit-head linear``: BERT's head is dense,
tanh, classifier), another pooler activation than tanh, a pre-norm encoder or one without the
embedding LayerNorm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..atomic_write import write_json, write_with
from ..data.tokenizer.hf_json import Framing, hf_tokenizer, write_tokenizer
from ..data.tokenizer.kinds import TokenizerConfig
from ..inference.loader import load_for_inference
from ..models.heads import DEFAULT_HEAD, exit_head_name
from .state import FAIRSEQ_TO_HIDDEN_ACT, ConversionError, fairseq_state_to_bert

__all__ = ["ExportSummary", "bert_config", "check_exportable", "export_checkpoint", "export_model"]


@dataclass
class ExportSummary:
    """What ``export_model`` wrote."""

    out_dir: Path
    layer: int  # the exit exported (its depth)
    num_layers: int  # the checkpoint's depth
    files: list[str]
    vocab_size: int  # the tokenizer's ids: the dictionary's, then the tokens it lacks
    unknown_tokens: int  # tokens the dictionary lacks (their rows: <unk>'s)


def exits_of(model: Any) -> list[int]:
    """The layers with an exit: the shallow ones of a multi-exit model, and the last."""
    depth = len(model.encoder.sentence_encoder.layers)
    return [*getattr(model, "shallow_exit_layers", ()), depth]


def check_exportable(model: Any, layer: int, head_name: str = DEFAULT_HEAD) -> str:
    """The name of the head of the exit at ``layer``; ``ConversionError`` for what no stock
    ``BertForSequenceClassification`` computes (``--exit`` names the exit)."""
    enc = getattr(getattr(model, "encoder", None), "sentence_encoder", None)
    if enc is None or not hasattr(enc, "layers"):
        raise ConversionError(f"{type(model).__name__} is not a RoBERTa/BERT encoder model")
    exits = exits_of(model)
    if layer not in exits:
        raise ConversionError(
            f"--exit {layer}: the model has exits at layers {', '.join(map(str, exits))}"
        )
    head = head_name if layer == exits[-1] else exit_head_name(head_name, layer)
    if head not in model.classification_heads:
        raise ConversionError(f"the checkpoint has no classification head {head!r}")
    module, args = model.classification_heads[head], model.args
    why = {
        getattr(module, "pooling", "first") == "mean": "it pools with --exit-pooling mean: no "
        "stock transformers sequence-classification head averages the real tokens of a BERT "
        "encoder (BERT's reads the first token); use acl-fairseq-predict, or train with "
        "--exit-pooling first",
        getattr(module, "kind", "mlp") == "linear": "it has a linear head (--exit-head "
        "linear), and BERT's head is dense, tanh, classifier; export an exit with an mlp head "
        "(the final exit has one)",
        getattr(args, "pooler_activation_fn", "tanh") != "tanh": "its head's activation is "
        f"--pooler-activation-fn {getattr(args, 'pooler_activation_fn', None)}, and BERT's "
        "pooler applies tanh",
        bool(getattr(args, "spectral_norm_classification_head", False)): "its head is "
        "spectral-normed (--spectral-norm-classification-head), which BERT's is not",
        enc.layer_norm is not None: "the encoder is pre-norm (--encoder-normalize-before), "
        "and BERT is post-norm",
        enc.layernorm_embedding is None: "the encoder has no embedding LayerNorm, and BERT "
        "normalises its embeddings",
        getattr(enc, "embed_scale", None) not in (None, 1.0): "the encoder scales its "
        "embeddings (no --no-scale-embedding), and BERT does not",
        type(enc.embed_positions).__name__ != "LearnedPositionalEmbedding": "its positions "
        "are not learned embeddings, and BERT's are",
        getattr(enc, "quant_noise", None) is not None: "its layers carry quantization noise "
        "(--quant-noise-pq)",
        getattr(args, "activation_fn", "gelu") not in FAIRSEQ_TO_HIDDEN_ACT: "its activation "
        f"--activation-fn {getattr(args, 'activation_fn', None)} is none of "
        f"{', '.join(FAIRSEQ_TO_HIDDEN_ACT)}",
    }
    reasons = [reason for failed, reason in why.items() if failed]
    if reasons:
        raise ConversionError(f"exit {layer} cannot be a stock BERT: {reasons[0]}")
    return head


def bert_config(model: Any, num_layers: int, vocab_size: int | None = None) -> dict[str, Any]:
    """``transformers.BertConfig`` fields of ``model``'s encoder cut after ``num_layers``
    layers (``vocab_size``: the exported vocabulary's, default the dictionary's)."""
    enc, args = model.encoder.sentence_encoder, model.args
    epsilons = {m.eps for m in enc.modules() if isinstance(m, torch.nn.LayerNorm)}
    if len(epsilons) != 1:
        raise ConversionError(f"the encoder's LayerNorms use several eps {sorted(epsilons)}")
    layer0 = enc.layers[0]
    rows, width = enc.embed_tokens.weight.shape
    return {
        "vocab_size": int(vocab_size or rows),
        "hidden_size": int(width),
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": int(layer0.self_attn.num_heads),
        "intermediate_size": int(layer0.fc1.out_features),
        "hidden_act": FAIRSEQ_TO_HIDDEN_ACT[getattr(args, "activation_fn", "gelu")],
        "hidden_dropout_prob": float(getattr(args, "dropout", 0.1)),
        "attention_probs_dropout_prob": float(getattr(args, "attention_dropout", 0.1)),
        "classifier_dropout": float(getattr(args, "pooler_dropout", 0.0)),
        "max_position_embeddings": int(enc.embed_positions.weight.shape[0] - enc.padding_idx - 1),
        "type_vocab_size": 2,  # both rows zero: fairseq has no segments
        "layer_norm_eps": float(epsilons.pop()),
        "pad_token_id": int(enc.padding_idx),
        "position_embedding_type": "absolute",
    }


def export_model(
    model: Any,
    out_dir: str | Path,
    tokenizer: TokenizerConfig,
    symbols: Sequence[str],
    framing: Framing,
    max_length: int,
    labels: Sequence[str] | None,
    regression: bool = False,
    layer: int | None = None,
    head_name: str = DEFAULT_HEAD,
    source: dict[str, Any] | None = None,
) -> ExportSummary:
    """Writes the folder of ``model``'s exit at ``layer`` (default: the final one).

    Args:
        tokenizer, symbols, framing: how the training data was encoded (the recorded
            tokenizer, the source dictionary's symbols, ``--init-token`` and co.).
        max_length: the longest input the model takes (``model_max_length``).
        labels: class names in class order (``id2label``; None: ``LABEL_i``).
        regression: a one-output regression head (``problem_type``).
        source: recorded in ``config.json`` under ``acl_fairseq`` (checkpoint, fingerprint).
    """
    depth = len(model.encoder.sentence_encoder.layers)
    layer = depth if layer is None else int(layer)
    head = check_exportable(model, layer, head_name)
    encoding = hf_tokenizer(tokenizer, symbols, framing)
    state = fairseq_state_to_bert(
        model.state_dict(),
        layer,
        encoding.vocab.rows,
        head,
        model.encoder.sentence_encoder.padding_idx,
    )
    num_labels = int(state["classifier.weight"].shape[0])
    if labels is not None and len(labels) != num_labels:
        raise ConversionError(f"{len(labels)} label names for a head of {num_labels} classes")
    names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(num_labels)]
    config = {
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        **bert_config(model, layer, len(encoding.vocab.tokens)),
        "id2label": {str(i): name for i, name in enumerate(names)},
        "label2id": {name: i for i, name in enumerate(names)},
        "problem_type": "regression" if regression else "single_label_classification",
        "acl_fairseq": {"exit_layer": layer, "num_layers": depth, **(source or {})},
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    weights = dict(state)
    write_with(out_dir / "model.safetensors",
               lambda tmp: save_file(weights, tmp, metadata={"format": "pt"}))  # fmt: skip
    tokenizer_files = write_tokenizer(encoding, out_dir, max_length)
    write_json(out_dir / "config.json", config, indent=2)  # last: the folder is complete
    files = ["config.json", "model.safetensors", *tokenizer_files]
    return ExportSummary(
        out_dir=out_dir,
        layer=layer,
        num_layers=depth,
        files=files,
        vocab_size=len(encoding.vocab.tokens),
        unknown_tokens=len(encoding.vocab.tokens) - len(symbols),
    )


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    data: str | Path | None = None,
    layer: int | None = None,
) -> ExportSummary:
    """``export_model`` of a checkpoint, its tokenizer, framing and labels read from its
    prepared data folder (``data``, default: the one it was trained on)."""

    loaded = load_for_inference(checkpoint, data, "cpu", text="required", fingerprint=True)
    task, examples = loaded.task, loaded.examples
    assert loaded.meta is not None and examples is not None
    framing = Framing(examples.init_token, examples.separator_token, task.source_dictionary.eos())
    head_name = getattr(task.cfg, "classification_head_name", None) or DEFAULT_HEAD
    source = {"checkpoint": Path(checkpoint).name, "fingerprint": loaded.fingerprint}
    return export_model(
        loaded.model,
        out_dir,
        TokenizerConfig(**loaded.meta["tokenizer"]),
        task.source_dictionary.symbols,
        framing,
        loaded.max_positions,
        None if loaded.regression else loaded.labels,
        loaded.regression,
        layer,
        head_name,
        source,
    )
