#!/usr/bin/env bash
# fairseq's own tests, as stock fairseq and with the plugin loaded, compared per test (a table;
# exit status 1 when anything is broken by the plugin). Not part of CI: 5-6 minutes a pass.
# Usage: scripts/fairseq_conformance.sh FAIRSEQ_SRC [--as-users-run]
#   FAIRSEQ_SRC: a checkout of the fairseq repository (docs/usage.md, "Tests")
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
exec "${PYTHON:-$ROOT/.venv/bin/python}" "$ROOT/scripts/fairseq_conformance.py" "$@"
