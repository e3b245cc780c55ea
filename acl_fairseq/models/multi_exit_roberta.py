"""Multi-exit RoBERTa/BERT for sequence classification, with batched early-exit inference.

A ``MultiExitRobertaModel`` is a fairseq ``RobertaModel`` whose classification heads come in
groups: ``register_classification_head(name, K)`` registers the *final* exit under ``name``
(exactly where plain RoBERTa keeps its head, so plain checkpoints and fairseq tools keep
working) and one *shallow* exit per layer in ``--exit-layers`` under ``f"{name}_exit{layer}"``.

An exit at layer ``l`` sees what the encoder would output if it had only ``l`` layers: the
hidden states after layer ``l`` (followed by the encoder's final ``layer_norm`` when the model
has one, i.e. for pre-norm models), pooled by its head (``--exit-pooling first|mean``); a
shallow exit's head is RoBERTa's or ``out_proj`` alone (``--exit-head mlp|linear``).

* Training: ``exit_outputs`` runs the encoder once and returns every exit's logits, pooled
  features (the ``out_proj`` input) and label embeddings (``out_proj.weight``).
* Inference: ``early_exit`` runs the layers one by one and drops the rows that an
  ``ExitPolicy`` lets out, so later layers run on fewer rows.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.roberta.model import (
    RobertaModel,
    base_architecture,
    roberta_large_architecture,
)
from fairseq.utils import safe_getattr
from torch import Tensor

from ..errors import AclValueError
from ..fairseq_patches import mark_in_use
from .frozen_backbone import DEFAULT_CACHE_MB, FrozenBackboneMixin
from .heads import (
    DEFAULT_HEAD,
    EXIT_HEAD_CHOICES,
    POOLING_CHOICES,
    MultiExitClassificationHead,
    exit_head_name,
    head_kind_of,
)
from .types import ExitOutput

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_HEAD",
    "ExitOutput",
    "MultiExitClassificationHead",
    "MultiExitRobertaModel",
    "POOLING_CHOICES",
    "exit_head_name",
    "parse_exit_layers",
]

_EXIT_NAME_RE = re.compile(r"^(?P<base>.+)_exit(?P<layer>\d+)$")


def parse_exit_layers(spec: Any, num_layers: int) -> tuple[int, ...]:
    """Shallow exit layers (sorted, 1-based) from ``--exit-layers``.

    Args:
        spec: ``None`` (every layer below the last), a comma list ``"2,4"``, an int, a
            sequence of ints, or ``""``/``"none"`` (no shallow exit).
        num_layers: encoder layer count L; shallow exits must lie in ``1..L-1``.
    """
    if spec is None:
        return tuple(range(1, num_layers))
    if isinstance(spec, int):
        items: list[Any] = [spec]
    elif isinstance(spec, str):
        text = spec.strip()
        items = [] if text.lower() in ("", "none") else text.split(",")
    elif isinstance(spec, Sequence):
        items = list(spec)
    else:
        raise AclValueError(f"--exit-layers: expected a comma-separated list, got {spec!r}")
    layers = []
    for item in items:
        try:
            layer = int(str(item).strip())
        except ValueError:
            raise AclValueError(
                f"--exit-layers: {item!r} in {spec!r} is not an integer layer index"
            ) from None
        if not 1 <= layer <= num_layers - 1:
            raise AclValueError(
                f"--exit-layers: layer {layer} is outside 1..{num_layers - 1}; the model has "
                f"{num_layers} layers and layer {num_layers} always has the final exit"
            )
        layers.append(layer)
    if len(set(layers)) != len(layers):
        raise AclValueError(f"--exit-layers: duplicate layer in {spec!r}")
    return tuple(sorted(layers))


@register_model("multi_exit_roberta")
class MultiExitRobertaModel(FrozenBackboneMixin, RobertaModel):
    """RoBERTa with a classification exit after selected layers (see module docstring)."""

    def __init__(self, args: Any, encoder: Any) -> None:
        mark_in_use("model multi_exit_roberta")  # the guard rails act on this run
        super().__init__(args, encoder)
        if safe_getattr(args, "encoder_layerdrop", 0.0) > 0:
            raise AclValueError(
                "multi_exit_roberta does not support --encoder-layerdrop > 0 (the exits "
                "need the hidden states of every layer)"
            )
        self.num_layers: int = len(self.encoder.sentence_encoder.layers)
        self.shallow_exit_layers: tuple[int, ...] = parse_exit_layers(
            safe_getattr(args, "exit_layers", None), self.num_layers
        )
        self.exit_pooling: str = safe_getattr(args, "exit_pooling", "first")
        if self.exit_pooling not in POOLING_CHOICES:
            raise AclValueError(
                f"--exit-pooling must be one of {POOLING_CHOICES}, got {self.exit_pooling!r}"
            )
        self.exit_head: str = safe_getattr(args, "exit_head", None) or "mlp"
        if self.exit_head not in EXIT_HEAD_CHOICES:
            raise AclValueError(
                f"--exit-head must be one of {EXIT_HEAD_CHOICES}, got {self.exit_head!r}"
            )

    @staticmethod
    def add_args(parser) -> None:
        """Add model-specific arguments to the parser."""
        RobertaModel.add_args(parser)
        parser.add_argument(
            "--exit-layers",
            type=str,
            metavar="L1,L2,...",
            help="comma-separated 1-based encoder layers with a shallow exit (default: every "
            "layer below the last; the last layer always has the final exit; 'none' for none)",
        )
        parser.add_argument(
            "--exit-pooling",
            choices=POOLING_CHOICES,
            help="pooling of every exit (shallow and final): 'first' token like "
            "RobertaClassificationHead, or 'mean' over non-pad tokens (default: first)",
        )
        parser.add_argument(
            "--exit-head",
            choices=EXIT_HEAD_CHOICES,
            help="head of the shallow exits: 'mlp', RoBERTa's (dense, activation, out_proj; "
            "default), or 'linear', out_proj on the pooled features (cheaper per exit at small "
            "batches); the final exit keeps RoBERTa's",
        )
        parser.add_argument(
            "--freeze-backbone",
            action="store_true",
            help="DeeBERT-style second stage: train only the shallow exit heads; the "
            "embeddings, the transformer layers and the final exit are frozen (in eval mode, "
            "no dropout) and, with --task acl_sentence_prediction, run once per sentence: "
            "what they give the exits is cached (--freeze-backbone-cache-mb)",
        )
        parser.add_argument(
            "--freeze-backbone-cache-mb",
            type=float,
            metavar="MB",
            help="with --freeze-backbone: memory for the frozen part's outputs, cached per "
            "sentence (shallow exits x hidden size + the final exit's, in floats); sentences "
            "beyond it run the frozen encoder every time; 0: no cache "
            f"(default {DEFAULT_CACHE_MB})",
        )

    @classmethod
    def hub_models(cls) -> dict[str, str]:
        return {}

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str,
        checkpoint_file: str = "model.pt",
        data_name_or_path: str = ".",
        bpe: str | None = "recorded",
        dtype: str | None = None,
        **kwargs: Any,
    ):
        """A ``MultiExitRobertaHubInterface`` of the checkpoint ``model_name_or_path/
        checkpoint_file``: a thin delegate, as fairseq's own ``from_pretrained`` delegates to
        its hub module; the loading, the plan of what runs and the hub live in
        ``acl_fairseq.inference.hub`` (``from_pretrained`` there says every argument)."""
        from ..inference.hub import from_pretrained

        return from_pretrained(
            model_name_or_path, checkpoint_file, data_name_or_path, bpe, dtype, **kwargs
        )

    # ------------------------------------------------------------------ heads

    def register_classification_head(
        self, name: str, num_classes: int | None = None, inner_dim: int | None = None, **kwargs
    ) -> None:
        """Register the final exit under ``name`` and every shallow exit next to it."""
        if name in self.classification_heads:
            prev = self.classification_heads[name]
            if (
                num_classes != prev.out_proj.out_features
                or (inner_dim or self.args.encoder_embed_dim) != prev.dense.out_features
            ):
                logger.warning(
                    f're-registering head "{name}" with num_classes {num_classes} (prev: '
                    f"{prev.out_proj.out_features}) and inner_dim {inner_dim} (prev: "
                    f"{prev.dense.out_features})"
                )
        self.classification_heads[name] = self._build_head(num_classes, inner_dim)
        for layer in self.shallow_exit_layers:
            self.classification_heads[exit_head_name(name, layer)] = self._build_head(
                num_classes, inner_dim, self.exit_head
            )
        if safe_getattr(self.args, "freeze_backbone", False):
            self.freeze_backbone(name)

    def _build_head(self, num_classes: int | None, inner_dim: int | None, kind: str = "mlp"):
        args = self.args
        return MultiExitClassificationHead(
            input_dim=args.encoder_embed_dim,
            inner_dim=inner_dim or args.encoder_embed_dim,
            num_classes=num_classes,
            activation_fn=args.pooler_activation_fn,
            pooler_dropout=args.pooler_dropout,
            q_noise=args.quant_noise_pq,
            qn_block_size=args.quant_noise_pq_block_size,
            do_spectral_norm=args.spectral_norm_classification_head,
            pooling=self.exit_pooling,
            kind=kind,
        )

    def exit_heads(self, name: str = DEFAULT_HEAD) -> list[tuple[int, MultiExitClassificationHead]]:
        """``[(layer, head)]`` of the head group ``name``, by layer; the last is the final."""
        names = [exit_head_name(name, layer) for layer in self.shallow_exit_layers] + [name]
        missing = [n for n in names if n not in self.classification_heads]
        if missing:
            raise KeyError(
                f"classification heads {missing} are not registered; call "
                f"register_classification_head({name!r}, num_classes) first"
            )
        layers = list(self.shallow_exit_layers) + [self.num_layers]
        return [(layer, self.classification_heads[n]) for layer, n in zip(layers, names)]

    # --------------------------------------------------------------- forwards

    def padding_mask(self, src_tokens: Tensor) -> Tensor:
        """B x T bool, True at padding."""
        return src_tokens.eq(self.encoder.sentence_encoder.padding_idx)

    def exit_hidden(self, x: Tensor) -> Tensor:
        """T x B x C hidden states after some layer -> what an exit sees (T x B x C): the
        encoder's final layer norm for pre-norm models, else ``x`` itself."""
        layer_norm = self.encoder.sentence_encoder.layer_norm
        return layer_norm(x) if layer_norm is not None else x

    def forward(
        self,
        src_tokens: Tensor,
        features_only: bool = False,
        return_all_hiddens: bool = False,
        classification_head_name: str | None = None,
        **kwargs: Any,
    ):
        """As ``RobertaModel.forward``; heads also get the padding mask (for mean pooling)."""
        if classification_head_name is None:
            return super().forward(src_tokens, features_only, return_all_hiddens, **kwargs)
        x, extra = self.encoder(src_tokens, True, return_all_hiddens, **kwargs)
        head = self.classification_heads[classification_head_name]
        return head(x, padding_mask=self.padding_mask(src_tokens)), extra

    def exit_outputs(
        self,
        src_tokens: Tensor,
        classification_head_name: str = DEFAULT_HEAD,
        **unused: Any,
    ) -> list[ExitOutput]:
        """Every exit's output from one encoder pass (training or evaluation).

        Args:
            src_tokens: B x T token ids (other ``net_input`` entries such as ``src_lengths``
                are accepted and ignored, so ``exit_outputs(**sample["net_input"])`` works).
        Returns:
            one ``ExitOutput`` per exit ordered by layer; the last one's logits equal
            ``self(src_tokens, classification_head_name=name)[0]``.
        """
        cached = self.cached_exit_outputs(src_tokens, classification_head_name)
        if cached is not None:  # --freeze-backbone: the frozen part's outputs, once per sentence
            return cached
        heads = self.exit_heads(classification_head_name)
        features, extra = self.encoder(src_tokens, features_only=True, return_all_hiddens=True)
        inner_states = extra["inner_states"]  # L+1 tensors T x B x C, index 0 = embeddings
        if len(inner_states) != self.num_layers + 1:
            raise RuntimeError(
                f"expected {self.num_layers + 1} hidden states, got {len(inner_states)}"
            )
        padding_mask = self.padding_mask(src_tokens)
        outputs = []
        for layer, head in heads:
            if layer == self.num_layers:
                hidden = features  # B x T x C, final layer_norm already applied
            else:
                hidden = self.exit_hidden(inner_states[layer]).transpose(0, 1)
            logits, pooled = head.forward_with_features(hidden, padding_mask)
            outputs.append(ExitOutput(layer, logits, pooled, head.out_proj.weight))
        return outputs

    def final_exit_output(
        self, src_tokens: Tensor, classification_head_name: str = DEFAULT_HEAD
    ) -> ExitOutput:
        """The last exit alone (B x T ``src_tokens``), without the shallow exits' work."""
        head = self.classification_heads[classification_head_name]
        features, _ = self.encoder(src_tokens, features_only=True)  # B x T x C
        logits, pooled = head.forward_with_features(features, self.padding_mask(src_tokens))
        return ExitOutput(self.num_layers, logits, pooled, head.out_proj.weight)

    @torch.inference_mode()
    def early_exit(
        self,
        src_tokens: Tensor,
        policy: Any,
        classification_head_name: str = DEFAULT_HEAD,
        **unused: Any,
    ):
        """Batched early-exit inference (eval mode, no gradients): ``src_tokens`` B x T and
        an ``ExitPolicy`` (or a ``parse_policy`` string) -> ``EarlyExitResult(predictions B,
        exit_layers B, logits B x K)``. A thin delegate: the loop is the early-exit runtime's
        (``acl_fairseq.runtime.torch_loop``), which the plugin does not load for training."""
        if self.training:
            raise RuntimeError("early_exit is for inference: call model.eval() first")
        from ..early_exit.policies import as_policy
        from ..runtime.torch_loop import run_early_exit

        return run_early_exit(self, src_tokens, as_policy(policy), classification_head_name)

    # ------------------------------------------------------- checkpoint upgrade

    def upgrade_state_dict_named(self, state_dict: dict[str, Tensor], name: str) -> None:
        """Plain RoBERTa upgrade, made aware of exit head groups.

        ``RobertaModel.upgrade_state_dict_named`` already copies heads that the model has but
        the checkpoint lacks (e.g. exit heads when loading a plain RoBERTa checkpoint) from the
        model into ``state_dict``, so they keep their fresh initialisation under
        ``strict=True``. Before it runs, with ``--load-checkpoint-heads`` we register the
        checkpoint's head groups by their base name (so exit heads are not registered as
        groups of their own), and drop checkpoint exit heads at layers this model has no exit
        at.
        """
        prefix = name + "." if name != "" else ""
        heads_prefix = prefix + "classification_heads."
        ckpt_heads = {
            k[len(heads_prefix) :].split(".")[0] for k in state_dict if k.startswith(heads_prefix)
        }
        exit_of = {}  # checkpoint exit head name -> (base name, layer)
        for head in ckpt_heads:
            match = _EXIT_NAME_RE.match(head)
            if match and (
                match["base"] in ckpt_heads or match["base"] in self.classification_heads
            ):
                exit_of[head] = (match["base"], int(match["layer"]))

        for head in sorted(ckpt_heads - set(exit_of)):
            if state_dict[f"{heads_prefix}{head}.out_proj.weight"].size(0) == 0:
                self._take_pretrained_pooler(state_dict, heads_prefix, head)
        ckpt_heads = {
            k[len(heads_prefix) :].split(".")[0] for k in state_dict if k.startswith(heads_prefix)
        }
        if safe_getattr(self.args, "load_checkpoint_heads", False):
            for head in sorted(ckpt_heads - set(exit_of)):
                if head not in self.classification_heads:
                    self.register_classification_head(
                        head,
                        num_classes=state_dict[f"{heads_prefix}{head}.out_proj.weight"].size(0),
                        inner_dim=state_dict[f"{heads_prefix}{head}.dense.weight"].size(0),
                    )
        kind_of = {head: head_kind_of(state_dict, f"{heads_prefix}{head}.") for head in exit_of}
        for head, (_, layer) in exit_of.items():
            mine = self.classification_heads[head] if head in self.classification_heads else None
            kind = kind_of[head]
            if mine is not None and mine.kind != kind:  # e.g. a stage 3 refitting linear exits
                logger.warning(f"exit head {head}: the checkpoint's is {kind}, this model's "
                               f"{mine.kind}: it starts fresh (--exit-head {kind} keeps the "
                               "checkpoint's)")  # fmt: skip
            elif layer not in self.shallow_exit_layers:
                logger.warning(
                    f"deleting exit head {head} from checkpoint: this model has no exit at "
                    f"layer {layer} (--exit-layers {','.join(map(str, self.shallow_exit_layers))})"
                )
            else:
                continue
            for k in [k for k in state_dict if k.startswith(f"{heads_prefix}{head}.")]:
                del state_dict[k]
        # fairseq's upgrade reads every head's dense layer: linear exit heads wait outside it
        linear = {head for head, kind in kind_of.items() if kind == "linear"}
        held = {
            k: state_dict.pop(k)
            for k in list(state_dict)
            if k.startswith(heads_prefix) and k[len(heads_prefix) :].split(".")[0] in linear
        }
        super().upgrade_state_dict_named(state_dict, name)
        state_dict.update(held)  # over the fresh weights fairseq copied in for them

    def _take_pretrained_pooler(
        self, state_dict: dict[str, Tensor], heads_prefix: str, head: str
    ) -> None:
        """A checkpoint head with no class (``out_proj`` 0 x C) is a pretrained pooler, as
        the BERT converter writes it: it becomes the ``dense`` layer of this model's final
        head ``head`` (whose ``out_proj`` keeps its fresh initialisation); shallow exit heads
        keep theirs. Without such a head, or with another width, it is dropped."""
        key = f"{heads_prefix}{head}."
        mine = self.classification_heads[head] if head in self.classification_heads else None
        dense = state_dict[key + "dense.weight"]
        if mine is not None and mine.dense.weight.shape == dense.shape:
            logger.info(f"classification head {head}: dense layer from the pretrained pooler")
            state_dict[key + "out_proj.weight"] = mine.out_proj.weight.detach().clone()
            state_dict[key + "out_proj.bias"] = mine.out_proj.bias.detach().clone()
            return
        logger.info(f"dropping the pretrained pooler {head}: this model has no such head")
        for k in [k for k in state_dict if k.startswith(key)]:
            del state_dict[k]


# ----------------------------------------------------------------- architectures


def _exit_defaults(args: Any) -> None:
    args.exit_layers = safe_getattr(args, "exit_layers", None)
    args.exit_pooling = safe_getattr(args, "exit_pooling", "first")
    args.exit_head = safe_getattr(args, "exit_head", "mlp")


@register_model_architecture("multi_exit_roberta", "multi_exit_roberta_base")
@register_model_architecture("multi_exit_roberta", "multi_exit_roberta")
def multi_exit_roberta_architecture(args: Any) -> None:
    """RoBERTa-base defaults (``multi_exit_roberta`` and its alias ``multi_exit_roberta_base``);
    every ``--encoder-*`` size can be overridden (e.g. MiniLM)."""
    _exit_defaults(args)
    base_architecture(args)


@register_model_architecture("multi_exit_roberta", "multi_exit_roberta_large")
def multi_exit_roberta_large_architecture(args: Any) -> None:
    _exit_defaults(args)
    roberta_large_architecture(args)


@register_model_architecture("multi_exit_roberta", "multi_exit_roberta_tiny")
def multi_exit_roberta_tiny_architecture(args: Any) -> None:
    """4 layers x 32 dims, 4 heads: for tests."""
    args.encoder_layers = safe_getattr(args, "encoder_layers", 4)
    args.encoder_embed_dim = safe_getattr(args, "encoder_embed_dim", 32)
    args.encoder_ffn_embed_dim = safe_getattr(args, "encoder_ffn_embed_dim", 64)
    args.encoder_attention_heads = safe_getattr(args, "encoder_attention_heads", 4)
    _exit_defaults(args)
    base_architecture(args)
