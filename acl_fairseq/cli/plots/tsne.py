"""The t-SNE plot of ``acl-fairseq-plots`` (d): a checkpoint's pooled features and label
embeddings on a split, their joint 2-D embedding, CE next to ACL."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from acl_fairseq.cli.plots.figures import Skipped, main_runs, plt, save_plot
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD


def pooled_features(checkpoint: Path, data: Path, split: str = "test", batch_size: int = 64):
    """``(features N x C, targets N, ids N, label embeddings K x C, label names, predictions)``.

    The pooled feature is the input of the final classification head's ``out_proj``
    (captured with a forward pre-hook); the label embeddings are ``out_proj.weight``.
    """
    import torch
    from fairseq import utils

    logging.getLogger("fairseq").setLevel(logging.WARNING)

    loaded = load_for_inference(checkpoint, data)
    model, task = loaded.model, loaded.task
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


TSNE_METHODS = (("ce", "CE"), ("acl", "ACL (ACL-Embed + ACL-Grad)"))


def plot_tsne(
    results_dir: Path,
    out_dir: Path,
    data: Path | None,
    seed: int | None = None,
    split: str = "test",
    max_examples: int = 2000,
):
    """(d) t-SNE of the test split's pooled features with the label embeddings, CE vs ACL."""
    if data is None:
        raise Skipped("needs --data (the binarized dataset the runs were trained on)")
    seeds = None
    for method, _ in TSNE_METHODS:
        have = {
            int(d.name.rsplit("seed", 1)[1])
            for d in main_runs(results_dir, method)
            if (d / "checkpoint_best.pt").exists()
        }
        seeds = have if seeds is None else seeds & have
    if seed is None:
        if not seeds:
            raise Skipped("no seed with both runs/ce-seed<k> and runs/acl-seed<k> checkpoints")
        seed = min(seeds)
    elif seed not in (seeds or set()):
        raise Skipped(f"runs/ce-seed{seed} or runs/acl-seed{seed} has no checkpoint_best.pt")
    fig, axes = plt.subplots(1, len(TSNE_METHODS), figsize=(6 * len(TSNE_METHODS), 5.4))
    csv_rows = []
    rng = np.random.default_rng(0)
    keep = None
    for ax, (method, title) in zip(np.atleast_1d(axes), TSNE_METHODS):
        run = f"{method}-seed{seed}"
        checkpoint = results_dir / "runs" / run / "checkpoint_best.pt"
        feats, targets, ids, labels, names, preds = pooled_features(checkpoint, data, split)
        if keep is None:  # the same examples for every model
            n = len(ids)
            keep = np.arange(n)
            if n > max_examples:
                keep = np.sort(rng.choice(n, size=max_examples, replace=False))
        feats, targets, ids, preds = feats[keep], targets[keep], ids[keep], preds[keep]
        xy = tsne_embed(feats, labels)
        samples, label_xy = xy[: len(feats)], xy[len(feats) :]
        accuracy = 100.0 * float(np.mean(preds == targets))
        for k, name in enumerate(names):
            color = f"C{k % 10}"
            mask = targets == k
            ax.scatter(samples[mask, 0], samples[mask, 1], s=6, alpha=0.5, color=color, label=name)
            ax.scatter(
                label_xy[k, 0],
                label_xy[k, 1],
                s=380,
                marker="*",
                color=color,
                edgecolors="black",
                linewidths=1.2,
                label=f"{name} (label embedding)",
                zorder=5,
            )
        ax.set_title(f"{title}\n{run}, {split} ({len(feats)} examples, acc {accuracy:.1f}%)")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.legend(fontsize=7, loc="best", markerscale=0.6)
        for i in range(len(feats)):
            x, y = float(samples[i, 0]), float(samples[i, 1])
            label, pred = names[int(targets[i])], names[int(preds[i])]
            csv_rows.append([method, run, "sample", int(ids[i]), label, pred, x, y])
        for k, name in enumerate(names):
            x, y = float(label_xy[k, 0]), float(label_xy[k, 1])
            csv_rows.append([method, run, "label_embedding", k, name, name, x, y])
    fig.suptitle("t-SNE of pooled features (•) and label embeddings (★), L2-normalised")
    header = ["method", "run", "kind", "id", "label", "prediction", "x", "y"]
    return save_plot(fig, out_dir, "tsne", header, csv_rows)
