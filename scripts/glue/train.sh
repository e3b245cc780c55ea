#!/usr/bin/env bash
# Fine-tune on one GLUE task with one method, with fairseq's published RoBERTa GLUE
# hyper-parameters: the fairseq-train command(s) that acl_fairseq/experiment/recipe.py builds
# (python -m acl_fairseq.cli.glue, with this checkout's package).
#
# Usage: scripts/glue/train.sh TASK METHOD [extra fairseq-train args...] [--dry-run]
#   PRETRAINED=roberta.base/model.pt DATA_DIR=glue-bin scripts/glue/train.sh RTE acl
#   scripts/glue/train.sh RTE acl_cl --dry-run   # prints the commands, runs nothing
#   scripts/glue/train.sh --help                 # tasks, methods and settings
#
# PYTHON: the Python with fairseq and this package (default: the one next to FAIRSEQ_TRAIN,
# else python3).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-}
if [[ -z $python ]]; then
  python=python3
  fairseq_bin=$(command -v "${FAIRSEQ_TRAIN:-fairseq-train}" || true)
  if [[ -n $fairseq_bin && -x $(dirname "$fairseq_bin")/python ]]; then
    python=$(dirname "$fairseq_bin")/python
  fi
fi
if ! "$python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("fairseq") is None)' \
  2>/dev/null; then
  echo "${0##*/}: error: no fairseq in PYTHON=$python: activate the virtual environment" \
    "(scripts/install.sh creates it) or set PYTHON" >&2
  exit 2
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
exec "$python" -m acl_fairseq.cli.glue "$@"
