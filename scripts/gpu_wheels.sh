#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels the GPU check installs on a GPU machine without network:
#
#   bash scripts/gpu_wheels.sh            # into .gpu_wheels/ (git-ignored), then prints the sizes
#   bash scripts/gpu_wheels.sh DIR        # into DIR
#
# The list is benchmarks/gpu_wheels.txt (pinned; why each is there: its comments). Only wheels for CPython 3.12
# on manylinux x86_64, no dependencies resolved (the list is the closure), no CUDA builds, no torch. The lent
# machine copies the working tree plus the carried folder, 64 MiB in all: this prints the wheels' total and the
# repository's (tracked + untracked-not-ignored files) and fails when together they leave less than 8 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu_wheels}
python=${PYTHON:-python3}
mkdir -p "$dest"

mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' benchmarks/gpu_wheels.txt | awk 'NF')
echo "downloading ${#pins[@]} wheels into $dest/ (CPython 3.12, manylinux x86_64)"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --dest "$dest" "${pins[@]}"

# Wheels of pins that left the list since an earlier download would travel too: remove them.
"$python" benchmarks/gpu_deps.py prune-wheels --wheels "$dest"

limit=$((64 * 1024 * 1024))
wheels_bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- | tail -1 | cut -f1)
total=$((wheels_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "wheels: $(ls "$dest"/*.whl | wc -l) files, $(mib "$wheels_bytes")"
echo "repository (tracked + untracked, not ignored): $(mib "$tree_bytes")"
echo "together: $(mib "$total") of the 64 MiB a device run carries; $(mib $((limit - total))) left"
if ((total > limit - 8 * 1024 * 1024)); then
  echo "error: less than 8 MiB would be left under the 64 MiB limit; trim benchmarks/gpu_wheels.txt" >&2
  exit 1
fi
