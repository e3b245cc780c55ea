#!/usr/bin/env bash
# Creates (or completes) a virtual environment with everything acl-fairseq needs, on CPU.
# Usage: scripts/install.sh [VENV_DIR]   (default .venv). Safe to re-run.
#
# fairseq: the `fairseq-fixed` build (fairseq main with Python 3.11+ fixes). It is built
# against the torch already installed (--no-build-isolation), and without its declared
# dependencies (--no-deps), which would pull torchaudio and a second torch; text tasks never
# need torchaudio. Its real runtime dependencies, and this package with its own, are installed
# first: pip then has no reason to report fairseq's missing torchaudio (pip's check skips
# --no-deps installs), so every ERROR line printed here is a real failure.
# tensorboardX lets fairseq-train --tensorboard-logdir write event files (README: "Watching
# training"); view them with TensorBoard (pip install tensorboard, anywhere).
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q "$TORCH_SPEC" numpy cython
# fairseq's runtime dependencies (its declared ones, less torchaudio)
$PIP install -q "hydra-core==1.3.2" "omegaconf==2.3.0" bitarray sacrebleu regex tqdm cffi \
  scikit-learn scipy packaging tensorboardX
# PYTHONWARNINGS: setuptools warns on every editable install that a folder named like the
# package may shadow it (here it is the package itself)
PYTHONWARNINGS=ignore $PIP install -q -e ".[test]"
if ! "$VENV/bin/python" -c "import fairseq" 2>/dev/null; then
  echo "building fairseq-fixed 0.12.3.1 (about 3 minutes)..."
  $PIP install -q --no-build-isolation --no-deps fairseq-fixed==0.12.3.1
fi
"$VENV/bin/python" -c "import acl_fairseq, fairseq, torch; print('acl-fairseq ready: fairseq', fairseq.__version__, 'torch', torch.__version__)"
