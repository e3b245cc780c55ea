#!/usr/bin/env bash
# Creates (or completes) a virtual environment with everything acl-fairseq needs, on CPU.
# Usage: scripts/install.sh [VENV_DIR] [EXTRAS]   (defaults: .venv, test). Safe to re-run.
# EXTRAS: the package's extras to install with it (setup.py: test, bench; comma-separated);
# "none" for the package alone, which is what `make demo` needs (`make test` adds "test").
#
# fairseq: the `fairseq-fixed` build (fairseq main with Python 3.11+ fixes). It is built
# against the torch already installed (--no-build-isolation), and without its declared
# dependencies (--no-deps), which would pull torchaudio and a second torch; text tasks never
# need torchaudio. Its real runtime dependencies, and this package with its own, are installed
# first, in one pip call: pip then has no reason to report fairseq's missing torchaudio (pip's
# check skips --no-deps installs), so every ERROR line printed here is a real failure.
# Its C++ extensions compile in parallel (build_ext -j, one job per core) and without debug
# information (-g0): the same extensions, built in a fraction of the time.
# tensorboardX lets fairseq-train --tensorboard-logdir write event files (README: "Watching
# training"); view them with TensorBoard (pip install tensorboard, anywhere).
set -euo pipefail
VENV=${1:-.venv}
EXTRAS=${2:-test}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PACKAGE="."
if [ "$EXTRAS" != "none" ]; then
  PACKAGE=".[$EXTRAS]"
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip  # -C (config settings) below needs pip >= 23.1
# torch, fairseq's runtime dependencies (its declared ones, less torchaudio; numpy and cython
# also build it), this package. --no-compile: Python compiles the modules that are imported
# when they first are, not the thousands never imported. PYTHONWARNINGS: setuptools warns on
# every editable install that a folder named like the package may shadow it (here it is the
# package itself)
PYTHONWARNINGS=ignore $PIP install -q --no-compile "$TORCH_SPEC" numpy cython "hydra-core==1.3.2" \
  "omegaconf==2.3.0" bitarray sacrebleu regex tqdm cffi scikit-learn scipy packaging \
  tensorboardX -e "$PACKAGE"
if ! "$VENV/bin/python" -c "import fairseq" 2>/dev/null; then
  echo "building fairseq-fixed 0.12.3.1 (its C++ extensions: the longest step)..."
  CFLAGS="${CFLAGS:-} -g0" $PIP install -q --no-compile --no-build-isolation --no-deps \
    -C "--build-option=build_ext -j$(nproc 2>/dev/null || echo 2)" fairseq-fixed==0.12.3.1
fi
# the bytecode of what the commands import, written once here: installed --no-compile, and
# where PYTHONDONTWRITEBYTECODE is set (containers often set it) Python would otherwise compile
# torch's and fairseq's modules again in every process
"$VENV/bin/python" "$(dirname "$0")/compile_imported.py" acl_fairseq
"$VENV/bin/python" -c "import acl_fairseq, fairseq, torch; print('acl-fairseq ready: fairseq', fairseq.__version__, 'torch', torch.__version__)"
