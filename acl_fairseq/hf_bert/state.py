"""Hugging Face BERT <-> fairseq RoBERTa: the architecture and the state-dict mapping both ways
(``bert_state_to_fairseq`` for ``convert``, ``fairseq_state_to_bert`` for ``export``; the
vocabulary is in ``vocab``)."""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConversionError
from ..models.heads import DEFAULT_HEAD

logger = logging.getLogger(__name__)

#: Hugging Face ``hidden_act`` -> fairseq ``--activation-fn`` (``gelu_accurate`` is the tanh form).
HIDDEN_ACT_TO_FAIRSEQ: dict[str, str] = {
    "gelu": "gelu",
    "gelu_new": "gelu_accurate",
    "gelu_pytorch_tanh": "gelu_accurate",
    "relu": "relu",
}
#: fairseq ``--activation-fn`` -> Hugging Face ``hidden_act`` (the way back).
FAIRSEQ_TO_HIDDEN_ACT: dict[str, str] = {
    "gelu": "gelu",
    "gelu_accurate": "gelu_new",
    "relu": "relu",
}
FAIRSEQ_PADDING_IDX = 1
FAIRSEQ_LAYER_NORM_EPS = 1e-5
#: Source keys that carry no information for the fairseq encoder (buffers, tied or NSP weights).
_IGNORED_KEY_RE = re.compile(
    r"(^|\.)(embeddings\.position_ids|embeddings\.token_type_ids)$"
    r"|^cls\.predictions\.decoder\.(weight|bias)$"
    r"|^cls\.seq_relationship\.(weight|bias)$"
)
LAYER_MAP: dict[str, str] = {
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.out_proj",
    "attention.output.LayerNorm": "self_attn_layer_norm",
    "intermediate.dense": "fc1",
    "output.dense": "fc2",
    "output.LayerNorm": "final_layer_norm",
}


@dataclass(frozen=True)
class ArchSpec:
    """fairseq RoBERTa hyper-parameters equivalent to a BERT ``config.json``."""

    encoder_layers: int
    encoder_embed_dim: int
    encoder_ffn_embed_dim: int
    encoder_attention_heads: int
    max_positions: int
    activation_fn: str
    dropout: float
    attention_dropout: float

    def fairseq_args(self, arch: str = "roberta") -> list[str]:
        """The ``fairseq-train`` flags that build a model matching the converted weights."""
        return [
            "--arch", arch,
            "--encoder-layers", str(self.encoder_layers),
            "--encoder-embed-dim", str(self.encoder_embed_dim),
            "--encoder-ffn-embed-dim", str(self.encoder_ffn_embed_dim),
            "--encoder-attention-heads", str(self.encoder_attention_heads),
            "--max-positions", str(self.max_positions),
            "--activation-fn", self.activation_fn,
            "--dropout", repr(self.dropout),
            "--attention-dropout", repr(self.attention_dropout),
        ]  # fmt: skip


# ----------------------------------------------------------------------------- reading inputs


def load_hf_config(hf_dir: Path) -> dict[str, Any]:
    """Read ``HF_DIR/config.json``."""
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConversionError(
            f"{path} not found: HF_DIR must be a Hugging Face model directory "
            "(config.json, vocab.txt, model.safetensors or pytorch_model.bin)"
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def arch_from_config(config: Mapping[str, Any], source: str = "config.json") -> ArchSpec:
    """Validate a BERT config and return the equivalent fairseq hyper-parameters."""
    model_type = config.get("model_type", "bert")
    if model_type != "bert":
        raise ConversionError(
            f"{source}: model_type={model_type!r} is not supported, only 'bert' checkpoints "
            "(BertModel, BertForMaskedLM, BertForSequenceClassification, ...) can be converted"
        )
    pos_type = config.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ConversionError(
            f"{source}: position_embedding_type={pos_type!r} is not supported; fairseq RoBERTa "
            "only has learned absolute positions (position_embedding_type='absolute')"
        )
    act = config.get("hidden_act", "gelu")
    if act not in HIDDEN_ACT_TO_FAIRSEQ:
        raise ConversionError(
            f"{source}: hidden_act={act!r} is not supported; use a checkpoint with one of "
            f"{sorted(HIDDEN_ACT_TO_FAIRSEQ)} (fairseq RoBERTa uses exact GELU)"
        )
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise ConversionError(
            f"{source}: is_decoder/add_cross_attention is set; only BERT encoders are supported"
        )
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if field not in config:
            raise ConversionError(f"{source}: required field {field!r} is missing")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if hidden % heads:
        raise ConversionError(
            f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}"
        )
    eps = float(config.get("layer_norm_eps", 1e-12))
    if abs(eps - FAIRSEQ_LAYER_NORM_EPS) > 1e-7:
        logger.warning(
            "%s: layer_norm_eps=%g but fairseq's LayerNorm uses %g: hidden states differ from "
            "Hugging Face by up to ~1e-2 (MiniLM-L6: 7.5e-3 after the embedding LayerNorm, "
            "1.7e-3 after the last layer) unless the model sets every LayerNorm's eps to %g",
            source,
            eps,
            FAIRSEQ_LAYER_NORM_EPS,
            eps,
        )
    return ArchSpec(
        encoder_layers=int(config["num_hidden_layers"]),
        encoder_embed_dim=hidden,
        encoder_ffn_embed_dim=int(config["intermediate_size"]),
        encoder_attention_heads=heads,
        max_positions=int(config.get("max_position_embeddings", 512)),
        activation_fn=HIDDEN_ACT_TO_FAIRSEQ[act],
        dropout=float(config.get("hidden_dropout_prob", 0.1)),
        attention_dropout=float(config.get("attention_probs_dropout_prob", 0.1)),
    )


def load_hf_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Load all tensors of a Hugging Face checkpoint (safetensors or pickle, maybe sharded)."""

    def load_file(path: Path) -> dict[str, torch.Tensor]:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file as load_safetensors

            return load_safetensors(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)

    for name in ("model.safetensors", "pytorch_model.bin"):
        if (hf_dir / name).is_file():
            return load_file(hf_dir / name)
        index = hf_dir / f"{name}.index.json"
        if index.is_file():
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load_file(hf_dir / shard))
            return state
    raise ConversionError(
        f"no weights in {hf_dir}: expected model.safetensors, pytorch_model.bin or a sharded "
        "*.index.json (re-save the model with save_pretrained)"
    )


# ----------------------------------------------------------------------------- weights


def find_bert_prefix(state: Mapping[str, torch.Tensor]) -> str:
    """Key prefix of the BERT encoder (``""`` for ``BertModel``, ``"bert."`` for task models)."""
    suffix = "embeddings.word_embeddings.weight"
    prefixes = [k[: -len(suffix)] for k in state if k.endswith(suffix)]
    if len(prefixes) != 1:
        raise ConversionError(
            f"expected exactly one key ending in {suffix!r} in the weights, found {prefixes}; "
            "is this a BERT checkpoint?"
        )
    prefix = prefixes[0]
    if prefix and not prefix.endswith("."):
        raise ConversionError(f"unexpected weight key prefix {prefix!r}")
    return prefix


def _normalize_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename TF-era ``LayerNorm.gamma/beta`` to ``LayerNorm.weight/bias``."""
    out = {}
    for k, v in state.items():
        k = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", k)
        k = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)
        out[k] = v
    return out


def _rows(weight: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
    """Gather rows ``weight[index]`` (``index`` -1: mean row); (V, ...) -> (len(index), ...)."""
    idx = torch.tensor(index, dtype=torch.long)
    out = weight.index_select(0, idx.clamp(min=0)).clone()
    missing = idx < 0
    if missing.any():
        out[missing] = weight.mean(dim=0, keepdim=True).to(out.dtype)
    return out


def bert_state_to_fairseq(
    state: Mapping[str, torch.Tensor],
    spec: ArchSpec,
    fairseq_to_bert: Sequence[int],
    classification_head: str | None = DEFAULT_HEAD,
    num_classes: int | None = None,
) -> OrderedDict[str, torch.Tensor]:
    """A Hugging Face BERT ``state`` as a float32 fairseq ``RobertaModel`` state dict (strict
    load): embeddings V' x C in ``fairseq_to_bert`` order (-1: the mean embedding), positions
    (max_positions + 2) x C. ``classification_head``: ``dense`` from the pooler, ``out_proj``
    from ``classifier``, or random with ``num_classes`` outputs, or 0 x C; None: no head."""
    state = _normalize_keys(state)
    p = find_bert_prefix(state)
    head_p = p[: -len("bert.")] if p.endswith("bert.") else ""
    consumed: set[str] = set()

    def get(key: str, required: bool = True) -> torch.Tensor | None:
        if key not in state:
            if required:
                raise ConversionError(f"weight {key!r} is missing from the checkpoint")
            return None
        consumed.add(key)
        return state[key].detach().to(torch.float32)

    C = spec.encoder_embed_dim
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    enc = "encoder.sentence_encoder."
    out[enc + "version"] = torch.tensor([3.0])

    word = get(f"{p}embeddings.word_embeddings.weight")  # (V_bert, C)
    if word.shape[1] != C:
        raise ConversionError(
            f"word_embeddings has width {word.shape[1]} but config.json hidden_size={C}"
        )
    embed_tokens = _rows(word, fairseq_to_bert)  # (V', C)
    out[enc + "embed_tokens.weight"] = embed_tokens

    pos = get(f"{p}embeddings.position_embeddings.weight")  # (P, C)
    if pos.shape[0] != spec.max_positions:
        raise ConversionError(
            f"position_embeddings has {pos.shape[0]} rows but config.json "
            f"max_position_embeddings={spec.max_positions}"
        )
    token_type = get(f"{p}embeddings.token_type_embeddings.weight", required=False)  # (T, C)
    if token_type is not None:
        if token_type.shape[0] > 1:
            logger.warning(
                "token_type_embeddings has %d rows: row 0 is folded into the positions, segment "
                "B embeddings are dropped (fairseq sentence-pair inputs have no segment ids)",
                token_type.shape[0],
            )
        pos = pos + token_type[0]
    offset = FAIRSEQ_PADDING_IDX + 1
    positions = torch.zeros(spec.max_positions + offset, C)  # (P + 2, C); rows 0, 1 unused
    positions[offset:] = pos
    out[enc + "embed_positions.weight"] = positions
    out[enc + "layernorm_embedding.weight"] = get(f"{p}embeddings.LayerNorm.weight")
    out[enc + "layernorm_embedding.bias"] = get(f"{p}embeddings.LayerNorm.bias")

    for i in range(spec.encoder_layers):
        src, dst = f"{p}encoder.layer.{i}.", f"{enc}layers.{i}."
        for hf_name, fs_name in LAYER_MAP.items():
            for param in ("weight", "bias"):
                out[f"{dst}{fs_name}.{param}"] = get(f"{src}{hf_name}.{param}")
    extra_layers = sorted(
        {
            int(m.group(1))
            for k in state
            if (m := re.match(re.escape(p) + r"encoder\.layer\.(\d+)\.", k))
            and int(m.group(1)) >= spec.encoder_layers
        }
    )
    if extra_layers:
        raise ConversionError(
            f"weights contain encoder layers {extra_layers} beyond config.json "
            f"num_hidden_layers={spec.encoder_layers}"
        )

    # Masked-LM head: BERT's cls.predictions if present, else identity dense + unit LayerNorm.
    lm = f"{head_p}cls.predictions."
    dense_w = get(lm + "transform.dense.weight", required=False)
    if dense_w is not None:
        out["encoder.lm_head.weight"] = embed_tokens  # tied, as in fairseq
        out["encoder.lm_head.bias"] = torch.zeros(len(fairseq_to_bert))
        bias = get(lm + "bias", required=False)
        if bias is not None:
            out["encoder.lm_head.bias"] = _rows(bias[:, None], fairseq_to_bert)[:, 0]
        out["encoder.lm_head.dense.weight"] = dense_w
        out["encoder.lm_head.dense.bias"] = get(lm + "transform.dense.bias")
        out["encoder.lm_head.layer_norm.weight"] = get(lm + "transform.LayerNorm.weight")
        out["encoder.lm_head.layer_norm.bias"] = get(lm + "transform.LayerNorm.bias")
    else:
        out["encoder.lm_head.weight"] = embed_tokens
        out["encoder.lm_head.bias"] = torch.zeros(len(fairseq_to_bert))
        out["encoder.lm_head.dense.weight"] = torch.eye(C)
        out["encoder.lm_head.dense.bias"] = torch.zeros(C)
        out["encoder.lm_head.layer_norm.weight"] = torch.ones(C)
        out["encoder.lm_head.layer_norm.bias"] = torch.zeros(C)

    pooler_w = get(f"{p}pooler.dense.weight", required=False)
    pooler_b = get(f"{p}pooler.dense.bias", required=False)
    cls_w = get(f"{head_p}classifier.weight", required=False)
    cls_b = get(f"{head_p}classifier.bias", required=False)
    if not classification_head and (pooler_w is not None or cls_w is not None):
        logger.info("BERT's pooler/classifier weights are not written (--no-classification-head)")
    if classification_head and pooler_w is None:
        logger.warning(
            "the checkpoint has no pooler (pooler.dense.*): the classification head '%s' is "
            "not written and starts from fairseq's random initialisation",
            classification_head,
        )
        classification_head = None
    if classification_head:
        head = f"classification_heads.{classification_head}."
        out[head + "dense.weight"], out[head + "dense.bias"] = pooler_w, pooler_b
        if cls_w is not None and cls_b is not None:
            if num_classes is not None and num_classes != cls_w.shape[0]:
                raise ConversionError(
                    f"--num-classes {num_classes} but the checkpoint's classifier has "
                    f"{cls_w.shape[0]} outputs"
                )
            out[head + "out_proj.weight"], out[head + "out_proj.bias"] = cls_w, cls_b
        elif num_classes is None:
            # The pretrained pooler alone: an out_proj with no class yet (0 x C). The
            # multi-exit model keeps the pooler as its final head's dense layer and gives the
            # head a fresh out_proj with the task's classes (plain RoBERTa drops the head).
            out[head + "out_proj.weight"] = torch.zeros(0, C)
            out[head + "out_proj.bias"] = torch.zeros(0)
        else:
            gen = torch.Generator().manual_seed(0)
            out[head + "out_proj.weight"] = torch.randn(num_classes, C, generator=gen) * 0.02
            out[head + "out_proj.bias"] = torch.zeros(num_classes)

    leftover = sorted(k for k in state if k not in consumed and not _IGNORED_KEY_RE.search(k))
    if leftover:
        logger.warning("ignored %d checkpoint tensors: %s", len(leftover), ", ".join(leftover))
    return out


def fairseq_state_to_bert(
    state: Mapping[str, torch.Tensor],
    num_layers: int,
    word_rows: Sequence[int] | None = None,
    classification_head: str | None = None,
    padding_idx: int = FAIRSEQ_PADDING_IDX,
) -> OrderedDict[str, torch.Tensor]:
    """A post-norm fairseq RoBERTa ``state`` as a float32 ``BertModel`` state dict of its
    first ``num_layers`` layers (the reverse of ``bert_state_to_fairseq``): word embeddings in
    ``word_rows`` order (default: the dictionary's), positions from row ``padding_idx + 1``
    on, two segment rows of zeros (fairseq has no segments; the converter folded BERT's
    segment A into the positions). With ``classification_head``: a
    ``BertForSequenceClassification`` state dict (``bert.`` prefix; the head's ``dense`` as
    the pooler, its ``out_proj`` as the classifier)."""
    enc = "encoder.sentence_encoder."
    if enc + "layer_norm.weight" in state:
        raise ConversionError(
            "the encoder is pre-norm (a final layer_norm, --encoder-normalize-before): BERT is "
            "post-norm, so no BERT holds these weights"
        )

    def get(key: str) -> torch.Tensor:
        if key not in state:
            raise ConversionError(f"weight {key!r} is missing: not a RoBERTa/BERT encoder")
        return state[key].detach().to(torch.float32).clone()

    word = get(enc + "embed_tokens.weight")  # (V, C)
    positions = get(enc + "embed_positions.weight")[padding_idx + 1 :]  # (P, C)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    out["embeddings.word_embeddings.weight"] = word if word_rows is None else _rows(word, word_rows)
    out["embeddings.position_embeddings.weight"] = positions.contiguous()
    out["embeddings.token_type_embeddings.weight"] = torch.zeros(2, word.shape[1])
    out["embeddings.LayerNorm.weight"] = get(enc + "layernorm_embedding.weight")
    out["embeddings.LayerNorm.bias"] = get(enc + "layernorm_embedding.bias")
    for i in range(num_layers):
        src, dst = f"{enc}layers.{i}.", f"encoder.layer.{i}."
        for hf_name, fs_name in LAYER_MAP.items():
            for param in ("weight", "bias"):
                out[f"{dst}{hf_name}.{param}"] = get(f"{src}{fs_name}.{param}")
    if classification_head is None:
        return out
    head = f"classification_heads.{classification_head}."
    if head + "dense.weight" not in state:
        raise ConversionError(
            f"head {classification_head!r} has no dense layer (a linear exit head): "
            "BertForSequenceClassification has a dense + tanh pooler before its classifier"
        )
    out = OrderedDict((f"bert.{k}", v) for k, v in out.items())
    out["bert.pooler.dense.weight"] = get(head + "dense.weight")
    out["bert.pooler.dense.bias"] = get(head + "dense.bias")
    out["classifier.weight"] = get(head + "out_proj.weight")
    out["classifier.bias"] = get(head + "out_proj.bias")
    return out
