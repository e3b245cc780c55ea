"""``acl-fairseq-bundle``: a checkpoint as a self-contained early-exit bundle, and its runner in
a process where torch, fairseq, transformers and the plugin cannot be imported.

The runner's output lines (label, probability, exit layer) equal ``acl-fairseq-predict
--backend onnxruntime`` on the same checkpoint at the same precision, policy, batch size and
thread count, for every policy kind, at batch 1 and 32, on single sentences and on pairs; so
does ``python BUNDLE/run.py`` itself and the runner installed with ``pip install ./BUNDLE``.
The checkpoints are trained by ``fairseq-train`` (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acl_fairseq.cli import bundle as bundle_cli
from acl_fairseq.early_exit.learned import FEATURES, LearnedPolicy, split_features
from acl_fairseq.early_exit.policies import MaxProbPolicy, parse_policy, softmax_entropy
from acl_fairseq.inference.bundle import RUNNER, BundleError, write_bundle
from acl_fairseq.inference.loader import load_for_inference
from acl_fairseq.portable.bundle import BUNDLE_FILE
from acl_fairseq.runtime import onnx_runtime

from fairseq_helpers import fairseq_train, prepare_tsv_task
from predict_helpers import MULTI_EXIT, run_predict, trained  # noqa: F401  (trained: fixture)

pytestmark = pytest.mark.slow  # the checkpoints are trained by fairseq-train
PORTABLE = Path(onnx_runtime.__file__).parents[1] / "portable"
BANNED = ("torch", "fairseq", "acl_fairseq", "transformers")

BLOCKER = f"""
import importlib.abc, io, json, runpy, sys
BANNED = {BANNED!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BANNED:
            raise ImportError(f"{{name}}: refused, the runner must not need it")
sys.meta_path.insert(0, Refuse())
def check():
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BANNED)
    assert not loaded, loaded
"""

RUN_JOBS = (
    BLOCKER
    + """
jobs = json.load(open(sys.argv[1]))
sys.path.insert(0, jobs["runner_at"])
from early_exit_runner.bundle import main
out = {}
for key, (argv, stdin) in jobs["jobs"].items():
    o, e = io.StringIO(), io.StringIO()
    code = main(argv, stdin=io.StringIO(stdin), stdout=o, stderr=e)
    out[key] = [code, o.getvalue(), e.getvalue()]
check()
print(json.dumps(out))
"""
)


def runner_process(code: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """``code`` in ``python -I`` (no environment, no user site, no script folder on the path)
    with torch, fairseq, transformers and acl_fairseq refused."""
    return subprocess.run(
        [sys.executable, "-I", "-c", code, *args], input=stdin, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


def run_runner_jobs(tmp: Path, jobs: dict[str, tuple[list[str], str]]) -> dict[str, list]:
    """Each job (the runner's argv, stdin) through the runner's ``main``, all in one refusing
    process; ``{key: [exit code, stdout, stderr]}``."""
    first = next(iter(jobs.values()))[0][0]
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps({"runner_at": first, "jobs": jobs}))
    done = runner_process(RUN_JOBS, str(spec))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def threads() -> int:
    """The intra-op threads predict's sessions run on in this process (its global pool)."""
    return onnx_runtime.global_pool() or torch.get_num_threads()


def _midpoint(values: torch.Tensor) -> float:
    v = values.sort().values
    return float((v[len(v) // 2 - 1] + v[len(v) // 2]) / 2)


def policies_for(ckpt: Path, examples: list) -> dict[str, str]:
    """One policy of every kind whose thresholds split ``examples`` at the exits they name."""
    loaded = load_for_inference(ckpt, text="required")
    ids = [loaded.examples.encode([e] if isinstance(e, str) else list(e)) for e in examples]
    pad = loaded.task.source_dictionary.pad()
    tokens = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad)
    with torch.no_grad():
        exits = [o.logits for o in loaded.model.exit_outputs(tokens)][:-1]
    entropy = [softmax_entropy(x) for x in exits]
    top = [MaxProbPolicy.score(x) for x in exits]
    weights = {"maxprob": 4.0, "margin": 2.0, "entropy": -1.0, "agree": 1.0, "run": 0.5}
    learned = LearnedPolicy(0.5, tuple(weights.get(f, 0.3) for f in FEATURES), -3.0)
    z = learned.logit(split_features(exits)[:, 0])
    e0, e2, m0, m1, m2 = (_midpoint(v) for v in (entropy[0], entropy[2], top[0], top[1], top[2]))
    return {
        "entropy": f"entropy:{e0!r}",
        "maxprob": f"maxprob:{m0!r}",
        "patience": "patience:1",
        "per_exit_entropy": f"per_exit_entropy:1={e0!r},3={e2!r}",
        "per_exit_maxprob": f"per_exit_maxprob:2={m1!r},3={m2!r};patience=1",
        "learned": learned.with_threshold(float(torch.sigmoid(torch.tensor(_midpoint(z))))).spec,
        "none": "none",
    }


def compare_with_predict(tmp: Path, ckpt: Path, cases: dict, text: str, flags=()) -> dict:
    """Bundles ``cases`` (``{name: (dtype, policy)}``), runs predict --backend onnxruntime and
    the runner at batch 1 and 32 on ``text``, asserts equal output lines; returns predict's
    lines by (name, batch size)."""
    jobs, want = {}, {}
    for name, (dtype, policy) in cases.items():
        folder = tmp / f"bundle-{name}"
        summary = write_bundle(ckpt, folder, dtype, policy)
        assert summary.dtype == dtype
        for batch in (1, 32):
            argv = ["--backend", "onnxruntime", "--dtype", dtype, "--policy", policy,
                    "--batch-size", str(batch), *flags]  # fmt: skip
            code, out, err = run_predict(ckpt, *argv, stdin=text)
            assert code == 0, err
            want[name, batch] = out
            runner_argv = [str(folder), "--batch-size", str(batch), "--threads", str(threads())]
            jobs[f"{name}/{batch}"] = (runner_argv + list(flags), text)
    got = run_runner_jobs(tmp, jobs)
    seen = set()
    for (name, batch), out in want.items():
        code, lines, err = got[f"{name}/{batch}"]
        assert code == 0, err
        assert lines == out, (name, batch)  # labels, probabilities and exits, line by line
        outputs = out.splitlines()
        assert len(outputs) == text.count("\n")
        layers = [int(line.split("\t")[2]) for line in outputs if line != "-\t-\t-"]
        assert len(outputs) - len(layers) == sum(not t.strip() for t in text.splitlines())
        if cases[name][1] != "none":  # not vacuous: rows leave early
            assert min(layers) < 4, (name, batch, set(layers))
        seen |= set(layers)
    assert len(seen) >= 3, seen  # and at several exits
    return want


def test_the_runner_prints_what_predict_prints(trained, tmp_path):  # noqa: F811
    """Every policy kind at fp32, two at int8, batch 1 and 32, single sentences."""
    ckpt = trained["ckpt"]
    sentences = [row[0] for row in trained["rows"]]
    policies = policies_for(ckpt, sentences)
    cases = {name: ("fp32", spec) for name, spec in policies.items()}
    cases.update({f"{name}-int8": ("int8", policies[name]) for name in ("entropy", "learned")})
    text = (
        "".join(f"{s}\n" for s in sentences[:3])
        + "\n \t\n"
        + "".join(f"{s}\n" for s in sentences[3:])
    )  # two blank lines: '-' on their output lines, as predict writes them
    compare_with_predict(tmp_path, ckpt, cases, text)
    config = json.loads((tmp_path / "bundle-learned" / BUNDLE_FILE).read_text())
    assert config["policy"] == policies["learned"]
    assert config["rule"] == parse_policy(policies["learned"]).rule()
    assert config["fingerprint"] == load_for_inference(ckpt, fingerprint=True).fingerprint
    assert [s["layer"] for s in config["segments"]] == [1, 2, 3, 4]
    full = json.loads((tmp_path / "bundle-none" / BUNDLE_FILE).read_text())
    assert full["rule"] is None and [s["layer"] for s in full["segments"]] == [4]
    copied = tmp_path / "bundle-entropy" / RUNNER
    for source in PORTABLE.glob("*.py"):  # the runner: a verbatim copy of acl_fairseq/portable
        assert (copied / source.name).read_bytes() == source.read_bytes()
    assert {p.name for p in copied.glob("*.py")} == {p.name for p in PORTABLE.glob("*.py")}


@pytest.fixture(scope="module")
def pair_checkpoint(tmp_path_factory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("bundle-pairs")
    data, rows = prepare_tsv_task(root, pair=True)
    fairseq_train(data, root / "multi", *MULTI_EXIT)
    return root / "multi" / "checkpoint_last.pt", rows


def test_the_runner_prints_what_predict_prints_on_pairs(pair_checkpoint, tmp_path):
    ckpt, rows = pair_checkpoint
    policies = policies_for(ckpt, [(r[0], r[1]) for r in rows])
    cases = {name: ("fp32", policies[name]) for name in ("per_exit_maxprob", "learned")}
    cases["patience-int8"] = ("int8", policies["patience"])
    text = "".join(f"{r[0]}\t{r[1]}\n" for r in rows)
    compare_with_predict(tmp_path, ckpt, cases, text, ["--text-columns", "1,2"])
    # a pair bundle refuses single sentences as predict does
    got = run_runner_jobs(tmp_path, {"single": ([str(tmp_path / "bundle-learned")], "a\n")})
    code, _, err = got["single"]
    assert code == 2 and "is a sentence-pair model: give a TSV with --text-columns 1,2" in err


def test_run_py_the_installed_runner_and_python(trained, tmp_path):  # noqa: F811
    """``python BUNDLE/run.py``, ``pip install ./BUNDLE`` then ``python -m early_exit_runner``,
    and ``Bundle(folder).predict``: predict's labels and exits, without torch."""
    ckpt = trained["ckpt"]
    sentences = [row[0] for row in trained["rows"]]
    spec = policies_for(ckpt, sentences)["per_exit_entropy"]
    folder = tmp_path / "b"
    assert bundle_cli.main([str(ckpt), str(folder), "--policy", spec, "--dtype", "int8"]) == 0
    text = "".join(f"{s}\n" for s in sentences)
    code, want, err = run_predict(ckpt, "--backend", "onnxruntime", "--dtype", "int8",
                                  "--policy", spec, stdin=text)  # fmt: skip
    assert code == 0, err
    flags = ["--threads", str(threads())]
    run_py = BLOCKER + f"sys.argv = [{str(folder / 'run.py')!r}, *{flags!r}]\n"
    run_py += "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    done = runner_process(run_py, stdin=text)
    assert done.returncode == 0 and done.stdout == want, done.stderr[-3000:]
    assert "mean exit layer" in done.stderr

    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
           "--no-build-isolation", "--target", str(target), str(folder)]  # fmt: skip
    installed = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert not (target / RUNNER / "segments").exists()  # the runner, not the model
    module = BLOCKER + f"sys.path.insert(0, {str(target)!r})\n"
    module += f"sys.argv = ['{RUNNER}', {str(folder)!r}, *{flags!r}]\n"
    module += f"runpy.run_module({RUNNER!r}, run_name='__main__')\n"
    done = runner_process(module, stdin=text)
    assert done.returncode == 0 and done.stdout == want, done.stderr[-3000:]
    scripts = [p.name for p in (target / "bin").iterdir()] if (target / "bin").is_dir() else []
    assert "early-exit-runner" in scripts

    api = BLOCKER + f"sys.path.insert(0, {str(folder)!r})\n"
    api += f"from {RUNNER} import Bundle\n"
    api += f"found = Bundle({str(folder)!r}).predict(json.loads(sys.stdin.read()))\n"
    api += "check()\nprint(json.dumps([list(p) for p in found]))\n"
    done = runner_process(api, stdin=json.dumps(sentences))
    assert done.returncode == 0, done.stderr[-3000:]
    for (label, prob, layer), line in zip(json.loads(done.stdout), want.splitlines(), strict=True):
        w_label, w_prob, w_layer = line.split("\t")
        assert (label, layer) == (w_label, int(w_layer)) and abs(prob - float(w_prob)) <= 5e-5


def test_errors_are_named(trained, tmp_path):  # noqa: F811
    ckpt = trained["ckpt"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(BundleError, match="exists and is not an empty folder"):
        write_bundle(ckpt, tmp_path / "full")
    code = bundle_cli.main([str(ckpt), str(tmp_path / "b"), "--policy", "saved"])
    assert code == 2 and not (tmp_path / "b" / BUNDLE_FILE).exists()
    with pytest.raises(BundleError, match="--policy: .* decides at layer"):
        write_bundle(ckpt, tmp_path / "b", policy="per_exit_entropy:7=0.3")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".*partial*"))
    folder = tmp_path / "ok"
    write_bundle(ckpt, folder, policy="patience:0")
    config = json.loads((folder / BUNDLE_FILE).read_text())
    (folder / BUNDLE_FILE).write_text(json.dumps({**config, "format": 99}))
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    jobs = {"format": ([str(folder)], "a\n"), "none": ([str(nothing)], "a\n"),
            "columns": ([str(folder), "--text-columns", "0"], "a\n")}  # fmt: skip
    got = run_runner_jobs(tmp_path, jobs)
    assert got["format"][0] == 2 and "bundle format 99, this runner reads 1" in got["format"][2]
    assert got["none"][0] == 2 and f"{nothing}: no {BUNDLE_FILE}" in got["none"][2]
    assert got["columns"][0] == 2 and "--text-columns '0': expected one or two" in got["columns"][2]
    assert all(line.startswith("early-exit-runner: error: ") for _, _, line in got.values())
