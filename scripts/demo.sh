#!/usr/bin/env bash
# Install opd_cache and run the CPU demo (on-policy distillation of a tiny student).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec opd demo "$@"
