"""Hub interface of the multi-exit RoBERTa: fairseq's ``RobertaHubInterface`` plus early exit."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.models.roberta.hub_interface import RobertaHubInterface
from torch import Tensor

from ..data.text_encoder import ExampleEncoder
from ..early_exit.policies import EntropyPolicy, ExitPolicy, as_policy
from ..errors import AclValueError
from ..models.multi_exit_roberta import MultiExitRobertaModel
from ..runtime.precision import model_precision
from ..runtime.rows import EarlyExitResult
from .loader import CheckpointError, Loaded, check_device, load_for_inference
from .plan import Plan, Request

__all__ = [
    "MultiExitRobertaHubInterface",
    "from_pretrained",
    "hub_data_folder",
    "model_folder_bpe_files",
]

logger = logging.getLogger(__name__)

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
    plan: Plan | None = None  # what runs, decided by the loader (``from_pretrained``)
    loaded: Loaded | None = None

    @property
    def dtype(self) -> str:
        """The precision the model runs at (``from_pretrained(..., dtype=...)``); read-only."""
        return self.plan.dtype if self.plan is not None else model_precision(self.model)

    @property
    def backend(self) -> str:
        """What runs the model: ``fairseq`` (torch) or ``onnxruntime``; read-only."""
        return self.plan.backend if self.plan is not None else "fairseq"

    def runner(self, head: str) -> Any:
        """What runs head group ``head`` under the plan: the model, or its ONNX Runtime
        segments (made once per head, as ``acl-fairseq-predict`` makes them)."""
        if self.plan is None or not self.plan.onnxruntime or self.loaded is None:
            return self.model
        runners = self.__dict__.setdefault("_runners", {})
        if head not in runners:
            runners[head] = self.loaded.runner(head)
        return runners[head]

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
        if self.backend == "onnxruntime" and torch.device(device).type != "cpu":
            raise CheckpointError(
                "hub.backend onnxruntime runs on the CPU: keep it there, or load it with "
                "from_pretrained(..., backend='fairseq')"
            )
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

    def _batch(self, tokens: Tensor | Sequence[int]) -> Tensor:
        """1D (T) or 2D (B x T) fairseq ids (a tensor, or a list of ids) -> B x T on the
        model's device; ``AclValueError`` naming the fix for no ids or something else."""
        if not isinstance(tokens, Tensor):
            try:
                tokens = torch.as_tensor(tokens)  # its own dtype: 5.5 is not cut to 5
            except (TypeError, ValueError, RuntimeError):
                raise AclValueError(
                    f"tokens must be fairseq ids, a T or B x T tensor (hub.encode(text) makes "
                    f"one), not {type(tokens).__name__}"
                ) from None
        if tokens.numel() == 0:
            raise AclValueError(
                f"tokens is empty (shape {tuple(tokens.shape)}): nothing to predict; encode a "
                "text first (hub.encode(text)), which gives at least <s> and </s>"
            )
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2:
            raise AclValueError(f"tokens must be T or B x T, got shape {tuple(tokens.shape)}")
        if tokens.size(-1) > self.model.max_positions():
            raise ValueError(
                f"tokens exceeds maximum length: {tokens.size(-1)} > {self.model.max_positions()}"
            )
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise AclValueError(
                f"tokens must be whole-number fairseq ids (torch.long), not {tokens.dtype}: "
                "hub.encode(text) makes them"
            )
        size = len(self.task.source_dictionary)
        outside = tokens[(tokens < 0) | (tokens >= size)]
        if outside.numel():
            raise AclValueError(
                f"tokens holds id {int(outside[0])}, outside the dictionary's 0..{size - 1}: "
                "these are not this model's ids; hub.encode(text) makes them"
            )
        return tokens.long().to(device=self.device)

    def predict(self, head: str, tokens: Tensor, return_logits: bool = False) -> Tensor:
        """As ``RobertaHubInterface.predict`` (final exit), with the padding mask passed to the
        head so that ``--exit-pooling mean`` ignores padding in a padded batch."""
        logits = self.runner(head)(self._batch(tokens), classification_head_name=head)[0]
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
            runner = self.runner(head)
            result = runner.early_exit(tokens, as_policy(policy), classification_head_name=head)
        if self.label_names is None:
            return result
        return result._replace(labels=[self.label_names[int(p)] for p in result.predictions])

    def exit_logits(self, head: str, tokens: Tensor) -> dict[int, Tensor]:
        """Logits of every exit, ``{layer: B x K}`` ordered by layer (last = final head)."""
        tokens = self._batch(tokens)
        with utils.model_eval(self.model), torch.no_grad():
            outputs = self.runner(head).exit_outputs(tokens, classification_head_name=head)
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


def from_pretrained(
    model_name_or_path: str,
    checkpoint_file: str = "model.pt",
    data_name_or_path: str = ".",
    bpe: str | None = "recorded",
    dtype: str | None = None,
    backend: str | None = None,
    policy: str | None = None,
    **kwargs: Any,
) -> MultiExitRobertaHubInterface:
    """Load a multi-exit checkpoint (trained with a ``multi_exit_roberta*`` arch).

    ``data_name_or_path``: the prepared data folder; a relative path is taken from the
    current directory, else from ``model_name_or_path`` (fairseq's convention); the
    default ``"."`` without a prepared folder there is the folder the checkpoint was
    trained on. ``bpe="recorded"`` (the default): a data folder written by
    ``acl-fairseq-prepare`` (``prepare_glue.json``) gives its tokenizer, so
    ``hub.encode(text)`` (``text_a, text_b`` for pairs) encodes as the training data
    (``acl_fairseq.data.text_encoder``); other folders get fairseq's ``gpt2``. Any other
    value goes to fairseq, as do ``kwargs`` (config overrides). The folder is checked
    against the data the checkpoint recorded at training (labels, pairs, text encoding:
    ``acl_fairseq.checkpoint.training_data``, a ``ValueError`` naming both);
    ``hub.label_names`` names the classes. An ``early_exit_policy.json`` next to the
    checkpoint (``acl-fairseq-sweep --max-accuracy-drop D``) becomes the hub's
    ``default_policy`` when it was chosen on this checkpoint's weights (else full depth,
    with a warning saying why). ``dtype`` (``fp32``, ``bf16``, ``int8``; default: that
    file's, else fp32) is the precision the model runs at (``runtime.precision``;
    ``hub.dtype``, read-only), and the saved policy is the one chosen at it; ``backend``
    (``fairseq`` or ``onnxruntime``; default: the one that policy was chosen on) what runs
    it (``hub.backend``); ``policy`` (as ``acl-fairseq-predict --policy``: ``saved``,
    ``none`` or a policy) the default policy. What runs is decided as for
    ``acl-fairseq-predict`` on the same flags (``inference.plan``: ``hub.plan``), by
    ``acl_fairseq.inference.loader.load_for_inference``.
    """
    folder = Path(model_name_or_path)
    if not folder.is_dir():
        raise CheckpointError(
            f"model_name_or_path {model_name_or_path}: no such folder (the folder that "
            f"holds {checkpoint_file})"
        )
    overrides = {"load_checkpoint_heads": True, **model_folder_bpe_files(folder), **kwargs}
    loaded = load_for_inference(
        folder / checkpoint_file,
        hub_data_folder(data_name_or_path, folder),
        "cpu",
        label_order=False,
        request=Request(backend, dtype, policy),
        text="optional" if bpe == "recorded" else None,
        arg_overrides=overrides,
        data_flag="data_name_or_path",
        dtype_flag="dtype",
    )
    model = loaded.model
    if not isinstance(model, MultiExitRobertaModel):
        raise TypeError(
            f"{loaded.checkpoint} holds a {type(model).__name__}, not a multi_exit_roberta model"
        )
    if bpe == "recorded":
        bpe = None if loaded.text is not None else "gpt2"
    from fairseq.dataclass.utils import overwrite_args_by_name

    overwrite_args_by_name(loaded.cfg, {**overrides, "bpe": bpe})
    hub = MultiExitRobertaHubInterface(loaded.cfg, loaded.task, model)
    for note in loaded.notes:
        logger.warning(note)
    hub.label_names = loaded.labels
    hub.num_inputs = loaded.num_inputs
    if loaded.text is not None:
        hub.bpe = loaded.text
        hub.example_encoder = loaded.examples
    hub.plan, hub.loaded, hub.default_policy = loaded.plan, loaded, loaded.plan.policy
    if loaded.saved_note and loaded.plan.policy is None:
        logger.warning(f"early exit: full depth by default, not the saved policy: "
                       f"{loaded.saved_note}")  # fmt: skip
    else:
        logger.info(f"early exit: {loaded.plan.why} at {loaded.plan.dtype} on {hub.backend}")
    return hub
