"""`opd plan --from-store` against the run it measured: predicted vs measured wall time, busy share, expired share.

    python -m opd_cache.cli demo --out /tmp/flow-demo            # or bench_trl's opd run, or any finished run
    python benchmarks/bench_plan.py --store /tmp/flow-demo/store  # config: the logs/config.yaml opd run wrote
    python benchmarks/bench_plan.py --store S --pacing schedule   # a run made with admission by schedule (#25)

The model's rates, spreads and latencies are calibrated from the store's own metrics (opd_cache/flow/calibrate.py),
its settings from the run's configuration; then `--seeds` simulated runs of the pacing the measured run used are
compared with it. The wall time compared is the span the store's metrics cover, from the first rollout batch's
start to the last step's end (start-up before the first batch is not in the metrics). Targets (issue #25): within
15% (relative) for the wall time, 3 points (absolute) for the busy and expired shares. The simulated runs of a
count-paced pipeline spread widely (the end-of-run stall and the stalls of late shards come or not with the
draw), so the table gives the range of the seeds too: a measured value inside the range but far from the mean
says the measurement was one draw among many, not that the model is biased.

Results: a Markdown table on stdout and benchmarks/results/bench_plan.json (`--results` to write elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, write_results

from opd_cache.cli.plan import run_config_of_store, spec_from_config
from opd_cache.config import load_config
from opd_cache.flow.calibrate import calibrate
from opd_cache.flow.simulate import Service, simulate
from opd_cache.observe.metrics import read_metrics
from opd_cache.storage.store import Store

RESULTS = ROOT / "benchmarks" / "results" / "bench_plan.json"
WALL_TOLERANCE = 0.15  # relative
SHARE_TOLERANCE = 0.03  # absolute


def compare(store_uri: str, config: Path | None, pacing: str, seeds: int, cores: float | None = None) -> dict:
    cfg = load_config(config)
    one = Service(per_row=1.0)
    calibration = calibrate(read_metrics(Store(store_uri)), spec_from_config(cfg, one, one, one), cores=cores)
    t0 = time.process_time()
    runs = [simulate(replace(calibration.spec, seed=seed), pacing) for seed in range(seeds)]
    cpu = time.process_time() - t0
    other = "schedule" if pacing == "count" else "count"
    others = [simulate(replace(calibration.spec, seed=seed), other) for seed in range(seeds)]
    m = calibration.measured

    def mean(rs, key):
        return sum(getattr(r, key) for r in rs) / len(rs)

    rows = []
    checks = {}
    for label, key, measured, relative in (
        ("wall time, first batch → last step (s)", "wall_s", m.span_s, True),
        ("trainer busy share", "busy_share", m.busy_share, False),
        ("expired / trained", "expired_share", m.expired_share, False),
        ("mean staleness", "mean_staleness", m.mean_staleness, None),
        ("sampled / trained", "generated_per_trained", m.generated_per_trained, None),
        ("last step's wait (s)", "last_step_wait_s", m.last_step_wait_s, None),
    ):
        predicted = mean(runs, key)
        values = [getattr(r, key) for r in runs]
        if relative is None:
            deviation, ok = "", ""
        elif relative:
            dev = predicted / measured - 1
            deviation, ok = f"{dev:+.0%}", abs(dev) <= WALL_TOLERANCE
        else:
            dev = predicted - measured
            deviation, ok = f"{dev * 100:+.1f} pts", abs(dev) <= SHARE_TOLERANCE
        if ok != "":
            checks[key] = ok
        fmt = ".0f" if key == "wall_s" else ".3f"
        rows.append(
            [
                label,
                format(measured, fmt),
                format(predicted, fmt),
                f"{format(min(values), fmt)}–{format(max(values), fmt)}",
                deviation,
                {True: "✓", False: "✗", "": ""}[ok],
                format(mean(others, key), fmt),
            ]
        )
    return {
        "store": store_uri,
        "config": str(config) if config else None,
        "pacing": pacing,
        "seeds": seeds,
        "load_avg": os.getloadavg(),
        "measured": asdict(m),
        "spec": {k: v for k, v in asdict(calibration.spec).items() if k not in ("rollout", "annotate", "train")},
        "rates_s_per_row": {s: getattr(calibration.spec, s).per_row for s in ("rollout", "annotate", "train")},
        "predicted": [asdict(r) for r in runs],
        "other_pacing": [asdict(r) for r in others],
        "simulation_cpu_s": cpu,
        "within_target": checks,
        "table": markdown_table(
            [
                "",
                "measured",
                f"predicted ({pacing}, mean)",
                "range of the seeds",
                "deviation",
                "target",
                f"{other} (predicted)",
            ],
            "lrrrrlr",
            rows,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True, help="a finished run's store (opd demo, bench_trl, opd run)")
    parser.add_argument("--config", type=Path, default=None, help="its configuration (default: logs/config.yaml)")
    parser.add_argument("--pacing", choices=("count", "schedule"), default="count", help="how the measured run paced")
    parser.add_argument("--seeds", type=int, default=10, help="simulated runs averaged")
    parser.add_argument(
        "--cores", type=float, default=None, help="the run's stages shared this many cores (opd plan --cores)"
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = args.config or run_config_of_store(args.store)
    if config is None:
        sys.exit(f"--config: no logs/config.yaml beside {args.store}; give the run's configuration")
    result = compare(args.store, config, args.pacing, args.seeds, args.cores)
    print(f"opd plan vs {args.store} ({args.pacing} pacing, {args.seeds} simulated runs, load {result['load_avg']})")
    print(result["table"])
    print(f"\nsimulation: {result['simulation_cpu_s']:.1f} CPU-s for {args.seeds} runs")
    write_results(args.results, result)


if __name__ == "__main__":
    main()
