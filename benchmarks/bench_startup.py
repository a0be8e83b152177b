"""Start-up of `opd run` (issue #14, item 5): seconds from the command to each stage's first result.

    python benchmarks/bench_startup.py                          # this checkout, 3 rounds
    python benchmarks/bench_startup.py --before /tmp/old-tree   # and another checkout, alternating rounds

`opd run` on the demo configuration (examples/arithmetic_cpu/config.yaml, 5
steps, a fresh store, no evaluator), timed from the command's start to: the
first stage process started (the supervisor's own imports and set-up), run.json (rollout's imports and model load), the first rollout shard, the
first annotated part and the first trainer step (the time in its metrics
record). With `--before TREE` the same command runs from that checkout too
(its own code on PYTHONPATH, the same config and models), the two sides
alternating round by round (before, after; after, before; ...) to cancel
machine drift; reported: the median of each first over the rounds, the
per-round "after / before" of the first trainer step, and the load average
at the start and end of every run.

Results: a table on stdout and benchmarks/results/bench_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, write_results

RESULTS = ROOT / "benchmarks" / "results" / "bench_startup.json"
DEMO = ROOT / "examples" / "arithmetic_cpu" / "config.yaml"
FIRSTS = ("stages_started", "run_json", "rollout_shard", "annotated_part", "first_step")


def measure_startup(tree: Path, workdir: Path, steps: int = 5) -> dict:
    """Seconds from `opd run` (the code of `tree`) to each first: run.json, rollout shard, annotated part, step."""
    root = workdir / "store"
    shutil.rmtree(workdir, ignore_errors=True)
    cmd = [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(DEMO), "--store", str(root), "--quiet"]
    cmd += ["--logs", str(workdir / "logs"), "--set", f"train.max_steps={steps}", "--set", "run.evaluate=false"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    probes = {
        "stages_started": lambda: any((workdir / "logs").glob("*.log")),  # the supervisor opens a stage's log
        "run_json": lambda: (root / "run.json").exists(),
        "rollout_shard": lambda: any((root / "rollouts").glob("*/*.arrow")),
        "annotated_part": lambda: any((root / "annotated").glob("*/*/*.arrow")),
        "first_step": lambda: (
            (root / "metrics" / "train-0.jsonl").exists()
            and '"step"' in (root / "metrics" / "train-0.jsonl").read_text()
        ),
    }
    firsts: dict[str, float] = {"load_start": os.getloadavg()[0]}
    tic = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    while proc.poll() is None and len(firsts) < len(probes) + 1:
        for name, probe in probes.items():
            if name not in firsts and probe():
                firsts[name] = round(time.time() - tic, 2)
        time.sleep(0.05)
    code = proc.wait(timeout=600)
    if code != 0:
        raise SystemExit(f"opd run from {tree} exited with status {code}; logs in {workdir / 'logs'}")
    first = json.loads((root / "metrics" / "train-0.jsonl").read_text().splitlines()[0])
    firsts["first_step"] = round(first["time"] - tic, 2)  # the record's own time: the flush may come later
    firsts["wall"] = round(time.time() - tic, 2)
    firsts["load_end"] = os.getloadavg()[0]
    return firsts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="another checkout to compare with (e.g. the previous commit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    sides = {"after": ROOT} if args.before is None else {"before": args.before.resolve(), "after": ROOT}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    workdir = Path(tempfile.mkdtemp(prefix="opd-bench-startup-"))
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                runs[side].append(measure_startup(sides[side], workdir / side, args.steps))
                print(f"round {r + 1}/{args.rounds} {side:<6} {json.dumps(runs[side][-1])}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = {side: {k: statistics.median(run[k] for run in runs[side]) for k in (*FIRSTS, "wall")} for side in sides}
    print(f"\n{'side':<7}" + "".join(f"{k:>15}" for k in (*FIRSTS, "wall")) + "   (seconds, median)")
    for side, row in table.items():
        print(f"{side:<7}" + "".join(f"{row[k]:>15.1f}" for k in (*FIRSTS, "wall")))
    ratios = None
    if "before" in runs:
        ratios = [round(a["first_step"] / b["first_step"], 3) for a, b in zip(runs["after"], runs["before"])]
        print(f"\nfirst trainer step, after / before per round: {ratios} (median {statistics.median(ratios):.3f})")
    loads = [x for side in runs.values() for run in side for x in (run["load_start"], run["load_end"])]
    print(f"load average (1 min) at the runs' starts and ends: {min(loads):.2f}-{max(loads):.2f}")
    write_results(
        RESULTS,
        {
            "config": str(DEMO.relative_to(ROOT)),
            "steps": args.steps,
            "rounds": args.rounds,
            "sides": {side: str(path) for side, path in sides.items()},
            "median_s": table,
            "first_step_after_over_before": ratios,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
