"""This project's inference against the anchors a user would pick, in one run.

On a multi-exit checkpoint and its data folder, at ``--batch-sizes`` (1, 32) and ``--threads``
(1; one count per run with ONNX Runtime, whose sessions share one thread pool per process),
every system classifies the same ``--test`` sentences:

* **HF fp32**: Hugging Face ``transformers`` ``BertModel`` (its default attention, SDPA; or
  ``--hf-attention eager``) carrying *the checkpoint's own fine-tuned weights* (mapped back
  from fairseq by ``acl-fairseq-export-hf``'s mapping, ``acl_fairseq.hf_bert``: word and
  position embeddings, every layer, the embedding LayerNorm; LayerNorm eps as trained) and the
  checkpoint's final head (same pooling, mean too, which a stock BERT head cannot express).
  Its logits are checked against the fairseq model's before anything is timed. The speed-up
  column is relative to it.
* **ORT int8**: that model exported with ``torch.onnx.export`` and quantized with ONNX
  Runtime's ``quantize_dynamic`` (int8 weights per channel), run by ``onnxruntime`` with the
  same thread count (the helpers of ``acl_fairseq.runtime.onnx_runtime``), as ONNX Runtime
  runs it by default and, in a second row, without the fusions this project's int8 sessions
  leave out (``INT8_DISABLED``). Skipped, with the reason, when it is not installed
  (``pip install -e .[bench]``: onnxruntime, onnx, onnxscript; none of them pulls a torch).
* **this project** at ``--dtypes fp32,bf16,int8`` (``acl_fairseq.runtime.precision``), at
  full depth and with the deployable policies *chosen on* ``--dev`` at that precision
  (``acl_fairseq.inference.deploy.choose``: for each of ``--kinds``, the fastest policy
  within ``--max-accuracy-drop`` read per ``--constraint``, as ``acl-fairseq-sweep``
  deploys it), plus any ``--policies`` given as they are.
* **this project on ORT int8**: the same early-exit loop on ONNX Runtime int8 segments of the
  model (``acl_fairseq.runtime.onnx_runtime``, its sessions on the process's thread pool as
  ``acl-fairseq-predict`` runs them), full depth and its own policies chosen on ``--dev`` the
  same way (from its own exits' logits); skipped with ORT int8. The segments are cached in
  ``--ort-cache`` (default: a temporary folder).

Columns: accuracy, agreement with this project's fp32 full-depth predictions, mean exit layer,
milliseconds per sentence (median of ``--rounds`` interleaved rounds over the split, after an
untimed first pass per configuration that also gives the accuracy and the exits) and the
speed-up over HF fp32 (median of the per-round ratios). After each system's full depth, an
``oracle-final`` row: the earliest exit that agrees with the final exit (so full depth's
predictions), at full depth's time x its mean exit layer / L, a bound, not timed. Timings
mean something only on an idle machine; ``--out FILE.md`` / ``FILE.csv`` writes the table,
``--plot FILE.png`` the trade-off figure (``benchmarks/anchors_plot.py``)::

    OMP_NUM_THREADS=2 python -m benchmarks.inference_anchors CKPT DATA --rounds 5 \\
        --threads 2 --out anchors-2.md
    python -m benchmarks.inference_anchors CKPT DATA --max-examples 64 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import copy
import csv
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

import acl_fairseq  # noqa: F401  (registers the plugin)
from acl_fairseq.data.splits import load_batches
from acl_fairseq.early_exit.calibrate import CONSTRAINTS
from acl_fairseq.early_exit.policies import POLICIES, ExitPolicy, parse_policy
from acl_fairseq.early_exit.thresholds import TargetError, collect_exits, oracle_exits
from acl_fairseq.hf_bert.export import bert_config
from acl_fairseq.hf_bert.state import fairseq_state_to_bert
from acl_fairseq.inference import deploy
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.models.heads import DEFAULT_HEAD
from acl_fairseq.runtime.onnx_runtime import (
    INT8_DISABLED,
    OnnxRuntimeMissing,
    OrtEarlyExit,
    export_onnx,
    ort_session,
    quantize_int8,
    require_onnxruntime,
    weight_bits,
)
from acl_fairseq.runtime.precision import check_precision, prepare_for_inference
from benchmarks.anchors_plot import plot as plot_rows
from benchmarks.anchors_plot import with_oracle_rows
from benchmarks.common import checkpoint_parser

HEAD = DEFAULT_HEAD
Run = Callable[[Tensor], tuple[Tensor, Tensor]]  # tokens B x T -> (predictions B, layers B)
FP32_FULL = ("fp32", "full depth")
ORT_PROJECT = "this project on ORT int8"
ORT_UNFUSED = f"ORT int8, without {'/'.join(INT8_DISABLED)}"
COLUMNS = ("batch", "threads", "system", "policy", "accuracy", "agreement", "mean_exit_layer",
           "ms", "speedup")  # fmt: skip
HEADERS = ("batch", "threads", "system", "policy", "accuracy %",
           "agreement with fp32 full depth %", "mean exit layer", "ms / sentence",
           "speed-up over HF fp32")  # fmt: skip


# ----------------------------------------------------------------------------- HF anchor


class HfAnchor(nn.Module):
    """``transformers.BertModel`` with the fairseq model's weights and final head."""

    def __init__(self, fairseq_model: Any, attention: str = "sdpa") -> None:
        super().__init__()
        import transformers

        enc = fairseq_model.encoder.sentence_encoder
        depth = len(enc.layers)
        self.pad = int(enc.padding_idx)
        config = transformers.BertConfig(
            **bert_config(fairseq_model, depth), attn_implementation=attention
        )
        self.bert = transformers.BertModel(config, add_pooling_layer=False).eval()
        state = fairseq_state_to_bert(fairseq_model.state_dict(), depth, padding_idx=self.pad)
        missing, unexpected = self.bert.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if "position_ids" not in k]:
            raise RuntimeError(f"HF anchor: missing {missing}, unexpected {unexpected}")
        self.head = copy.deepcopy(fairseq_model.classification_heads[HEAD])
        self.eval()

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """B x T ids and mask (1 = token) -> B x K logits."""
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden, padding_mask=attention_mask.eq(0))


def hf_runner(anchor: HfAnchor) -> Run:
    depth = len(anchor.bert.encoder.layer)

    def run(tokens: Tensor) -> tuple[Tensor, Tensor]:
        logits = anchor(tokens, tokens.ne(anchor.pad).long())
        return logits.argmax(-1), torch.full((tokens.size(0),), depth)

    return run


# ----------------------------------------------------------------------------- ONNX Runtime


def ort_int8(anchor: HfAnchor, sample: Tensor, work: Path) -> tuple[Path | None, str]:
    """``(quantized model path or None, a line saying what happened)``."""
    try:
        onnxruntime = require_onnxruntime()
    except OnnxRuntimeMissing as e:
        return None, f"ONNX Runtime int8: skipped, not installed ({e})"
    fp32, int8 = work / "model.onnx", work / "model.int8.onnx"
    mask = sample.ne(anchor.pad).long()
    axes = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}}
    names = ["input_ids", "attention_mask"]
    export_onnx(anchor, (sample, mask), fp32, names, ["logits"], {**axes, "logits": {0: "batch"}})
    quantize_int8(fp32, int8)
    bits = weight_bits()
    return int8, (
        f"ONNX Runtime {onnxruntime.__version__}, int8 dynamic quantization (per channel, "
        f"{bits}-bit weights)"
    )


def ort_runner(
    path: Path, threads: int, pad: int, num_layers: int, disabled: Sequence[str] = ()
) -> Run:
    session = ort_session(path, threads, disabled_optimizers=disabled)

    def run(tokens: Tensor) -> tuple[Tensor, Tensor]:
        feeds = {"input_ids": tokens.numpy(), "attention_mask": tokens.ne(pad).long().numpy()}
        logits = torch.from_numpy(session.run(["logits"], feeds)[0])
        return logits.argmax(-1), torch.full((tokens.size(0),), num_layers)

    return run


# ----------------------------------------------------------------------------- this project


def project_runner(model: Any, policy: ExitPolicy | None) -> Run:
    """Full depth (``policy=None``) or the early-exit loop (a per-exit policy evaluates only
    its own exits); ``model``: the fairseq model or an ``OrtEarlyExit`` (the same calls)."""
    depth = int(model.num_layers)
    if policy is None:

        def full(tokens: Tensor) -> tuple[Tensor, Tensor]:
            logits = model(tokens, classification_head_name=HEAD)[0]
            return logits.argmax(-1), torch.full((tokens.size(0),), depth)

        return full

    def early(tokens: Tensor) -> tuple[Tensor, Tensor]:
        result = model.early_exit(tokens, policy, classification_head_name=HEAD)
        return result.predictions, result.exit_layers

    return early


def deployable(
    models: dict[str, Any],
    dev_batches: Sequence[tuple[Tensor, Tensor]],
    kinds: Sequence[str],
    target: deploy.DeployTarget,
    dev: str,
    head_costs: dict[str, float] | None = None,
) -> tuple[dict[str, list[tuple[str, ExitPolicy]]], list[str]]:
    """Per system (a precision, or ``ORT_PROJECT``), ``[(label, policy chosen on dev)]`` for
    each kind, and notes (the choices, and the targets a kind cannot meet); ``head_costs``:
    a system's own ``--head-cost`` in place of the target's."""
    chosen: dict[str, list[tuple[str, ExitPolicy]]] = {}
    notes = []
    for dtype, model in models.items():
        exit_logits, targets = collect_exits(model, dev_batches, HEAD)
        own = (head_costs or {}).get(dtype)
        system_target = target if own is None else replace(target, head_cost=own)
        chosen[dtype] = []
        for kind in kinds:
            try:
                choice = deploy.choose(kind, exit_logits, targets, system_target, split=dev)
            except TargetError as e:
                notes.append(f"{dtype}, {kind}: {e}")
                continue
            chosen[dtype].append((f"{kind} chosen on {dev}", choice.policy))
            notes.append(f"{dtype}, {kind}: `{choice.policy.spec}` ({choice.method} on {dev})")
    return chosen, notes


# ----------------------------------------------------------------------------- measuring


class Config(NamedTuple):
    system: str
    policy: str
    run: Run


def batches_of(task: Any, split: str, size: int, limit: int | None, pad: int):
    """``[(tokens, target)]``; at batch 1 each row without its padding."""
    batches = load_batches(task, split, size if size > 1 else 64, limit)
    if size > 1:
        return batches
    return [
        (row[row.ne(pad)].unsqueeze(0), label.view(1))
        for tokens, target in batches
        for row, label in zip(tokens, target)
    ]


def measure(configs: Sequence[Config], batches, rounds: int) -> list[dict[str, Any]]:
    """One untimed pass per configuration (predictions, exits), then ``rounds`` interleaved
    timed rounds over all batches, order alternating. The first configuration is the speed-up's
    reference (HF fp32)."""
    targets = torch.cat([t for _, t in batches])
    results = []
    with torch.inference_mode():
        for config in configs:
            outs = [config.run(tokens) for tokens, _ in batches]
            preds = torch.cat([p for p, _ in outs])
            layers = torch.cat([layer for _, layer in outs]).double()
            results.append({"preds": preds, "layers": layers, "times": []})
        for r in range(rounds):
            order = range(len(configs)) if r % 2 == 0 else reversed(range(len(configs)))
            for i in order:
                start = time.perf_counter()
                for tokens, _ in batches:
                    configs[i].run(tokens)
                results[i]["times"].append(time.perf_counter() - start)
    n = int(targets.numel())
    fp32 = [r["preds"] for c, r in zip(configs, results) if (c.system, c.policy) == FP32_FULL]
    reference = fp32[0] if fp32 else results[0]["preds"]
    base = results[0]["times"]
    rows = []
    for config, res in zip(configs, results):
        timed = bool(res["times"])
        rows.append(
            {
                "system": config.system,
                "policy": config.policy,
                "accuracy": 100.0 * float(res["preds"].eq(targets).double().mean()),
                "agreement": 100.0 * float(res["preds"].eq(reference).double().mean()),
                "mean_exit_layer": float(res["layers"].mean()),
                "ms": 1000.0 * statistics.median(res["times"]) / n if timed else None,
                "speedup": (
                    statistics.median(b / t for b, t in zip(base, res["times"])) if timed else None
                ),
            }
        )
    return rows


def oracle_layer(system: Any, batches: Sequence[tuple[Tensor, Tensor]]) -> float:
    """Mean exit layer of the earliest exit that agrees with ``system``'s final exit."""
    layers, _ = oracle_exits(collect_exits(system, batches, HEAD)[0])
    return float(layers.double().mean())


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_rows(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines of the table (header included)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(k, r[k]) for k in COLUMNS) + " |")
    return lines


def write_rows(rows: Sequence[dict[str, Any]], path: Path, preamble: Sequence[str]) -> None:
    """The table as CSV (``*.csv``) or Markdown (anything else, with the preamble)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(COLUMNS)
            for r in rows:
                writer.writerow(["" if r[k] is None else r[k] for k in COLUMNS])
        return
    path.write_text("\n".join([*preamble, "", *format_rows(rows)]) + "\n", encoding="utf-8")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def head_costs(text: str) -> tuple[float, dict[str, float]]:
    """``--head-cost`` (``deploy.head_costs``) as ``(default, {system: cost})``: ``ort`` or
    ``onnxruntime`` names this project on ORT int8."""
    costs = deploy.head_costs(text)
    own = {ORT_PROJECT if k == "onnxruntime" else k: v for k, v in costs.own.items()}
    return costs.default, own


def build_parser() -> argparse.ArgumentParser:
    p = checkpoint_parser(
        __doc__, "split the deployable policies are chosen on", "split everything is measured on"
    )
    p.add_argument("--kinds", default="entropy,per_exit_entropy", help="policy kinds to deploy")
    p.add_argument("--max-accuracy-drop", type=float, default=1.0, help="their target (points)")
    p.add_argument("--constraint", choices=CONSTRAINTS, default=CONSTRAINTS[0])
    p.add_argument(
        "--head-cost",
        default="0.03",
        help="an exit head's cost in layers at batch 1 (the sweep's --head-cost): COST, then\n"
        "SYSTEM=COST for one system (fp32, bf16, int8, ort), as benchmarks/exit_cost_batch1.py\n"
        "measures them",
    )
    p.add_argument(
        "--policies", default="", help="more policies, as given, separated by spaces or ';'"
    )
    p.add_argument("--dtypes", default="fp32,bf16,int8")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument(
        "--threads", default="1", help="torch and ONNX Runtime threads (several: --no-ort)"
    )
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (0: no timing)")
    p.add_argument("--max-examples", type=int, help="first N sentences of each split")
    p.add_argument("--hf-attention", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime")
    p.add_argument(
        "--ort-cache", type=Path, help="folder of this project's ONNX segments (default: temporary)"
    )
    p.add_argument("--out", type=Path, help="write the table: Markdown, or CSV for *.csv")
    p.add_argument("--plot", type=Path, help="write the trade-off figure (PNG)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    try:
        extra = [(s, parse_policy(s)) for s in args.policies.replace(";", " ").split() if s]
        dtypes = [check_precision(d) for d in args.dtypes.split(",") if d.strip()]
        threads = _ints(args.threads)
        if len(threads) != 1 and not args.no_ort:
            raise ValueError(
                "--threads: one count per run with ONNX Runtime (its sessions share the "
                "process's thread pool, one size per process): run once per count, or --no-ort"
            )
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in POLICIES]
        if unknown:
            raise ValueError(f"--kinds: unknown {unknown}; kinds: {', '.join(POLICIES)}")
        default_cost, own_costs = head_costs(args.head_cost)
        target = deploy.DeployTarget(
            max_accuracy_drop=args.max_accuracy_drop,
            constraint=args.constraint,
            head_cost=default_cost,
        )
        target.check()
    except ValueError as e:
        p.error(str(e))
    loaded = load_for_inference(
        args.checkpoint, args.data, "cpu", multi_exit=True, fingerprint=not args.no_ort
    )
    model, task = loaded.model, loaded.task
    pad = task.source_dictionary.pad()
    anchor = HfAnchor(model, args.hf_attention)
    check = load_batches(task, args.test, 16, 16)[0][0]
    with torch.no_grad():
        expected = model(check, classification_head_name=HEAD)[0]
        diff = float((anchor(check, check.ne(pad).long()) - expected).abs().max())
    if diff > 1e-3:
        raise SystemExit(f"HF anchor and fairseq model disagree (max |logit diff| {diff:.2e})")
    systems: dict[str, Any] = {d: prepare_for_inference(copy.deepcopy(model), d) for d in dtypes}
    dev_batches = load_batches(task, args.dev, 32, args.max_examples)
    import transformers

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        ort_path, ort_notes = None, []
        if not args.no_ort:
            ort_path, note = ort_int8(anchor, check, Path(tmp))
            ort_notes.append(note)
        ort_cache = args.ort_cache or Path(tmp)
        if ort_path is not None:  # this project's loop on ORT int8 segments of the fp32 model
            on_ort = OrtEarlyExit(
                model, HEAD, ort_cache, "int8", threads[0], loaded.fingerprint, shared_pool=True
            )
            systems[ORT_PROJECT] = on_ort
            ort_notes.append(f"{ORT_PROJECT}: segments in {on_ort.folder}")
        chosen, notes = deployable(systems, dev_batches, kinds, target, args.dev, own_costs)
        test_batches = load_batches(task, args.test, 32, args.max_examples)
        oracle = {name: oracle_layer(system, test_batches) for name, system in systems.items()}
        preamble = [
            f"# inference anchors: {Path(args.checkpoint).name}, measured on {args.test}, "
            f"policies chosen on {args.dev} (--max-accuracy-drop {args.max_accuracy_drop:g}, "
            f"--constraint {args.constraint}, --head-cost {args.head_cost})",
            "",
            f"torch {torch.__version__}, transformers {transformers.__version__}; CPU "
            f"{os.cpu_count()} cores; HF anchor: BertModel ({args.hf_attention}) with the "
            f"checkpoint's weights and final head, max |logit - fairseq| = {diff:.1e}",
            *[f"- {n}" for n in notes],
            *ort_notes,
        ]
        for count in threads:
            torch.set_num_threads(count)
            configs = [Config(f"HF fp32 ({args.hf_attention})", "full depth", hf_runner(anchor))]
            if ort_path is not None:
                ort = ort_runner(ort_path, count, pad, model.num_layers)
                configs.append(Config("ORT int8", "full depth", ort))
                ort = ort_runner(ort_path, count, pad, model.num_layers, INT8_DISABLED)
                configs.append(Config(ORT_UNFUSED, "full depth", ort))
            for name, system in systems.items():
                configs.append(Config(name, "full depth", project_runner(system, None)))
                for label, policy in chosen[name] + extra:
                    configs.append(
                        Config(name, f"{label}: `{policy.spec}`", project_runner(system, policy))
                    )
            for size in _ints(args.batch_sizes):
                batches = batches_of(task, args.test, size, args.max_examples, pad)
                measured = with_oracle_rows(
                    measure(configs, batches, args.rounds), oracle, model.num_layers
                )
                rows += [{"batch": size, "threads": count, **row} for row in measured]
                print(f"[anchors] batch {size}, {count} threads done", file=sys.stderr)
    print("\n".join([*preamble, "", *format_rows(rows)]))
    if args.out:
        write_rows(rows, args.out, preamble)
        print(f"\nwrote {args.out}")
    if args.plot and args.rounds > 0:
        plot_rows(rows, args.plot, f"{Path(args.checkpoint).name} on {args.test}")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
