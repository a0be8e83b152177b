#!/usr/bin/env bash
# Install opd_cache on a fresh machine: the CPU torch wheel first (any other
# version would pull a multi-GB CUDA build), then the project.
#   bash scripts/setup.sh        # the package and its runtime dependencies
#   bash scripts/setup.sh dev    # plus the test / benchmark extras
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=""
[ "${1:-}" = "dev" ] && extras="[dev]"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".${extras}"
