#!/usr/bin/env bash
# Install everything the tests need, then run the test suite (CPU, a few minutes).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec "${PYTHON:-python3}" -m pytest -q "$@"
