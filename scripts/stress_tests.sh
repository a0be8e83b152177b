#!/usr/bin/env bash
# The test suite N times beside a CPU-bound load: tests that pass alone and fail on a busy machine show up here.
#
#   bash scripts/stress_tests.sh                        # the default suite 5 times, one busy loop per core
#   bash scripts/stress_tests.sh -n 10 tests/test_leases.py -k interrupted
#   bash scripts/stress_tests.sh --load 4 --logs runs/stress -m slow
#
# Options (before the pytest arguments): -n RUNS (default 5), --load PROCESSES (busy loops; default: one per core,
# `nproc`), --logs DIR (each run's pytest output, run-1.log ...; default a temporary folder, kept and named at the
# end). Everything else goes to pytest. It prints one line per run (passed / FAILED and the failing test ids, with
# its time and the machine's load) and exits non-zero when any run failed. The load stops when the script ends,
# Ctrl-C included. Install first (`bash scripts/test.sh` once, or `bash scripts/setup.sh dev`).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=5
load=$(nproc 2>/dev/null || echo 2)
logs=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) runs="$2"; shift 2 ;;
    --load) load="$2"; shift 2 ;;
    --logs) logs="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "stress_tests.sh: -n needs a positive number of runs, not '$runs'" >&2; exit 2; }
[[ "$load" =~ ^[0-9]+$ ]] || { echo "stress_tests.sh: --load needs a number of processes, not '$load'" >&2; exit 2; }
python=${PYTHON:-python3}
if [[ -z "$logs" ]]; then
  logs=$(mktemp -d "${TMPDIR:-/tmp}/opd-stress.XXXXXX")
fi
mkdir -p "$logs"

burners=()
stop_load() {
  for pid in "${burners[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${burners[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  burners=()
}
trap stop_load EXIT
trap 'echo "stress_tests.sh: interrupted" >&2; exit 130' INT TERM

for _ in $(seq 1 "$load"); do
  "$python" -c 'while True: pass' &  # one core's worth of pure CPU work
  burners+=("$!")
done
echo "load: $load busy loop(s) on $(nproc 2>/dev/null || echo '?') core(s); pytest ${*:-(the default suite)}; logs in $logs"

failed_runs=0
for run in $(seq 1 "$runs"); do
  log="$logs/run-$run.log"
  start=$(date +%s)
  status=0
  # -rfE: the ids of failed and erroring tests in the short summary, which is what this script reports
  "$python" -m pytest -q -p no:cacheprovider -rfE "$@" >"$log" 2>&1 || status=$?
  seconds=$(($(date +%s) - start))
  loadavg=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')
  summary=$(tail -n 1 "$log")
  if [[ $status -eq 0 ]]; then
    echo "run $run/$runs: passed in ${seconds} s (load $loadavg): $summary"
  else
    failed_runs=$((failed_runs + 1))
    echo "run $run/$runs: FAILED (exit $status) in ${seconds} s (load $loadavg): $summary"
    grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /' || echo "    (no test ids: see $log)"
  fi
done
echo "$((runs - failed_runs)) of $runs runs passed; logs in $logs"
[[ $failed_runs -eq 0 ]]
