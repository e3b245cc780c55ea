"""Whether a checkpoint fits the model (and the data's dictionary): a clear error naming the
flag before torch's shape mismatch. Used by ``--task acl_sentence_prediction`` when it loads a
state dict (``--restore-file``, ``--finetune-from-model``, ``--path``)."""

import contextlib
import contextvars
import re

import torch

from ..errors import AclValueError

__all__ = ["CheckpointMismatch", "check_checkpoint_fits", "load_state_dict_checked", "loading_as"]

_CHECKPOINT = "cannot load the checkpoint (--restore-file, --finetune-from-model or --path)"
_VOCAB_FIX = (
    "The data was binarized with another dictionary than the checkpoint's: binarize it again "
    "with fairseq-preprocess --srcdict <the checkpoint's dict.txt>"
)
# (what is loaded, the fix of another vocabulary): training's flags unless loading_as says
_LOADING = contextvars.ContextVar("acl_fairseq_fits_loading", default=(_CHECKPOINT, _VOCAB_FIX))


@contextlib.contextmanager
def loading_as(what: str, vocabulary_fix: str):
    """Within the block, a checkpoint that does not fit is named as ``what`` (e.g. ``cannot
    use CKPT with --data DATA``), and another vocabulary's fix is ``vocabulary_fix``."""
    token = _LOADING.set((what, vocabulary_fix))
    try:
        yield
    finally:
        _LOADING.reset(token)


_EMBED = "encoder.sentence_encoder.embed_tokens.weight"
_LAYER = re.compile(r"encoder\.sentence_encoder\.layers\.(\d+)\.")


class CheckpointMismatch(AclValueError):
    """A checkpoint of another vocabulary or architecture than the model built."""


def load_state_dict_checked(model, state_dict, *args, **kwargs):
    strict = kwargs.get("strict", args[0] if args else True)
    data = getattr(getattr(model, "args", None), "data", "DATA")
    check_checkpoint_fits(state_dict, model.state_dict(), data, strict=strict)
    return type(model).load_state_dict(model, state_dict, *args, **kwargs)


def _num_layers(keys) -> int:
    found = [int(m.group(1)) for k in keys if (m := _LAYER.match(k))]
    return max(found) + 1 if found else 0


def check_checkpoint_fits(state_dict, model_state, data: str, strict: bool = True) -> None:
    """Raises a ``CheckpointMismatch`` naming the flag when a RoBERTa-style checkpoint does
    not fit: only what torch would reject anyway (vocabulary, embedding size, layer count,
    a shape); heads are left to RoBERTa's upgrade."""

    def body(state):
        out = {}
        for k, v in state.items():
            k = "encoder." + k[len("decoder.") :] if k.startswith("decoder.") else k
            if torch.is_tensor(v) and not k.startswith("classification_heads."):
                out[k] = v
        return out

    what, vocabulary_fix = _LOADING.get()
    ckpt, own = body(state_dict), body(model_state)
    if _EMBED in ckpt and _EMBED in own and ckpt[_EMBED].shape != own[_EMBED].shape:
        (cv, cd), (mv, md) = ckpt[_EMBED].shape, own[_EMBED].shape
        if cd != md:
            raise CheckpointMismatch(
                f"{what}: its embeddings have {cd} dimensions, this model's {md} "
                "(--encoder-embed-dim / --arch must match the checkpoint's)"
            )
        raise CheckpointMismatch(
            f"{what}: its vocabulary has {cv} entries, this model's {mv} (from "
            f"{data}/input0/dict.txt). {vocabulary_fix}"
        )
    layers_ckpt, layers_own = _num_layers(ckpt), _num_layers(own)
    if strict and layers_ckpt and layers_own and layers_ckpt != layers_own:
        raise CheckpointMismatch(
            f"{what}: it has {layers_ckpt} encoder layers, this model {layers_own} "
            "(--encoder-layers / --arch must match the checkpoint's)"
        )
    for k, v in own.items():
        if k in ckpt and ckpt[k].shape != v.shape:
            hint = "--arch and the --encoder-* sizes must match the checkpoint's"
            if k.endswith("embed_positions.weight"):
                # learned positions: max_positions + padding_idx + 1 rows
                hint = f"--max-positions: {ckpt[k].shape[0] - 2} in the checkpoint"
            raise CheckpointMismatch(
                f"{what}: {k} is {tuple(ckpt[k].shape)} in the checkpoint but "
                f"{tuple(v.shape)} in this model ({hint})"
            )
