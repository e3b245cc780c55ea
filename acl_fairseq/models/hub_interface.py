"""Hub interface of the multi-exit RoBERTa: fairseq's ``RobertaHubInterface`` plus early exit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.models.roberta.hub_interface import RobertaHubInterface
from torch import Tensor

from ..data.text_encoder import ExampleEncoder
from ..early_exit.policies import EntropyPolicy, ExitPolicy, as_policy
from ..inference.loader import CheckpointError, check_device
from ..inference.precision import model_precision
from .types import EarlyExitResult

__all__ = ["MultiExitRobertaHubInterface", "hub_data_folder", "model_folder_bpe_files"]

FULL_DEPTH = "none"  # the policy name of full depth, as acl-fairseq-predict --policy none


class MultiExitRobertaHubInterface(RobertaHubInterface):
    """``RobertaHubInterface`` for ``MultiExitRobertaModel`` checkpoints.

    Everything of the parent (``encode``, ``predict``, ``extract_features``...) works as for
    plain RoBERTa on the final exit. Added: ``predict_early_exit`` and ``exit_logits``, both run
    in eval mode without gradients. ``default_policy`` (an ``ExitPolicy`` or a ``parse_policy``
    string; ``None`` = full depth) is what ``predict_early_exit`` uses without a policy;
    ``from_pretrained`` sets it from the checkpoint's ``early_exit_policy.json`` when that was
    chosen on the checkpoint's weights (the policy chosen at the hub's ``dtype``, which is
    read-only). ``label_names`` (set by ``from_pretrained``) names the classes in the model's
    order: the label list the checkpoint recorded at training, else its data folder's; it names
    the predictions of ``predict_early_exit`` (``result.labels``). ``num_inputs`` is 2 for a
    sentence-pair model. An int8 hub stays on the CPU (``hub.cuda()`` is refused).
    """

    default_policy: ExitPolicy | str | None = None
    example_encoder: ExampleEncoder | None = None
    label_names: list[str] | None = None
    num_inputs: int | None = None

    @property
    def dtype(self) -> str:
        """The precision the model runs at (``from_pretrained(..., dtype=...)``); read-only."""
        return model_precision(self.model)

    @dtype.setter
    def dtype(self, value: str) -> None:
        raise AttributeError(
            f"hub.dtype is read-only: the model runs at {self.dtype}; to run at {value}, load "
            f"it again with from_pretrained(..., dtype={value!r})"
        )

    def cuda(self, device: Any = None) -> MultiExitRobertaHubInterface:
        self._check_device(torch.device("cuda"))
        return super().cuda(device)

    def to(self, *args: Any, **kwargs: Any) -> MultiExitRobertaHubInterface:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            self._check_device(device)
        return super().to(*args, **kwargs)

    def _check_device(self, device: torch.device) -> None:
        """An int8 hub stays on the CPU (``CheckpointError``, a ``ValueError``)."""
        fix = "keep it on the CPU, or load it with from_pretrained(..., dtype='bf16')"
        check_device(self.dtype, device, f"hub.dtype {self.dtype}", fix)

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
                ``"none"``: full depth; ``None``: ``self.default_policy``, or full depth when
                that is ``None`` too.
        Returns:
            ``EarlyExitResult(predictions B, exit_layers B, logits B x K, labels)``, ``labels``
            the predictions' names when ``label_names`` is set.
        Raises:
            ValueError: a policy given for a model without shallow exits (``--exit-layers
                none``, as stage 1 is): it could only run full depth.
        """
        if not (policy is None or _full_depth(policy) or self.model.shallow_exit_layers):
            raise ValueError(
                f"predict_early_exit: policy {policy!r} given, but the model has no shallow "
                "exit (trained with --exit-layers none, as stage 1 is): only full depth is "
                "possible; pass no policy (or 'none'), or load a stage-2 checkpoint"
            )
        policy = self.default_policy if policy is None else policy
        if policy is None or _full_depth(policy):
            policy = EntropyPolicy(0.0)  # entropy 0: never leaves before the last layer
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


def _full_depth(policy: ExitPolicy | str) -> bool:
    return isinstance(policy, str) and policy.strip().lower() == FULL_DEPTH


def hub_data_folder(data_name_or_path: str, model_folder: Path) -> str | None:
    """``from_pretrained``'s data folder: an absolute path as given; a relative one from the
    current directory, else from ``model_folder`` (fairseq's convention: ``"."`` is the model's
    folder when it holds the dictionaries), the first that is a prepared folder; the default
    ``"."`` with neither: None (the folder the checkpoint was trained on)."""
    path = Path(data_name_or_path).expanduser()
    if path.is_absolute():
        return str(path)  # the loader names it if it is no prepared folder
    tried = [Path.cwd() / path, model_folder / path]
    for candidate in tried:
        if (candidate / "input0" / "dict.txt").is_file():
            return str(candidate)
    if str(path) == ".":
        return None
    for candidate in tried:
        if candidate.is_dir():
            return str(candidate)  # the loader says what it holds
    raise CheckpointError(
        f"data_name_or_path {data_name_or_path}: no such folder in the current directory "
        f"({tried[0]}) or in the model's folder ({tried[1]}): give the prepared data folder, "
        "absolute or relative to the current directory"
    )


def model_folder_bpe_files(folder: Path) -> dict[str, str]:
    """fairseq's ``hub_utils`` convenience: BPE files in the model's folder (a released
    model's archive) as config overrides."""
    files = {
        "code": "bpe_codes",
        "bpecodes": "bpe_codes",
        "sentencepiece.bpe.model": "sentencepiece_model",
        "merges.txt": "bpe_merges",
        "vocab.json": "bpe_vocab",
    }
    return {arg: str(folder / name) for name, arg in files.items() if (folder / name).is_file()}
