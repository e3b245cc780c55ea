"""``--criterion acl_cross_layer``: ACL-CL for multi-exit models.

For every shallow exit ``m``: ``CE_m + lambda_cl * ACL-CL_m`` with the last exit ``M`` as
teacher (SupCon over the student's N features and K label embeddings plus the teacher's,
teacher detached: 2N + 2K vectors). For the last exit: ``CE_M + lambda * ACL-Embed_M``. The
per-exit CE losses are weighted as in ``multi_exit_ce`` (``--exit-weighting``), the
contrastive terms by ``--cross-layer-weighting`` (the same weights by default).

The teacher is the model's own last exit (``live``, the default): its features and label
embeddings as they are in this forward pass, detached. With ``--frozen-teacher PATH`` it is a
frozen snapshot instead, as in the paper (an already-trained last exit): the model of the
checkpoint at ``PATH`` (normally stage 1's ``checkpoint_best.pt``), in eval mode (no dropout),
loaded from ``PATH`` at the first forward pass, so a resumed run has the same teacher.

ACL-Grad (on by default) decides once per update on the *total* CE gradient versus the
*total* contrastive gradient: deciding per exit would cost one extra backward pass per exit
(M + 1 instead of 2), and the exits share the backbone, whose gradient is where the terms
conflict. ``--self-distill-weight``'s term counts as contrastive there: like ACL-CL it pulls
the shallow exits toward the last one, and it conflicts with CE where the last exit is wrong.
"""

import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from ..acl_grad.config import AclGradConfig
from ..distributed import unwrap_model
from ..errors import AclValueError
from ..models.types import ExitOutput
from .base import ContrastiveConfig
from .losses import acl_embed_loss, cross_layer_loss
from .multi_exit_ce import MultiExitCeConfig, MultiExitCeCriterion, exit_weights

logger = logging.getLogger(__name__)

CROSS_LAYER_WEIGHTING = ChoiceEnum(["exit", "layer", "uniform"])


@dataclass
class AclCrossLayerConfig(MultiExitCeConfig, ContrastiveConfig, AclGradConfig):
    """``multi_exit_ce``'s flags, the contrastive term's (``--contrastive-lambda`` weighs
    ACL-Embed on the last exit), ACL-Grad's (on by default), and ACL-CL's own."""

    cross_layer_lambda: float = field(
        default=0.5,
        metadata={"help": "weight lambda_cl of ACL-CL on every shallow exit"},
    )
    cross_layer_weighting: CROSS_LAYER_WEIGHTING = field(  # type: ignore[valid-type]
        default="exit",
        metadata={
            "help": "weights of the exits' contrastive terms: 'exit' (those of --exit-weighting), "
            "'layer' (proportional to the layer index, PABEE) or 'uniform'; normalised to 1"
        },
    )
    frozen_teacher: str = field(
        default="",
        metadata={
            "help": "ACL-CL teacher: empty for the live last exit (detached); else the path of a "
            "checkpoint (normally stage 1's checkpoint_best.pt) whose model, frozen and in eval "
            "mode, gives the last-exit features and label embeddings the shallow exits learn from"
        },
    )


@register_criterion("acl_cross_layer", dataclass=AclCrossLayerConfig)
class AclCrossLayerCriterion(MultiExitCeCriterion):
    name = "acl_cross_layer"

    def __init__(self, cfg: AclCrossLayerConfig, task):
        super().__init__(cfg, task)
        self.contrastive_lambda = cfg.contrastive_lambda
        self.cross_layer_lambda = cfg.cross_layer_lambda
        self.temperature = cfg.temperature
        self.cross_layer_weighting = str(cfg.cross_layer_weighting)
        self.frozen_teacher_path = cfg.frozen_teacher
        if self.frozen_teacher_path and not os.path.isfile(self.frozen_teacher_path):
            raise AclValueError(
                f"--frozen-teacher {self.frozen_teacher_path}: no such file; pass the stage-1 "
                "checkpoint (e.g. checkpoints/stage1/checkpoint_best.pt) or leave the flag out "
                "for the live teacher"
            )
        # Not a submodule: the snapshot is neither trained, nor saved with the criterion.
        self._teacher: list[nn.Module] = []

    def check_model(self, model: nn.Module) -> None:
        """A multi-exit model with at least one shallow exit: ACL-CL teaches the shallow
        exits, so a model whose only exit is the last layer would train plain ACL-Embed."""
        super().check_model(model)
        if not model.shallow_exit_layers:
            raise AclValueError(
                f"--criterion {self.name} needs shallow exits, but the model has only the "
                "final exit (--exit-layers none), so ACL-CL would have nothing to teach and "
                "the run would be plain ACL-Embed: pass --exit-layers (e.g. 4,8, or leave it "
                "out for an exit on every layer), or use --criterion acl_embed"
            )

    def contrastive_weights(self, layers: list[int]) -> list[float]:
        if self.cross_layer_weighting == "exit":
            return super().contrastive_weights(layers)
        return exit_weights(layers, self.cross_layer_weighting)

    def frozen_teacher(self, model: nn.Module) -> nn.Module:
        """The eval-mode copy of ``model`` with the weights of ``--frozen-teacher``."""
        if not self._teacher:
            from fairseq import checkpoint_utils

            state = checkpoint_utils.load_checkpoint_to_cpu(self.frozen_teacher_path)["model"]
            key = f"classification_heads.{self.classification_head_name}.out_proj.weight"
            head = model.classification_heads[self.classification_head_name]
            if key not in state or state[key].shape != head.out_proj.weight.shape:
                raise AclValueError(
                    f"--frozen-teacher {self.frozen_teacher_path} has no trained head "
                    f"'{self.classification_head_name}' with {head.out_proj.out_features} "
                    "classes: pass a checkpoint fine-tuned on this task (stage 1)"
                )
            teacher = copy.deepcopy(unwrap_model(model))  # not fairseq's distributed wrappers
            teacher.load_state_dict(state, strict=True)
            teacher.eval().requires_grad_(False)
            logger.info(f"ACL-CL teacher: frozen snapshot of {self.frozen_teacher_path}")
            self._teacher.append(teacher)
        return self._teacher[0]

    def teacher_output(self, model: nn.Module, sample: dict[str, Any], outputs) -> ExitOutput:
        """The last exit the shallow exits learn from: the live one, or the frozen snapshot's."""
        if not self.frozen_teacher_path:
            return outputs[-1]
        with torch.no_grad():
            return self.frozen_teacher(model).final_exit_output(
                sample["net_input"]["src_tokens"], self.classification_head_name
            )

    def contrastive_terms(self, model, sample, outputs, targets: Tensor) -> list[Tensor]:
        """ACL-CL per shallow exit of ``outputs`` and ACL-Embed on its last; with the final
        exit alone (``--alternate-exits``) no teacher runs."""
        last = outputs[-1]
        final_term = self.contrastive_lambda * acl_embed_loss(
            last.features, targets, last.label_embeddings, self.temperature
        )
        if len(outputs) == 1:
            return [final_term]
        teacher = self.teacher_output(model, sample, outputs)
        terms = [
            self.cross_layer_lambda
            * cross_layer_loss(
                o.features,
                o.label_embeddings,
                teacher.features,
                teacher.label_embeddings,
                targets,
                self.temperature,
            )
            for o in outputs[:-1]
        ]
        return [*terms, final_term]
