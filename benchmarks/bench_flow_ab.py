"""Admission by schedule vs the parent's count pacing (issue #25 phase 2): the figures of finished demo runs.

    git worktree add /tmp/base <parent commit>                          # A: the parent, B: this checkout
    PYTHONPATH=/tmp/base opd demo --out /tmp/A1; PYTHONPATH=. opd demo --out /tmp/B1   # alternate, note `uptime`
    python benchmarks/bench_flow_ab.py /tmp/A1 /tmp/B1 ...              # a Markdown table, one row per run

Per run (a demo's --out folder, or an `opd run` store's parent with logs/): wall time (the demo's `seconds`, else
the metrics' span), the span from the first rollout batch to the last step (flow/calibrate.py), the trainer's busy
share, expired rows per trained row, rows sampled per trained row, the last step's wait for data, the longest
wait of the last 10 steps, and the end of run: the last step's record to the last stage log written (the stages
exit then).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table

from opd_cache.cli.plan import spec_from_config
from opd_cache.config import load_config
from opd_cache.flow.calibrate import calibrate
from opd_cache.flow.simulate import Service
from opd_cache.observe.metrics import read_metrics
from opd_cache.storage.store import Store


def run_figures(out: Path) -> dict:
    store = Store(str(out / "store"))
    metrics = read_metrics(store)
    one = Service(per_row=1.0)
    measured = calibrate(metrics, spec_from_config(load_config(out / "logs" / "config.yaml"), one, one, one)).measured
    steps = sorted((r for r in metrics["train-0"] if "step_time_s" in r), key=lambda r: r["step"])
    logs = [p for p in (out / "logs").glob("*.log") if not p.name.startswith("eval")]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return {
        "run": out.name,
        "wall_s": summary.get("seconds", measured.span_s),
        "span_s": measured.span_s,
        "steps": measured.steps,
        "busy": measured.busy_share,
        "expired/trained": measured.expired_share,
        "sampled/trained": measured.generated_per_trained,
        "last_wait_s": steps[-1]["data_wait_s"],
        "max_wait_last10_s": max(r["data_wait_s"] for r in steps[-10:]),
        "end_of_run_s": max(p.stat().st_mtime for p in logs) - steps[-1]["time"],
    }


def main() -> None:
    rows = [run_figures(Path(arg)) for arg in sys.argv[1:]]
    header = list(rows[0])
    fmt = {"busy": "{:.3f}", "expired/trained": "{:.4f}", "sampled/trained": "{:.3f}"}
    table = [[fmt.get(k, "{:.1f}" if isinstance(r[k], float) else "{}").format(r[k]) for k in header] for r in rows]
    print(markdown_table(header, "l" + "r" * (len(header) - 1), table))


if __name__ == "__main__":
    main()
