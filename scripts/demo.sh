#!/usr/bin/env bash
# Install opd_cache and run the CPU demo (on-policy distillation of a tiny student).
# PYTHON picks the interpreter (default python3), as in scripts/setup.sh; the demo runs with that same one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m opd_cache.cli demo "$@"
