"""Compare fine-tuning methods over several seeds: CE, CE+SCL, ACL, and multi-exit joint CE
versus ACL-CL, with checkpoints chosen on dev and accuracy reported on a held-out test split.
Every run also keeps its per-example predictions on dev and test (``predictions.tsv``).

Methods (every run: ``fairseq-train --task acl_sentence_prediction``, the demo's optimizer;
the main comparison, run by default, is ce, ce_scl, acl, multi_exit_joint and acl_cl):

  ce                fairseq's ``sentence_prediction`` criterion (plain CE), final exit only
  ce_scl            CE + SCL (``--criterion ce_scl``, Gunel et al.); run by default with
                    ``--acl-grad --acl-grad-threshold 180``: the CE/SCL gradient angle is
                    measured and logged every update (for the angle histogram) but the SCL
                    term is never dropped, so the objective is plain CE+SCL (at the cost of a
                    second backward pass; ``--ce-scl-plain`` turns the measurement off)
  ce_scl_grad       CE + SCL gated by ACL-Grad (``--acl-grad --acl-grad-threshold``, default
                    90): the gate without ACL-Embed
  acl               CE + ACL-Embed with ACL-Grad (``--criterion acl_embed``,
                    ``--acl-grad-threshold``, default 90)
  acl_embed         CE + ACL-Embed without ACL-Grad (``--criterion acl_embed --no-acl-grad``):
                    ACL without its gate
  multi_exit_joint  stage 2 of the joint baseline: the multi-exit model restored from the CE
                    run's best checkpoint (same seed), joint weighted CE over every exit
                    (``--criterion multi_exit_ce``)
  joint_from_acl    the same joint CE stage 2, restored from the acl run's best checkpoint:
                    the same start as acl_cl
  joint_from_start  joint CE over every exit from the pretrained model (--restore-file), no
                    stage 1: the exits trained together from the start; --epochs and
                    --extra's --patience apply, as to a stage-1 run
  acl_cl            stage 2 of ACL: the multi-exit model restored from the acl run's best
                    checkpoint (same seed), ``--criterion acl_cross_layer``

Every run uses the multi-exit architecture (``--arch roberta`` -> ``multi_exit_roberta``,
``roberta_base`` -> ``multi_exit_roberta_base``, ...); the single-exit methods with
``--exit-layers none``, so that ``--exit-pooling`` means the same for every method and stage 2
restores a final head trained with the pooling it is used with. With ``--exit-pooling first``
such a model computes exactly what plain RoBERTa computes. A multi-exit method whose stage-1
method is not in ``--methods`` gets its stage-1 run added.

For each run the best checkpoint on ``valid`` (dev) is kept (``--best-checkpoint-metric
accuracy``); its dev accuracy is the best validation record of the training log, and
``fairseq-validate --valid-subset test`` on that checkpoint gives the held-out numbers (per exit
for the multi-exit methods).

Output (``--out``, default ``RESULTS``)::

    runs/<method>-seed<k>/            train.log (fairseq JSON log), angles.tsv (ACL-Grad log:
                                      update, angle, kept), command.txt, run.json,
                                      checkpoint_best.pt, test.log, test.json (the numbers)
    runs/<method>-lam<l>-seed<k>/     the lambda sweep (--lambdas), same files; checkpoints
                                      deleted after evaluation unless --keep-sweep-checkpoints
    results.md                        Markdown tables: mean, sample std and per-seed values
    results.csv                       every number of every run (long format)
    summary.csv                       mean / std / n per method, lambda and metric

``results.md`` / ``*.csv`` are rebuilt from every ``runs/*/test.json`` in the folder, so
several invocations (main comparison, lambda sweep) add up to one report; ``--report-only``
only rebuilds them.

Resumable: a run whose ``test.json`` exists is not run again (``--force`` re-runs), a run whose
training finished but whose evaluation did not is only evaluated, and a stage-2 run is trained
again when its stage-1 run was. A finished run made with other flags than the ones asked for now
stops the script (use ``--force`` or another ``--out``).

Lambda sweep (``--lambdas 0.1,0.5,1.0``): ce_scl and acl (those of them in ``--methods``) are
also run with each ``--contrastive-lambda`` value, named ``<method>-lam<l>-seed<k>``; the value
equal to ``--contrastive-lambda`` is the main run itself (same flags, not trained twice).
``results.md`` then reports dev and test accuracy per lambda and the lambda chosen on dev.

Example (the demo's data and converted MiniLM)::

    acl-fairseq-compare demo_work/data/rt-bin \\
        --restore-file demo_work/minilm-fairseq/model.pt \\
        --arch-args-file demo_work/minilm-fairseq/fairseq_args.txt \\
        --seeds 1,2,3 --lr 5e-5 --batch-size 16 --epochs 1 --exit-pooling mean --out RESULTS
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from acl_fairseq.cli import HelpFormatter
from acl_fairseq.cli.compare.plan import (
    COMPARE_METHODS,
    parse_list,
    plan_epochs,
    plan_runs,
    read_arch_args,
    total_updates,
)
from acl_fairseq.cli.compare.report import write_report
from acl_fairseq.cli.compare.run import Progress, RunFailed, execute, train_command
from acl_fairseq.data.splits import count_classes, count_examples
from acl_fairseq.errors import AclFileNotFoundError, AclValueError, run_tool
from acl_fairseq.experiment.recipe import METHODS, multi_exit_arch

PROG = "acl-fairseq-compare"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("data", type=Path, help="binarized sentence_prediction data directory")
    p.add_argument("--out", type=Path, default=Path("RESULTS"), help="results folder")
    p.add_argument(
        "--restore-file",
        default="none",
        help="pretrained fairseq checkpoint (model.pt); 'none' trains from scratch (tests)",
    )
    arch = p.add_mutually_exclusive_group()
    arch.add_argument(
        "--arch-args-file",
        help="file with the model flags (fairseq_args.txt of acl-fairseq-convert-bert)",
    )
    arch.add_argument("--arch-args", help="model flags, e.g. '--arch roberta_base'")
    p.add_argument(
        "--methods",
        type=lambda s: parse_list(s, str, "--methods"),
        default=list(METHODS),
        help=f"comma list of {','.join(COMPARE_METHODS)} (default: {','.join(METHODS)})",
    )
    p.add_argument(
        "--seeds",
        type=lambda s: parse_list(s, int, "--seeds"),
        default=[1, 2, 3],
        help="comma list",
    )
    p.add_argument(
        "--lambdas",
        type=lambda s: parse_list(s, float, "--lambdas"),
        help="lambda sweep of ce_scl and acl, e.g. 0.1,0.5,1.0",
    )
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (Adam)")
    p.add_argument("--batch-size", type=int, default=16, help="sentences per update")
    p.add_argument(
        "--epochs",
        type=int,
        help="epochs of every run (each stage); default: enough for --max-update, else 1",
    )
    p.add_argument(
        "--max-update",
        type=int,
        help="stop every run after this many updates (without --epochs: as many epochs as "
        "that takes)",
    )
    p.add_argument(
        "--warmup-percent", type=int, default=6, help="warm-up updates, in percent of the total"
    )
    p.add_argument(
        "--exit-pooling", choices=("first", "mean"), default="mean", help="pooling of every head"
    )
    p.add_argument(
        "--exit-layers", help="shallow exits of the multi-exit methods (default: every layer)"
    )
    p.add_argument(
        "--contrastive-lambda", type=float, default=0.5, help="lambda of ce_scl, acl, acl_cl"
    )
    p.add_argument("--cross-layer-lambda", type=float, default=0.5, help="acl_cl's lambda_cl")
    p.add_argument(
        "--acl-cl-teacher",
        choices=("live", "frozen"),
        default="live",
        help="acl_cl's teacher: the live last exit, or a frozen snapshot of its stage-1 run's "
        "best checkpoint (--frozen-teacher)",
    )
    p.add_argument(
        "--cross-layer-weighting",
        choices=("exit", "layer", "uniform"),
        default="exit",
        help="acl_cl's weights of the exits' contrastive terms (exit: those of the CE terms)",
    )
    p.add_argument(
        "--exit-weighting",
        choices=("layer", "uniform", "reverse"),
        help="weights of the exits' CE terms of the multi-exit methods (default: the "
        "criterions' own, layer)",
    )
    p.add_argument(
        "--stage2-epochs",
        type=int,
        help="epochs of the multi-exit (stage-2) runs, default --epochs; stage 2 trains this "
        "fixed budget for both multi-exit methods: a --patience in --extra applies to stage 1 only",
    )
    p.add_argument("--temperature", type=float, default=0.3, help="of the contrastive losses")
    p.add_argument(
        "--acl-grad-threshold", type=float, default=90.0, help="ACL-Grad of acl and acl_cl"
    )
    p.add_argument(
        "--ce-scl-plain",
        action="store_true",
        help="run ce_scl without measuring the gradient angle (one backward, no angles.tsv)",
    )
    p.add_argument("--num-classes", type=int, help="default: from DATA/label/dict.txt")
    p.add_argument("--dev-subset", default="valid", help="split the checkpoint is chosen on")
    p.add_argument("--test-subset", default="test", help="held-out split reported")
    p.add_argument(
        "--validate-interval-updates", type=int, help="default: a third of a run's updates"
    )
    p.add_argument("--log-interval", type=int, default=10, help="updates per progress line")
    p.add_argument("--eval-batch-size", type=int, default=64, help="of fairseq-validate")
    p.add_argument(
        "--extra",
        default="",
        help="more fairseq-train flags for every run, after the others (so they override them); "
        "one string: --extra '--update-freq 2 --fp16' or --extra=--fp16",
    )
    p.add_argument(
        "--stage2-extra",
        default="",
        help="more fairseq-train flags for the stage-2 runs only, after --extra; one string: "
        "--stage2-extra=--alternate-exits",
    )
    p.add_argument("--cpu", action="store_true", help="train on CPU (default when no CUDA)")
    p.add_argument("--force", action="store_true", help="re-run runs that are done")
    p.add_argument(
        "--keep-going", action="store_true", help="after a failed run, go on with the others"
    )
    p.add_argument(
        "--keep-sweep-checkpoints",
        action="store_true",
        help="keep checkpoint_best.pt of the lambda-sweep runs (deleted after evaluation)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report-only", action="store_true", help="only rebuild results.md/csv")
    return p


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """The ``acl-fairseq-compare`` command; returns the exit status."""
    return run_tool(PROG, compare, build_parser().parse_args(argv))


def compare(opts: argparse.Namespace) -> int:
    """Plans, trains and evaluates the runs of ``opts``, then writes the report."""
    opts.out = opts.out.resolve()
    if opts.report_only:
        print(f"wrote {write_report(opts.out)}")
        return 0
    opts.data = opts.data.resolve()
    if not (opts.arch_args_file or opts.arch_args):
        raise AclValueError("give the model flags: --arch-args-file FILE or --arch-args '...'")
    opts.arch_args = read_arch_args(opts.arch_args_file, opts.arch_args)
    opts.extra_args = shlex.split(opts.extra)
    opts.stage2_extra_args = shlex.split(opts.stage2_extra)
    if opts.restore_file.lower() != "none" and not Path(opts.restore_file).exists():
        raise AclFileNotFoundError(f"--restore-file {opts.restore_file}: no such file")
    multi_exit_arch(opts.arch_args)  # an --arch without a multi-exit variant stops here
    opts.num_classes = opts.num_classes or count_classes(opts.data)
    opts.n_train = count_examples(opts.data, "train")
    for split in (opts.dev_subset, opts.test_subset):
        count_examples(opts.data, split)  # fails early, naming the file, when it is missing
    if not opts.cpu and not opts.dry_run and not _cuda_available():
        opts.cpu = True
    note = plan_epochs(opts)
    runs = plan_runs(opts.methods, opts.seeds, opts.contrastive_lambda, opts.lambdas)
    added = sorted({r.method for r in runs} - set(opts.methods))
    print(
        f"{len(runs)} runs ({', '.join(r.name for r in runs)}) of {total_updates(opts)} updates "
        f"each ({opts.n_train} training examples, batch {opts.batch_size}, {opts.epochs} "
        f"epoch(s)) -> {opts.out}",
        flush=True,
    )
    if note:
        print(note)
    if added:
        print(f"added stage-1 runs for the multi-exit methods: {', '.join(added)}")
    if "ce_scl" in opts.methods and not opts.ce_scl_plain:
        print(
            "ce_scl runs with --acl-grad --acl-grad-threshold 180: the angle is measured and "
            "logged every update (angles.tsv), the SCL term is never dropped"
        )
    if opts.dry_run:
        for run in runs:
            cmd = train_command(run, opts, opts.out / "runs" / run.name)
            print(f"# {run.name}\n{shlex.join(cmd)}")
        return 0
    (opts.out / "runs").mkdir(parents=True, exist_ok=True)
    progress = Progress(len(runs))
    failed: list[str] = []
    trained: set[str] = set()
    counts = {"skipped": 0, "evaluated": 0, "trained": 0}
    for i, run in enumerate(runs, start=1):
        if run.stage1 is not None and run.stage1.name in failed:
            print(f"[{i}/{len(runs)}] {run.name}: skipped, its stage 1 failed", flush=True)
            failed.append(run.name)
            continue
        # a stage-2 run restores its stage 1's checkpoint: stage 1 trained again, so is it
        force = opts.force or (run.stage1 is not None and run.stage1.name in trained)
        try:
            outcome = execute(run, opts, progress, i, force)
            counts[outcome] += 1
            if outcome == "trained":
                trained.add(run.name)
        except RunFailed as e:
            if not opts.keep_going:
                write_report(opts.out)
                raise
            print(f"[{i}/{len(runs)}] {run.name}: FAILED\n{e}", flush=True)
            failed.append(run.name)
        write_report(opts.out)
    path = write_report(opts.out)
    print(
        f"\n{counts['trained']} trained, {counts['evaluated']} only evaluated, "
        f"{counts['skipped']} done before, {len(failed)} failed; {progress.elapsed()}\n"
        f"wrote {path}, {opts.out / 'results.csv'}, {opts.out / 'summary.csv'}",
        flush=True,
    )
    print(path.read_text(encoding="utf-8"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
