"""Wake-ups (issue #25): `opd run` on bench_trl's workload with this code's bells against a checkout without them.

Each stage of a local store used to find the previous stage's output at its next poll (`poll_seconds`, 0.1 s in
the demo config); with `storage/bells.py` a write wakes the stage waiting on it. This script runs the same
400-step `opd run` (the demo config, evaluator off, bench_trl's workload) from two source trees, alternating,
and prints a table of ratios against the first tree's run:

    git archive <parent> | tar -x -C /tmp/opd-parent      # the code before the bells
    python benchmarks/bench_wakeups.py --baseline-tree /tmp/opd-parent --repeats 2

Each run: time from launch to the last optimizer step (the wall time bench_trl compares), the span of the
steps, the CPU of all processes, the trainer's busy share (compute / (compute + waiting for data)), expired
rows and mean staleness, from the run's own metrics (bench_pipeline.measure). Optional `--set` variants run on
this tree (e.g. shorter polls without bells are the baseline tree with `--baseline-set`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import measure, run_pipeline
from common import markdown_table, write_results

from opd_cache.launch.demo import demo_config, ensure_demo_models

RESULTS = ROOT / "benchmarks" / "results" / "bench_wakeups.json"
KEYS = (
    "time_to_last_step_s",
    "train_span_s",
    "wall_s",
    "cpu_s",
    "load_avg",
    "trainer_busy_share",
    "trainer_data_wait_s",
    "expired_samples",
    "generated_samples",
    "mean_staleness",
)


def run_once(name: str, tree: Path, out: Path, steps: int, sets: list[str]) -> dict:
    """One `opd run` with the code of `tree`: run from there (`python -m` puts the current folder first on
    sys.path, before PYTHONPATH) with the tree on PYTHONPATH too."""
    run_dir = out / name
    run_dir.mkdir(parents=True)
    cfg = demo_config(run_dir, 0, [f"train.max_steps={steps}", "run.evaluate=false", *sets])
    pythonpath = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": pythonpath}
    clock = run_pipeline(name, run_dir, cfg, timeout=120 + steps * 6.0, env=env, cwd=tree)
    if clock["status"] != 0:
        raise SystemExit(f"[{name}] `opd run` failed (status {clock['status']}): see {run_dir / 'logs'}")
    result = {k: measure(run_dir / "store", clock)[k] for k in KEYS}
    # which code ran: only a tree with the bells leaves bells/ in the store
    result["bells_in_store"] = (run_dir / "store" / "bells").is_dir()
    print(f"[{name}] {result['time_to_last_step_s']:.1f} s to the last step, {result['cpu_s']:.0f} CPU-s", flush=True)
    return {"tree": str(tree), "sets": sets, **result}


def table(runs: dict[str, dict], baseline: str) -> str:
    base = runs[baseline]
    rows = []
    for name, r in runs.items():
        rows.append(
            [
                name,
                f"{r['time_to_last_step_s']:.1f}",
                f"{r['time_to_last_step_s'] / base['time_to_last_step_s']:.2f}×",
                f"{r['train_span_s']:.1f}",
                f"{r['cpu_s']:.1f}",
                f"{r['cpu_s'] / base['cpu_s']:.2f}×",
                f"{r['trainer_busy_share']:.2f}",
                f"{r['expired_samples']:,}",
                f"{r['mean_staleness']:.2f}",
                f"{r['load_avg']:.1f}",
                "yes" if r["bells_in_store"] else "no",
            ]
        )
    header = ["run", "to last step (s)", "ratio", "steps (s)", "CPU (s)", "ratio", "trainer busy", "expired"]
    return markdown_table([*header, "mean staleness", "load", "bells/ in the store"], "l" + "r" * 10, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", type=Path, required=True, help="a source tree without the bells")
    parser.add_argument("--baseline-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for this tree's runs")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs (baseline, this tree)")
    parser.add_argument("--out", type=Path, help="folder for the runs (default: a temp folder)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not (args.baseline_tree / "opd_cache" / "__init__.py").exists():
        raise SystemExit(f"--baseline-tree {args.baseline_tree}: no opd_cache package there")

    from rich.console import Console

    ensure_demo_models(Console())
    out = args.out or Path(tempfile.mkdtemp(prefix="opd-bench-wakeups-"))
    runs = {}
    for i in range(1, args.repeats + 1):
        runs[f"polls (baseline tree) {i}"] = run_once(f"A{i}", args.baseline_tree, out, args.steps, args.baseline_set)
        runs[f"bells (this tree) {i}"] = run_once(f"B{i}", ROOT, out, args.steps, args.set)
    print(table(runs, "polls (baseline tree) 1"))
    write_results(args.results, {"steps": args.steps, "runs": runs, "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
