"""The demo's deployable path: a precision and an early-exit policy chosen on dev by
``acl-fairseq-sweep``, reported on test as a user's speed-up over fp32 full depth, then run by
``acl-fairseq-predict`` (which reads the saved choice).

1. ``choose_on_dev``: ``acl-fairseq-sweep CKPT DATA --split valid --dtypes int8,bf16,fp32
   --max-accuracy-drop D`` (bf16 only on a CPU with bfloat16 instructions; no timing: the
   choice needs one pass per precision) writes ``early_exit_policy.json`` next to the
   checkpoint, every precision's policy, the first precision (int8) as the default that
   predict runs.
2. ``measure_on_test``: the same sweep on test with each precision's chosen threshold: untimed
   over the whole split (accuracy, layers used), then timed at batch 32 and 1 over the first
   sentences, every precision's full depth and policies in the same interleaved rounds
   (``acl_fairseq.inference.measure.time_together``), so that they compare with fp32's.
3. ``deploy_table``: one row per precision at full depth and with its policy; speed-up = the
   time per sentence of fp32 full depth / the row's, at the same batch size.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from acl_fairseq.cpu_features import has_native_bf16
from acl_fairseq.early_exit.policies import ExitPolicy
from acl_fairseq.errors import AclRuntimeError
from acl_fairseq.experiment import commands
from acl_fairseq.inference.plan import Request, decide
from acl_fairseq.inference.saved_policy import SavedPolicy, policy_path, read_policy

__all__ = [
    "BATCH_SIZES",
    "DTYPES",
    "deploy_dtypes",
    "POLICY_KIND",
    "choose_on_dev",
    "deploy_table",
    "measure_on_test",
    "reference_times",
    "sweep_command",
]

DTYPES = ("int8", "bf16", "fp32")  # the sweep saves the first as predict's default
POLICY_KIND = "entropy"  # one threshold: held its dev target on test (docs/results.md)
BATCH_SIZES = (32, 1)
REFERENCE = "fp32"
TIMED_ROUNDS = 3

Rows = dict[tuple[str, int, str, str], dict[str, str]]
"""Sweep TSV rows by (dtype, batch size, policy kind or "none", threshold as written)."""


def deploy_dtypes() -> tuple[str, ...]:
    """The precisions the demo chooses among: ``DTYPES``, less bf16 on a CPU without bfloat16
    instructions (emulated there: many times slower than fp32, never a deployment's choice)."""
    return DTYPES if has_native_bf16() else tuple(d for d in DTYPES if d != "bf16")


def sweep_command(checkpoint: Path, data: Path, *flags: str) -> list[str]:
    """``acl-fairseq-sweep CHECKPOINT DATA --cpu FLAGS`` in this Python."""
    return [sys.executable, "-m", "acl_fairseq.cli.sweep", str(checkpoint), str(data), "--cpu",
            *flags]  # fmt: skip


def _run(cmd: list[str], what: str) -> str:
    """The stdout of the tool ``cmd``; its error (the last lines of stderr) as an
    :class:`AclRuntimeError` naming ``what`` failed."""
    proc = commands.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise AclRuntimeError(f"{what} failed (exit status {proc.returncode}):\n{tail}")
    return proc.stdout


def choose_on_dev(
    checkpoint: Path, data: Path, work: Path, max_drop: float
) -> tuple[SavedPolicy, str]:
    """The choice the sweep saved next to ``checkpoint`` (every precision's policy, chosen on
    the dev split within ``max_drop`` points) and the sweep's ``chosen`` lines."""
    saved_file = policy_path(checkpoint)
    saved_file.unlink(missing_ok=True)  # a failed sweep must not leave an older choice
    cmd = sweep_command(
        checkpoint, data, "--split", "valid", "--policy", POLICY_KIND,
        "--dtypes", ",".join(deploy_dtypes()), "--max-accuracy-drop", f"{max_drop:g}",
        "--batch-sizes", str(BATCH_SIZES[0]), "--repeats", "0",
        "--out", str(work / "early_exit_dev.tsv"),
    )  # fmt: skip
    out = _run(cmd, f"acl-fairseq-sweep on dev (--max-accuracy-drop {max_drop:g})")
    saved = read_policy(checkpoint)
    if saved is None:
        raise AclRuntimeError(f"acl-fairseq-sweep wrote no {saved_file}")
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("chosen (")), len(lines))
    return saved, "\n".join(lines[start:])


def saved_policy_at(saved: SavedPolicy, dtype: str) -> ExitPolicy:
    """The policy predict runs at ``dtype`` with the saved choice (``--policy saved --dtype
    DTYPE``): the one decision of ``inference.plan``."""
    policy = decide(Request(dtype=dtype, policy="saved").checked(), saved).policy
    assert policy is not None  # the saved policy, on the multi-exit model it was chosen on
    return policy


def threshold_text(policy: ExitPolicy) -> str:
    """The policy's value as the sweep's table writes it."""
    value = policy.value
    return value if isinstance(value, str) else f"{value:g}"


def short_spec(policy: ExitPolicy) -> str:
    """``entropy:0.284`` (three digits; the saved file has the full value)."""
    value = policy.value
    return f"{policy.kind}:{value:.3g}" if isinstance(value, float) else policy.spec


def read_rows(path: Path) -> Rows:
    """The rows of a sweep TSV by (dtype, batch size, policy, threshold)."""
    with open(path, newline="", encoding="utf-8") as f:
        return {
            (r["dtype"], int(r["batch_size"]), r["policy"], r["threshold"]): r
            for r in csv.DictReader(f, delimiter="\t")
        }


def measure_on_test(
    checkpoint: Path, data: Path, saved: SavedPolicy, work: Path, timed_examples: int
) -> tuple[Rows, Rows]:
    """(accuracy rows over the whole test split, timed rows over its first
    ``timed_examples`` sentences) of every precision's chosen policy and full depth. One
    timed sweep of every precision and the chosen thresholds, in the same rounds."""
    dtypes = [REFERENCE] + [d for d in saved.by_dtype if d != REFERENCE]
    chosen = {d: threshold_text(saved_policy_at(saved, d)) for d in dtypes}
    common = ["--split", "test", "--policy", POLICY_KIND]
    accuracy_tsv = work / "early_exit_test.tsv"
    _run(
        sweep_command(checkpoint, data, *common, "--dtypes", ",".join(dtypes),
                      "--thresholds", ",".join(sorted(set(chosen.values()))),
                      "--batch-sizes", str(BATCH_SIZES[0]), "--repeats", "0",
                      "--out", str(accuracy_tsv)),
        "acl-fairseq-sweep on test (accuracy)",
    )  # fmt: skip
    timed_tsv = work / "early_exit_test_timed.tsv"
    _run(
        sweep_command(checkpoint, data, *common, "--dtypes", ",".join(dtypes),
                      "--thresholds", ",".join(sorted(set(chosen.values()))),
                      "--batch-sizes", ",".join(map(str, BATCH_SIZES)),
                      "--max-examples", str(timed_examples), "--repeats", str(TIMED_ROUNDS),
                      "--out", str(timed_tsv)),
        "acl-fairseq-sweep on test (timing)",
    )  # fmt: skip
    return read_rows(accuracy_tsv), read_rows(timed_tsv)


def _key(dtype: str, batch: int, policy: ExitPolicy | None) -> tuple[str, int, str, str]:
    if policy is None:
        return (dtype, batch, "none", "")
    return (dtype, batch, policy.kind, threshold_text(policy))


def _ms(row: dict[str, str] | None) -> float | None:
    value = (row or {}).get("early_ms") or ""
    return float(value) if value else None


def reference_times(timed: Rows) -> str:
    """``1.234 ms per sentence at batch 32, 5.678 ms at batch 1``: fp32 at full depth."""
    times = [(b, _ms(timed.get(_key(REFERENCE, b, None)))) for b in BATCH_SIZES]
    text = ", ".join(f"{ms:.3f} ms at batch {b}" for b, ms in times if ms)
    return text.replace(" ms at", " ms per sentence at", 1) or "not timed"


def deploy_table(saved: SavedPolicy, accuracy: Rows, timed: Rows, num_layers: int) -> str:
    """The Markdown table of fp32 full depth (the reference), each precision at full depth
    and with its policy, the chosen one last; speed-up over the reference at each batch size."""
    chosen = saved.dtype
    others = [d for d in saved.by_dtype if d not in (REFERENCE, chosen)]
    plan: list[tuple[str, ExitPolicy | None, str]] = [
        (REFERENCE, None, f"{REFERENCE} full depth (reference)")
    ]
    for dtype in [REFERENCE, *others, chosen]:
        policy = saved_policy_at(saved, dtype)
        if dtype != REFERENCE:
            plan.append((dtype, None, f"{dtype} full depth"))
        label = f"{dtype} + {short_spec(policy)}"
        plan.append((dtype, policy, f"chosen: {label}" if dtype == chosen else label))
    if chosen == REFERENCE:
        plan = plan[:2]
    batches = [b for b in BATCH_SIZES if _ms(timed.get(_key(REFERENCE, b, None)))]
    head = ["what runs", "test accuracy %", f"layers used (of {num_layers})"]
    head += [f"speed-up, batch {b}" for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for dtype, policy, label in plan:
        row = accuracy.get(_key(dtype, BATCH_SIZES[0], policy))
        cells = [label]
        cells += [f"{float(row['accuracy']):.1f}", f"{float(row['mean_exit_layer']):.2f}"] if row \
            else ["-", "-"]  # fmt: skip
        for b in batches:
            reference, ms = (
                _ms(timed.get(_key(REFERENCE, b, None))),
                _ms(timed.get(_key(dtype, b, policy))),
            )
            cells.append(f"{reference / ms:.2f}x" if reference and ms else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
