"""Inference speed of the multi-exit model: full depth vs Hugging Face BERT, and early exit.

1. Same weights, two implementations: a MiniLM-L6-sized ``BertForSequenceClassification``
   (random weights, or ``--hf-dir`` for real ones) is converted with
   ``acl-fairseq-convert-bert`` (pooler dense -> head dense, classifier -> head out_proj) and
   loaded into a ``multi_exit_roberta`` with the same dimensions. The final exit's logits are
   checked against Hugging Face's (LayerNorm eps set to BERT's), then the throughput
   (examples/s) of the full-depth forward is compared (goal: ratio >= 1.0).
2. Early exit at batch 32: the wall-clock speed-up of ``early_exit`` over the full-depth
   forward, against the layer-count ideal ``num_layers / mean exit layer`` (goal: >= 85%).
   With random weights accuracy means nothing, so entropy thresholds are picked to give mean
   exit layers of about 2, 3 and 4 (of 6) on the benchmark batch; with ``--checkpoint CKPT
   --data DATA`` (a trained multi-exit model) the threshold with the largest layer-count
   speed-up whose accuracy on the split is at most 1 point below the full model's is used.
   When the loop falls short of 85% of the ideal, a breakdown of where the time goes is printed.
3. The loop's own cost at batch 1 and batch 32 (as ``early_exit_overhead.py``): the full-depth
   overhead (no row leaves; goal <= 3%) and the fraction of the ideal at the thresholds of
   part 2 (goals >= 90% at batch 1, >= 95% at batch 32). ``--single-rows N`` batch-1 examples.

Everything runs in one process, eval mode, ``torch.no_grad``, the same thread count, with
interleaved rounds (medians)::

    python -m benchmarks.inference_speed                 # random MiniLM-L6-sized weights
    python -m benchmarks.inference_speed --hf-dir HF_BERT_DIR --threads 4
    python -m benchmarks.inference_speed --checkpoint CKPT --data DATA-BIN
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.data.splits import load_batches
from acl_fairseq.early_exit.policies import EntropyPolicy
from acl_fairseq.early_exit.thresholds import collect_exits, simulate_exits
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.inference.measure import Batch, sweep
from acl_fairseq.models.heads import DEFAULT_HEAD as HEAD
from benchmarks.common import (
    GOAL_FRACTION,
    GOAL_FRACTION_BATCHED,
    GOAL_OVERHEAD,
    build_fairseq_model,
    build_hf_model,
    entropy_candidates,
    entropy_for_mean_exit,
    machine_description,
    random_bert_batch,
    single_rows,
    stagger_exit_heads,
)

GOAL_THROUGHPUT_RATIO = 1.0
GOAL_FRACTION_AT_B = 0.85  # part 2: batch B, thresholds of mean exit layers 2, 3, 4
NEVER, NOBODY_LEAVES = 0.0, 1e-30  # part 3: entropy:0 never exits; 1e-30 is evaluated


# ----------------------------------------------------------------------------- machine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(
    jobs: dict[str, Callable[[], Any]], rounds: int, device: torch.device, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of every job: ``warmup`` untimed calls, then ``rounds`` rounds in
    alternating order."""
    names = list(jobs)
    for _ in range(warmup):
        for name in names:
            jobs[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            _sync(device)
            start = time.perf_counter()
            jobs[name]()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return times


# ----------------------------------------------------------------------------- part 1


def compare_logits(hf_model: Any, fs_model: Any, ids: Tensor, mask: Tensor, fs_ids: Tensor):
    """Max |HF - fairseq| of the final logits, and of ``early_exit`` never exiting."""
    with torch.no_grad():
        hf = hf_model(input_ids=ids, attention_mask=mask).logits
        fs = fs_model(fs_ids, classification_head_name=HEAD)[0]
        never = fs_model.early_exit(fs_ids, EntropyPolicy(0.0), classification_head_name=HEAD)
    return float((hf - fs).abs().max()), float((never.logits - fs).abs().max())


def throughput(
    hf_model: Any, fs_model: Any, ids: Tensor, mask: Tensor, fs_ids: Tensor, rounds: int
) -> dict[str, float]:
    """Median examples/s of both full-depth forwards and their per-round ratio."""
    device = ids.device
    jobs = {
        "hf": lambda: hf_model(input_ids=ids, attention_mask=mask).logits,
        "fairseq": lambda: fs_model(fs_ids, classification_head_name=HEAD)[0],
    }
    with torch.no_grad():
        times = interleaved_times(jobs, rounds, device)
    n = ids.size(0)
    return {
        "hf": n / statistics.median(times["hf"]),
        "fairseq": n / statistics.median(times["fairseq"]),
        "ratio": statistics.median(h / f for h, f in zip(times["hf"], times["fairseq"])),
    }


# ----------------------------------------------------------------------------- part 2 and 3


def entropy_within_accuracy(
    logits: list[tuple[int, Tensor]], targets: Tensor, max_drop: float = 1.0
) -> float:
    """The entropy threshold with the lowest mean exit layer whose accuracy (%) is at most
    ``max_drop`` points below the final exit's."""
    full_acc = 100.0 * float(logits[-1][1].argmax(-1).eq(targets).float().mean())
    candidates = entropy_candidates(logits)
    best, best_layer = 0.0, float(logits[-1][0])
    for threshold in candidates:
        layers, preds = simulate_exits(logits, EntropyPolicy(threshold))
        acc = 100.0 * float(preds.eq(targets).float().mean())
        mean_layer = float(layers.float().mean())
        if acc >= full_acc - max_drop and mean_layer < best_layer:
            best, best_layer = threshold, mean_layer
    return best


def loop_cost(
    model: Any,
    batches_by_size: dict[int, Sequence[Batch]],
    thresholds: Sequence[float],
    head: str,
    rounds: int,
) -> list[str]:
    """Markdown lines: full-depth overhead and fraction of ideal per batch size."""
    lines = [
        "| batch | policy | mean exit layer | layer-count speed-up | wall-clock speed-up | "
        "overhead / fraction of ideal | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    grid = [NEVER, NOBODY_LEAVES, *thresholds]
    for size, batches in batches_by_size.items():
        with torch.inference_mode():
            rows = sweep(model, batches, [EntropyPolicy(t) for t in grid], head, rounds, size)
        for row in rows[1:]:
            t = row["threshold"]
            if t in (NEVER, NOBODY_LEAVES):
                overhead = 1.0 / row["wall_speedup"] - 1.0
                verdict = "met" if overhead <= GOAL_OVERHEAD else "NOT met"
                name = "entropy:0 (never exits)" if t == NEVER else "entropy:1e-30 (nobody leaves)"
                value = f"overhead {100 * overhead:+.1f}%"
                goal = f"<= {100 * GOAL_OVERHEAD:.0f}%: {verdict}"
            else:
                goal_fraction = GOAL_FRACTION.get(size, GOAL_FRACTION_BATCHED)
                fraction = row["fraction_of_ideal"]
                verdict = "met" if fraction >= goal_fraction else "NOT met"
                name, value = f"entropy:{t:.4g}", f"{100 * fraction:.0f}% of ideal"
                goal = f">= {100 * goal_fraction:.0f}%: {verdict}"
            lines.append(
                f"| {size} | {name} | {row['mean_exit_layer']:.2f} | {row['layer_speedup']:.2f} "
                f"| {row['wall_speedup']:.3f} | {value} | {goal} |"
            )
    return lines


def time_breakdown(model: Any, tokens: Tensor, threshold: float, rounds: int) -> list[str]:
    """Where ``early_exit`` spends its time: encoder layers, exit heads (their dense and
    out_proj layers), the rest (embedding, policy, row removal, Python), from forward hooks;
    how the per-row cost of a layer grows when fewer rows run; and the top operators of a
    profile."""
    device = tokens.device
    spent = {"layers": 0.0, "heads": 0.0}
    starts: dict[int, float] = {}
    rows_of: dict[int, int] = {}
    layer_calls: list[tuple[int, float]] = []  # (rows, seconds) of every layer call

    def pre(module: torch.nn.Module, inputs: Any) -> None:
        _sync(device)
        rows_of[id(module)] = int(inputs[0].size(1)) if inputs else 0
        starts[id(module)] = time.perf_counter()

    def post(kind: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
            _sync(device)
            seconds = time.perf_counter() - starts[id(module)]
            spent[kind] += seconds
            if kind == "layers":
                layer_calls.append((rows_of[id(module)], seconds))

        return hook

    handles = []
    for layer in model.encoder.sentence_encoder.layers:
        handles += [
            layer.register_forward_pre_hook(pre),
            layer.register_forward_hook(post("layers")),
        ]
    for _, head in model.exit_heads(HEAD):  # the loop calls pool + classify, not forward
        for part in (head.dense, head.out_proj):
            handles += [
                part.register_forward_pre_hook(pre),
                part.register_forward_hook(post("heads")),
            ]
    policy = EntropyPolicy(threshold)
    lines = []
    try:
        with torch.no_grad():
            result = model.early_exit(tokens, policy, classification_head_name=HEAD)  # warm-up
            layer_calls.clear()
            totals = {"early_exit": 0.0, "full": 0.0}
            layer_full = layers_s = heads_s = 0.0
            for _ in range(rounds):
                spent.update(layers=0.0, heads=0.0)
                _sync(device)
                start = time.perf_counter()
                model(tokens, classification_head_name=HEAD)
                _sync(device)
                totals["full"] += time.perf_counter() - start
                layer_full += spent["layers"]
                spent.update(layers=0.0, heads=0.0)
                start = time.perf_counter()
                model.early_exit(tokens, policy, classification_head_name=HEAD)
                _sync(device)
                totals["early_exit"] += time.perf_counter() - start
                layers_s += spent["layers"]
                heads_s += spent["heads"]
    finally:
        for handle in handles:
            handle.remove()
    total = totals["early_exit"]
    mean_exit = float(result.exit_layers.float().mean())
    ideal_layers = layer_full * mean_exit / model.num_layers  # layer time if cost ~ rows
    by_rows: dict[int, list[float]] = {}
    for rows, seconds in layer_calls:
        by_rows.setdefault(rows, []).append(1000 * seconds / max(rows, 1))
    per_row = ", ".join(
        f"{rows} rows {statistics.median(v):.2f}" for rows, v in sorted(by_rows.items())[::-1]
    )
    rest = total - layers_s - heads_s
    full_rest = totals["full"] - layer_full
    lines.append(
        f"early_exit {1000 * total / rounds:.1f} ms/batch (hooks add a sync per module): "
        f"encoder layers {100 * layers_s / total:.1f}%, exit heads {100 * heads_s / total:.1f}%, "
        f"rest (embedding, policy, row removal, Python) {100 * rest / total:.1f}%"
    )
    lines.append(
        f"full forward {1000 * totals['full'] / rounds:.1f} ms/batch: encoder layers "
        f"{100 * layer_full / totals['full']:.1f}%, rest {100 * full_rest / totals['full']:.1f}%"
    )
    lines.append(
        f"encoder layers in early_exit took {layers_s / ideal_layers:.2f}x what the rows they ran "
        f"cost in the full forward (1.00 = per-row cost independent of the row count); "
        f"ms per row and layer call: {per_row}"
    )
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        model.early_exit(tokens, policy, classification_head_name=HEAD)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    profiled = sum(e.self_cpu_time_total for e in events) or 1.0
    top = ", ".join(f"{e.key} {100 * e.self_cpu_time_total / profiled:.1f}%" for e in events[:8])
    lines.append(f"top operators by self CPU time (one early_exit call): {top}")
    return lines


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf-dir", help="Hugging Face BERT dir with real weights (default: random)")
    p.add_argument("--checkpoint", help="trained multi-exit checkpoint for the early-exit part")
    p.add_argument("--data", help="binarized data dir of --checkpoint")
    p.add_argument("--split", default="valid", help="split of --data to choose the threshold on")
    p.add_argument("--max-examples", type=int, help="cap the split")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: unchanged)")
    p.add_argument("--cpu", action="store_true", help="CPU even if CUDA is available")
    p.add_argument("--profile", action="store_true", help="always print the time breakdown")
    p.add_argument(
        "--skip-throughput", action="store_true", help="skip the HF throughput comparison"
    )
    p.add_argument("--single-rows", type=int, default=32, help="batch-1 examples in part 3")
    return p


def _fmt_row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if bool(args.checkpoint) != bool(args.data):
        raise SystemExit("--checkpoint and --data go together")
    logging.getLogger("convert_hf_bert").setLevel(logging.ERROR)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    print(f"# inference speed\n\n{machine_description(device)}\n")

    # ---- part 1: full depth, fairseq multi-exit vs Hugging Face on the same weights
    hf_model, vocab, special_tokens = build_hf_model(args.hf_dir, args.classes)
    with tempfile.TemporaryDirectory() as tmp:
        fs_model, _, bert_to_fairseq = build_fairseq_model(
            hf_model, vocab, special_tokens, Path(tmp), args.classes
        )
    hf_model.to(device)
    fs_model.to(device)
    to_fs = torch.tensor(bert_to_fairseq)
    ids, mask = random_bert_batch(vocab, args.batch, args.length, seed=1, min_length=8)
    logit_diff, never_diff = compare_logits(
        hf_model, fs_model, ids.to(device), mask.to(device), to_fs[ids].to(device)
    )
    ok = logit_diff < 1e-2 and never_diff < 1e-4
    source = args.hf_dir or "random MiniLM-L6-sized BERT (6 x 384, 12 heads, ffn 1536)"
    print("## 1. Full depth: multi_exit_roberta vs transformers BertForSequenceClassification\n")
    print(f"weights: {source}; batch {args.batch} x {args.length} tokens")
    print(
        f"logit check (padded batch, lengths 8..{args.length}): max |HF - fairseq| = "
        f"{logit_diff:.2e}, max |early_exit(never) - forward| = {never_diff:.2e} -> "
        f"{'OK' if ok else 'MISMATCH'}\n"
    )
    if not ok:
        raise SystemExit("the two implementations disagree: the throughput comparison is void")

    ids, mask = random_bert_batch(vocab, args.batch, args.length, seed=2)
    ids, mask, fs_ids = ids.to(device), mask.to(device), to_fs[ids].to(device)
    if not args.skip_throughput:
        tp = throughput(hf_model, fs_model, ids, mask, fs_ids, args.rounds)
        print(_fmt_row(["model", "examples/s", "ratio to HF"]))
        print("|---|---|---|")
        print(_fmt_row(["transformers BertForSequenceClassification", f"{tp['hf']:.1f}", "1.00"]))
        print(
            _fmt_row(
                ["multi_exit_roberta, full depth", f"{tp['fairseq']:.1f}", f"{tp['ratio']:.2f}"]
            )
        )
        verdict = "met" if tp["ratio"] >= GOAL_THROUGHPUT_RATIO else "NOT met"
        print(f"\ngoal ratio >= {GOAL_THROUGHPUT_RATIO:.2f}: {verdict}\n")
    del hf_model

    # ---- part 2: early exit at batch 32
    print(f"## 2. Early exit (entropy policy), batch {args.batch}\n")
    if args.checkpoint:
        loaded = load_for_inference(args.checkpoint, args.data, device, multi_exit=True)
        model, task = loaded.model, loaded.task
        batches = load_batches(task, args.split, args.batch, args.max_examples, device)
        logits, targets = collect_exits(model, batches, HEAD)
        chosen = entropy_within_accuracy(logits, targets, max_drop=1.0)
        print(
            f"model: {args.checkpoint}; split {args.split} ({targets.numel()} examples); "
            f"threshold chosen on this split: largest layer-count speed-up with accuracy at "
            f"most 1 point below the full model\n"
        )
        thresholds = [chosen]
        for target_layer in (2.0, 3.0, 4.0):
            thresholds.append(entropy_for_mean_exit(logits, target_layer))
    else:
        model = fs_model
        calibration, _ = random_bert_batch(vocab, args.batch, args.length, seed=3)
        stagger_exit_heads(model, to_fs[calibration].to(device))
        tokens = fs_ids
        batches = [(tokens, torch.zeros(tokens.size(0), dtype=torch.long, device=device))]
        logits, _ = collect_exits(model, batches, HEAD)
        print(
            "random weights: accuracy is meaningless; entropy thresholds chosen for mean exit "
            f"layers ~2, 3, 4 of {model.num_layers} on the benchmark batch\n"
        )
        thresholds = [entropy_for_mean_exit(logits, t) for t in (2.0, 3.0, 4.0)]
    thresholds = list(dict.fromkeys(thresholds))
    rows = sweep(
        model, batches, [EntropyPolicy(t) for t in thresholds], HEAD, args.rounds, args.batch
    )
    show_acc = bool(args.checkpoint)
    header = ["threshold", "mean exit layer", "exit share by layer"]
    header += ["accuracy %"] if show_acc else []
    header += ["layer-count speed-up", "wall-clock speed-up", "fraction of ideal", "ms/batch"]
    print(_fmt_row(header))
    print("|" + "---|" * len(header))
    n_batches = len(batches)
    for row in rows:
        share = " ".join(f"{k}:{v:.2f}" for k, v in sorted(row["exit_share"].items()))
        cells = [
            "full model" if row["threshold"] is None else f"{row['threshold']:.4g}",
            f"{row['mean_exit_layer']:.2f}",
            share,
        ]
        cells += [f"{row['accuracy']:.2f}"] if show_acc else []
        ms = row["early_ms"] * row["examples"] / n_batches
        cells += [
            f"{row['layer_speedup']:.2f}",
            f"{row['wall_speedup']:.2f}",
            f"{100 * row['fraction_of_ideal']:.0f}%",
            f"{ms:.1f}",
        ]
        print(_fmt_row(cells))
    early_rows = rows[1:]
    worst = min(early_rows, key=lambda r: r["fraction_of_ideal"])
    verdict = "met" if worst["fraction_of_ideal"] >= GOAL_FRACTION_AT_B else "NOT met"
    print(
        f"\ngoal fraction of ideal >= {100 * GOAL_FRACTION_AT_B:.0f}%: {verdict} "
        f"(lowest: {100 * worst['fraction_of_ideal']:.0f}% at threshold {worst['threshold']:.4g})"
    )
    if worst["fraction_of_ideal"] < GOAL_FRACTION_AT_B or args.profile:
        print("\n### Where the time goes (threshold of the lowest fraction)\n")
        for line in time_breakdown(model, batches[0][0], worst["threshold"], args.rounds):
            print(f"- {line}")

    # ---- part 3: the loop's own cost, batch 1 and batch B
    print(f"\n## 3. Cost of the early-exit loop, batch 1 and batch {args.batch}\n")
    pad = model.encoder.sentence_encoder.padding_idx
    by_size = {1: single_rows(batches, pad, args.single_rows), args.batch: batches}
    for line in loop_cost(model, by_size, thresholds, HEAD, args.rounds):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
