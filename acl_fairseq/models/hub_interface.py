"""Hub interface of the multi-exit RoBERTa: fairseq's ``RobertaHubInterface`` plus early exit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.models.roberta.hub_interface import RobertaHubInterface
from torch import Tensor

from ..data.text_encoder import ExampleEncoder
from ..early_exit.policies import EntropyPolicy, ExitPolicy, as_policy
from .types import EarlyExitResult

__all__ = ["MultiExitRobertaHubInterface"]


class MultiExitRobertaHubInterface(RobertaHubInterface):
    """``RobertaHubInterface`` for ``MultiExitRobertaModel`` checkpoints.

    Everything of the parent (``encode``, ``predict``, ``extract_features``...) works as for
    plain RoBERTa on the final exit. Added: ``predict_early_exit`` and ``exit_logits``, both run
    in eval mode without gradients. ``default_policy`` (an ``ExitPolicy`` or a ``parse_policy``
    string; ``None`` = full depth) is what ``predict_early_exit`` uses without a policy;
    ``from_pretrained`` sets it from the checkpoint's ``early_exit_policy.json`` when there is
    one (the policy chosen at the hub's ``dtype``). ``label_names`` (set by ``from_pretrained``)
    names the classes in the model's order: the label list the checkpoint recorded at training,
    else its data folder's; it names the predictions of ``predict_early_exit``
    (``result.labels``). ``num_inputs`` is 2 for a sentence-pair model.
    """

    default_policy: ExitPolicy | str | None = None
    example_encoder: ExampleEncoder | None = None
    label_names: list[str] | None = None
    num_inputs: int | None = None
    dtype: str = "fp32"
    """The precision the model runs at (``from_pretrained(..., dtype=...)``)."""

    def encode(self, sentence: str, *addl_sentences: str, no_separator: bool = False) -> Tensor:
        """Raw text -> 1D token ids. With the tokenizer a prepared folder recorded
        (``example_encoder``, set by ``from_pretrained``): exactly as the training data,
        ``--init-token`` / ``--separator-token`` and length rules included
        (``acl_fairseq.data.text_encoder``); otherwise as ``RobertaHubInterface.encode``."""
        texts = 1 + len(addl_sentences)
        if self.num_inputs is not None and texts != self.num_inputs:
            kind = "a sentence-pair" if self.num_inputs == 2 else "a single-sentence"
            raise ValueError(
                f"hub.encode: {texts} text(s) for {kind} model ({self.num_inputs} input(s))"
            )
        if self.example_encoder is None or no_separator:
            return super().encode(sentence, *addl_sentences, no_separator=no_separator)
        return self.example_encoder.encode([sentence, *addl_sentences], where="hub.encode")

    def _batch(self, tokens: Tensor) -> Tensor:
        """1D (T) or 2D (B x T) fairseq ids -> B x T on the model's device."""
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be T or B x T, got shape {tuple(tokens.shape)}")
        if tokens.size(-1) > self.model.max_positions():
            raise ValueError(
                f"tokens exceeds maximum length: {tokens.size(-1)} > {self.model.max_positions()}"
            )
        return tokens.long().to(device=self.device)

    def predict(self, head: str, tokens: Tensor, return_logits: bool = False) -> Tensor:
        """As ``RobertaHubInterface.predict`` (final exit), with the padding mask passed to the
        head so that ``--exit-pooling mean`` ignores padding in a padded batch."""
        logits = self.model(self._batch(tokens), classification_head_name=head)[0]
        return logits if return_logits else F.log_softmax(logits, dim=-1)

    def predict_early_exit(
        self, head: str, tokens: Tensor, policy: ExitPolicy | str | None = None
    ) -> EarlyExitResult:
        """Batched early-exit prediction.

        Args:
            head: classification head name (e.g. ``"sentence_classification_head"``).
            tokens: T or B x T fairseq ids (right-padded with the dictionary's pad).
            policy: an ``ExitPolicy`` or a string for ``parse_policy`` (``"entropy:0.3"``);
                ``None``: ``self.default_policy``, or full depth when that is ``None`` too.
        Returns:
            ``EarlyExitResult(predictions B, exit_layers B, logits B x K, labels)``, ``labels``
            the predictions' names when ``label_names`` is set.
        Raises:
            ValueError: a policy given for a model without shallow exits (``--exit-layers
                none``, as stage 1 is): it could only run full depth.
        """
        if policy is not None and not self.model.shallow_exit_layers:
            raise ValueError(
                f"predict_early_exit: policy {policy!r} given, but the model has no shallow "
                "exit (trained with --exit-layers none, as stage 1 is): only full depth is "
                "possible; pass no policy, or load a stage-2 checkpoint"
            )
        if policy is None:
            policy = self.default_policy or EntropyPolicy(0.0)  # entropy 0: full depth
        tokens = self._batch(tokens)
        with utils.model_eval(self.model), torch.no_grad():
            result = self.model.early_exit(tokens, as_policy(policy), classification_head_name=head)
        if self.label_names is None:
            return result
        return result._replace(labels=[self.label_names[int(p)] for p in result.predictions])

    def exit_logits(self, head: str, tokens: Tensor) -> dict[int, Tensor]:
        """Logits of every exit, ``{layer: B x K}`` ordered by layer (last = final head)."""
        tokens = self._batch(tokens)
        with utils.model_eval(self.model), torch.no_grad():
            outputs = self.model.exit_outputs(tokens, classification_head_name=head)
        return {out.layer: out.logits for out in outputs}
