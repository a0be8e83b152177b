#!/usr/bin/env bash
# The GPU check: one command that runs opd_cache's CUDA paths and writes one report (docs/gpu.md).
#
#   bash scripts/gpu_check.sh                 # on a CUDA machine: install offline, test, measure (<= 8 minutes)
#   bash scripts/gpu_check.sh --dry-run       # on any machine: check the wheel list, that every step's command
#                                             # exists and parses, and run the CPU-possible parts at toy size
# Options: --out DIR (default $OUT, else runs/gpu_check), --wheels DIR (default .gpu_wheels),
#          --budget SECONDS (default 470; dry run 900, for a loaded CI machine), --steps a,b,... (a subset,
#          by name), --keep (keep the scratch folder: models, stores).
#
# Writes DIR/gpu_check.json, DIR/gpu_check.md (one table: each step and item, passed / failed / skipped with the
# reason, each figure) and DIR/gpu_check.log (every step's output), rebuilt after every step, so a check that is
# stopped half-way still leaves its report. Each step runs in its own subshell under `timeout`: a failure is
# recorded and the next step runs; a step that would start with less time left than it needs is skipped (the
# budget). Exit status 1 when a step failed, else 0. Steps, in order (the budget runs out at the end first):
#   env            the machine and versions
#   install        pip install --no-index --find-links WHEELS: the runtime dependencies the image lacks, the
#                  project (editable); dry run: the pinned list and the wheels folder are checked, nothing installed
#   imports        every opd_cache module imports; pyproject's pins vs the installed versions
#   tests-cuda     pytest -m cuda (dry run: --collect-only)
#   loss           fused vs materialised loss, V = 151,936 (benchmarks/gpu_loss.py)
#   engines        bf16 rollout / annotate parity, attention, publish + reload, a 0.5B student (gpu_engines.py)
#   train          trainer tokens/s and MFU, one GPU (benchmarks/gpu_train.py)
#   train-fsdp     the same under torchrun --nproc_per_node 1 over NCCL with FSDP2 (a world of one)
#   tests-gpu      the default suite's loss, trainer and HF-engine tests, on a machine with CUDA (dry run: collect)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

dry_run=0 out=${OUT:-runs/gpu_check} wheels=.gpu_wheels budget="" only="" keep=0
while (($#)); do
  case $1 in
    --dry-run) dry_run=1 ;;
    --out) out=$2; shift ;;
    --wheels) wheels=$2; shift ;;
    --budget) budget=$2; shift ;;
    --steps) only=$2; shift ;;
    --keep) keep=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
budget=${budget:-$((dry_run ? 900 : 470))}
python=${PYTHON:-python3}
command -v "$python" > /dev/null || { echo "gpu_check.sh: $python not found" >&2; exit 2; }
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
mkdir -p "$work/steps" "$work/logs" "$work/site"
# The project from this checkout; wheels pip cannot install are extracted into $work/site (gpu_deps.py).
export PYTHONPATH="$root:$work/site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1
start=$(date +%s)
printf '{"started": %s, "dry_run": %s, "budget_s": %s, "root": "%s"}\n' "$start" \
  "$( ((dry_run)) && echo true || echo false)" "$budget" "$root" > "$work/meta.json"

report() { "$python" benchmarks/gpu_report.py --work "$work" --out "$out" "$@"; }
finish() {
  report --print || echo "gpu_check.sh: the report could not be built (see $work)" >&2
  ((keep)) || rm -rf "$work"
}
trap 'echo "gpu_check.sh: interrupted" >&2; finish; exit 130' INT TERM

index=0
# run_step NAME LIMIT MIN_SECONDS COMMAND...: COMMAND in a subshell under `timeout` (at most LIMIT seconds and
# what is left of the budget), its output in logs/NAME.log, its outcome in steps/NN-NAME.status.
run_step() {
  local name=$1 limit=$2 need=$3
  shift 3
  index=$((index + 1))
  local status_file
  status_file=$(printf '%s/steps/%02d-%s.status' "$work" "$index" "$name")
  if [[ -n $only && ",$only," != *",$name,"* ]]; then
    return 0
  fi
  local left=$((budget - ($(date +%s) - start) - 10)) # 10 s kept for the report
  if ((left < need)); then
    printf 'status=skipped\nreason=%s s of the %s s budget left, the step needs %s\ncommand=%s\n' \
      "$((left + 10))" "$budget" "$need" "$*" > "$status_file"
    echo "== $name: skipped (budget)"
    report
    return 0
  fi
  # the dry run's toy steps take 10-50 s on a shared 2-core machine, 2-3x that under CI's load: a generous limit
  ((dry_run && limit < 240)) && limit=240
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit} s): $*"
  printf 'status=running\nlimit=%s\ncommand=%s\n' "$limit" "$*" > "$status_file"
  report # a check killed during this step still reports it (as still running)
  local t0=$SECONDS rc
  (export GPU_CHECK_LIMIT_S=$limit && exec timeout --kill-after=10 "$limit" "$@") > "$work/logs/$name.log" 2>&1
  rc=$?
  local reason=""
  if ((rc == 124 || rc == 137)); then
    reason="timed out after $limit s"
  elif ((rc != 0)); then
    reason="exit $rc"
  fi
  printf 'status=done\nrc=%s\nseconds=%s\nlimit=%s\nreason=%s\ncommand=%s\n' \
    "$rc" "$((SECONDS - t0))" "$limit" "$reason" "$*" > "$status_file"
  echo "   $name: ${reason:-ok} ($((SECONDS - t0)) s)"
  report
}

step() { # step NAME [ARGS...]: a step of benchmarks/gpu_check.py, recording into steps/NN-NAME.json
  local name=$1
  shift
  local record
  record=$(printf '%s/steps/%02d-%s.json' "$work" "$((index + 1))" "$name")
  echo "$python benchmarks/gpu_check.py $* --record $record --work $work$( ((dry_run)) && echo ' --toy')"
}

# shellcheck disable=SC2046 # the step lines split into words on purpose (no spaces in the paths)
{
  run_step env 60 5 $(step env env)
  if ((dry_run)); then
    run_step install 60 5 bash -c "bash -n scripts/gpu_check.sh && bash -n scripts/gpu_wheels.sh &&
      $python -m py_compile benchmarks/gpu_*.py tests/test_cuda.py &&
      $python benchmarks/gpu_deps.py check --wheels '$wheels' --record '$work/steps/02-install.json'"
  else
    run_step install 120 10 "$python" benchmarks/gpu_deps.py install --wheels "$wheels" --site "$work/site" \
      --record "$work/steps/02-install.json"
  fi
  run_step imports 60 10 $(step imports imports)
  if ((dry_run)); then
    run_step tests-cuda 60 10 $(step tests-cuda tests --select cuda --collect-only)
  else
    run_step tests-cuda 150 30 $(step tests-cuda tests --select cuda --deadline-s 140)
  fi
  run_step loss 90 20 $(step loss loss)
  run_step engines 150 30 $(step engines engines)
  run_step train 120 30 $(step train train)
  # torchrun: one process, WORLD_SIZE=1; the step itself brings up NCCL (gloo in the dry run) and FSDP2
  fsdp=$(step train-fsdp train-fsdp)
  run_step train-fsdp 120 30 "$python" -m torch.distributed.run --standalone --nproc_per_node 1 ${fsdp#"$python" }
  if ((dry_run)); then
    run_step tests-gpu 60 10 $(step tests-gpu tests --select gpu-default --collect-only)
  else
    run_step tests-gpu 180 30 $(step tests-gpu tests --select gpu-default --deadline-s 170)
  fi
}

finish
trap - INT TERM
summary=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["summary_line"])' "$out/gpu_check.json" 2> /dev/null)
echo "gpu_check.sh: ${summary:-no report}; report in $out/gpu_check.md, $out/gpu_check.json, $out/gpu_check.log"
"$python" -c 'import json,sys; sys.exit(1 if json.load(open(sys.argv[1]))["summary"]["failed"] else 0)' "$out/gpu_check.json"
