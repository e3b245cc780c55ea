"""Hand-written ``acl-fairseq-compare`` results folders (``runs/RUN/test.json``) and the
Markdown tables of its report, for the compare and plots tests."""

import json

from acl_fairseq.cli.compare.plan import Run


def fake_run(out, method, seed, dev, test, lam=None, sweep=False, exits=None, angles=None):
    name = Run(method, seed, lam, sweep).name
    d = out / "runs" / name
    d.mkdir(parents=True)
    result = {
        "run": name,
        "method": method,
        "seed": seed,
        "lambda": lam,
        "sweep": sweep,
        "acl_grad_threshold": 90.0 if angles else None,
        "dev": {"accuracy": dev, "loss": 0.5},
        "test": {"accuracy": test, "loss": 0.6, **(exits or {})},
        "angles": angles,
    }
    (d / "test.json").write_text(json.dumps(result))
    if angles:
        (d / "angles.tsv").write_text("0\t30.0\t1\n1\t100.0\t0\n2\t95.0\t1\n")
    return result


def fake_results(out):
    for seed, (dev, test) in enumerate([(80, 79), (82, 81), (84, 83)], start=1):
        fake_run(out, "ce", seed, dev, test)
        ang = {"updates": 3, "mean_angle": 75.0, "pct_over_90": 66.7, "pct_dropped": 33.3}
        fake_run(out, "acl", seed, dev + 2, test + 2, lam=0.5, angles=ang)
        fake_run(out, "acl", seed, dev + 3, test + 1, lam=1.0, sweep=True)
        fake_run(out, "acl", seed, dev - 5, test - 5, lam=0.1, sweep=True)
        exits = {"accuracy_exit1": 60.0 + seed, "accuracy_exit2": float(test)}
        fake_run(out, "multi_exit_joint", seed, dev, test, exits=exits)
        exits = {"accuracy_exit1": 70.0 + seed, "accuracy_exit2": test + 1.0}
        fake_run(out, "acl_cl", seed, dev, test + 1, lam=0.5, exits=exits)


def md_table(md, title):
    """Rows (lists of cells) of the first Markdown table after the heading ``title``."""
    lines = md.split(title + "\n", 1)[1].strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows
