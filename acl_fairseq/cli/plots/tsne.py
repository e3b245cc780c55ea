"""The features behind the t-SNE plot of ``acl-fairseq-plots``: a checkpoint's pooled
features and label embeddings on a split, and their joint 2-D embedding."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from acl_fairseq.checkpoint.inference import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD


def pooled_features(checkpoint: Path, data: Path, split: str = "test", batch_size: int = 64):
    """``(features N x C, targets N, ids N, label embeddings K x C, label names, predictions)``.

    The pooled feature is the input of the final classification head's ``out_proj``
    (captured with a forward pre-hook); the label embeddings are ``out_proj.weight``.
    """
    import torch
    from fairseq import utils

    logging.getLogger("fairseq").setLevel(logging.WARNING)

    model, task, _ = load_for_inference(checkpoint, data)
    head_name = getattr(task.cfg, "classification_head_name", None) or DEFAULT_HEAD
    head = model.classification_heads[head_name]
    task.load_dataset(split)
    itr = task.get_batch_iterator(
        dataset=task.dataset(split),
        max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True,
        seed=1,
        num_workers=0,
    ).next_epoch_itr(shuffle=False)
    captured: list[torch.Tensor] = []
    handle = head.out_proj.register_forward_pre_hook(
        lambda _m, args: captured.append(args[0].detach())
    )
    feats, targets, ids, preds = [], [], [], []
    try:
        with torch.no_grad():
            for sample in itr:
                captured.clear()
                logits, _ = model(
                    **sample["net_input"], features_only=True, classification_head_name=head_name
                )
                feats.append(captured[-1].float())
                targets.append(sample["target"].view(-1))
                ids.append(sample["id"])
                preds.append(logits.argmax(dim=-1))
    finally:
        handle.remove()
    order = torch.cat(ids).argsort()
    labels = head.out_proj.weight.detach().float()
    d = task.label_dictionary
    names = [d[i + d.nspecial] for i in range(labels.size(0))]
    return (
        torch.cat(feats)[order].numpy(),
        torch.cat(targets)[order].numpy(),
        torch.cat(ids)[order].numpy(),
        labels.numpy(),
        names,
        torch.cat(preds)[order].numpy(),
    )


def _normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def tsne_embed(features: np.ndarray, labels: np.ndarray, seed: int = 0) -> np.ndarray:
    """2-D t-SNE of the normalised samples and label embeddings together (samples first)."""
    from sklearn.manifold import TSNE

    x = np.concatenate([_normalise(features), _normalise(labels)])
    perplexity = float(min(30.0, max(2.0, (len(x) - 1) / 3.0)))
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed)
    return tsne.fit_transform(x)
