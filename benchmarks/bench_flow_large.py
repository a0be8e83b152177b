"""~100M parameters, a version per step: does admission by schedule keep every sample trained (issue #25)?

    python benchmarks/bench_flow_large.py --out /tmp/flow_large/B1 --label B1            # this checkout
    python benchmarks/bench_flow_large.py --out /tmp/flow_large/A1 --label A1 --code /path/to/parent-checkout
    python benchmarks/bench_flow_large.py --table A1 B1 ...        # the runs recorded in the results JSON

The case where count pacing expired the most (the issue measured 168 and 360 samples sampled and scored to
train 128 on a real 135M pair): slow optimizer steps and slow policy reloads, with a version published after
every step and `max_staleness` 2, so the window is three steps of several seconds each. The configuration is
benchmarks/configs/flow_100m.yaml (8 samples per step, 16 steps, one thread per stage, no evaluator); this script
builds its models from transformers configs (random init, the shipped character tokenizer; nothing downloaded):

  student  Llama, hidden 768, 12 layers, 12 heads, FFN 2560, tied embeddings: ~99M parameters
  teacher  the same with 16 layers: ~132M parameters

saves them under `--models` (default: next to --out; reused when present, never committed), runs `opd run` on a
fresh store in --out with the code of `--code` (PYTHONPATH; default this checkout: an A/B against a parent
commit runs its worktree), and reads the store: rows sampled, scored, trained, expired; the expired rows whose
shard the teacher had scored (work thrown away: the target is 0); the shards annotate skipped as expired
unscored; the trainer's busy share, the median step, publication and reload times, and the wall time. The load
average (1 min) is recorded at the start and the end of the run. Each run adds its record under its --label to
benchmarks/results/bench_flow_large.json and prints the table of every run recorded there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import Clock, child_env
from common import markdown_table, write_results

from opd_cache.cli.plan import spec_from_config
from opd_cache.config import load_config
from opd_cache.flow.calibrate import calibrate
from opd_cache.flow.simulate import Service
from opd_cache.observe.metrics import read_metrics
from opd_cache.storage import layout
from opd_cache.storage.store import Store

CONFIG = ROOT / "benchmarks" / "configs" / "flow_100m.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "bench_flow_large.json"
TOKENIZER = ROOT / "data" / "tokenizer"
# the two models: Llama blocks of GPT-2-small width; the teacher is deeper (slower to score, as a real one)
MODELS = {
    "student": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2560, seed=1),
    "teacher": dict(hidden_size=768, num_layers=16, num_heads=12, intermediate_size=2560, seed=2),
}


def build_models(folder: Path) -> dict[str, int]:
    """Save the student and teacher under `folder` (kept if already there); returns their parameter counts."""
    from opd_cache.models import build_tiny_model, save_causal_lm
    from opd_cache.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER)
    params = {}
    for name, shape in MODELS.items():
        out = folder / name
        marker = out / "bench_flow_large.json"  # the shape it was built with: rebuilt if the table above changed
        if marker.exists() and json.loads(marker.read_text()) == shape:
            params[name] = json.loads((out / "params.json").read_text())["params"]
            continue
        print(f"building the {name}: {shape}", flush=True)
        model = build_tiny_model(
            "llama",
            len(tokenizer),
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **shape,
        )
        save_causal_lm(model, tokenizer, out)
        params[name] = sum(p.numel() for p in model.parameters())
        (out / "params.json").write_text(json.dumps({"params": params[name]}) + "\n")
        marker.write_text(json.dumps(shape) + "\n")
        del model
    return params


def run_opd(out: Path, models: Path, code: Path, sets: list[str], timeout: float) -> dict:
    """`opd run` of the benchmark's configuration on a fresh store in `out`, with the code of `code`."""
    argv = [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(CONFIG), "--quiet"]
    for setting in [
        f"store.uri={out / 'store'}",
        f"rollout.student={models / 'student'}",
        f"annotate.teacher={models / 'teacher'}",
        *sets,
    ]:
        argv += ["--set", setting]
    env = {**child_env(1), "PYTHONPATH": str(code)}
    print(f"[{out.name}] PYTHONPATH={code} {' '.join(argv[1:])}", flush=True)
    load_start = os.getloadavg()[0]
    with Clock() as clock, open(out / "run.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)  # the supervisor stops its stages on SIGTERM
            status = proc.wait(60)
    record = clock.record(status, argv[1:])
    record.update(load_start=load_start, load_end=os.getloadavg()[0])
    if status != 0:
        raise SystemExit(f"opd run exited {status}: see {out / 'run.log'}")
    return record


def expired_rows_by_shard(store_dir: Path) -> dict[str, int]:
    """The trainer's ledger (train/skipped/<shard>.jsonl): rows it expired, per shard."""
    expired = {}
    for ledger in sorted((store_dir / layout.TRAIN_SKIPPED).glob("*.jsonl")):
        lines = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
        rows = sum(1 for line in lines if line.get("reason") == "expired")
        if rows:
            expired[layout.skipped_shard(ledger.name)] = rows
    return expired


def run_figures(out: Path) -> dict:
    """What the run in `out` measured (its store's metrics and the trainer's ledger)."""
    metrics = read_metrics(Store(str(out / "store")))
    one = Service(per_row=1.0)
    calibration = calibrate(metrics, spec_from_config(load_config(out / "logs" / "config.yaml"), one, one, one))
    measured, spec = calibration.measured, calibration.spec
    annotate = [r for name, recs in metrics.items() if name.startswith("annotate-") for r in recs]
    scored = {r["shard_id"]: r["rows"] for r in annotate if r.get("event") == "annotated"}
    skipped = [r for r in annotate if r.get("event") == "skipped_expired"]
    expired = expired_rows_by_shard(out / "store")
    steps = [r for r in metrics["train-0"] if "step_time_s" in r]
    return {
        "steps": measured.steps,
        "sampled": measured.generated,
        "scored": sum(scored.values()),
        "trained": measured.trained,
        "expired": sum(expired.values()),
        "scored_then_expired": sum(rows for shard, rows in expired.items() if shard in scored),
        "skipped_expired_shards": len(skipped),
        "skipped_expired_rows": sum(r["rows"] for r in skipped),
        "sampled_per_trained": measured.generated_per_trained,
        "busy": measured.busy_share,
        "span_s": measured.span_s,
        "median_step_s": statistics.median(r["step_time_s"] for r in steps),
        "after_step_s": spec.train_overhead_s,  # publication and progress after each step's compute
        "reload_s": spec.reload_latency_s,
        "mean_staleness": measured.mean_staleness,
    }


def table(runs: dict[str, dict]) -> str:
    header = [
        "run",
        "code",
        "settings beyond the config",
        "load start → end",
        "wall (s)",
        "first batch → last step (s)",
        "sampled",
        "scored",
        "trained",
        "expired",
        "scored, then expired",
        "skipped expired (rows)",
        "sampled / trained",
        "trainer busy",
        "median step (s)",
        "after a step (s)",
        "reload (s)",
    ]
    rows = []
    for label, r in runs.items():
        f = r["figures"]
        rows.append(
            [
                label,
                r["code_label"],
                ", ".join(setting.split(" (")[0] for setting in r["sets"]) or "—",
                f"{r['load_start']:.1f} → {r['load_end']:.1f}",
                f"{r['wall_s']:.0f}",
                f"{f['span_s']:.0f}",
                f["sampled"],
                f["scored"],
                f["trained"],
                f["expired"],
                f["scored_then_expired"],
                f["skipped_expired_rows"],
                f"{f['sampled_per_trained']:.3f}",
                f"{f['busy']:.3f}",
                f"{f['median_step_s']:.2f}",
                f"{f['after_step_s']:.2f}",
                f"{f['reload_s']:.2f}",
            ]
        )
    return markdown_table(header, "llll" + "r" * (len(header) - 4), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="scratch folder of this run (a fresh store; logs)")
    parser.add_argument("--label", help="the run's name in the table and the results JSON (default: --out's name)")
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose opd runs (default: this one)")
    parser.add_argument("--code-label", help="what --code is, in the table (default: its git commit)")
    parser.add_argument("--models", type=Path, help="where the models are built (default: --out's parent/models)")
    parser.add_argument("--set", action="append", default=[], help="an extra `opd run --set` (e.g. for old code)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is stopped")
    parser.add_argument("--table", nargs="*", help="print these recorded runs (all with no name) and exit")
    args = parser.parse_args()

    recorded = json.loads(RESULTS.read_text())["runs"] if RESULTS.exists() else {}
    if args.table is not None:
        print(table({k: recorded[k] for k in args.table or recorded}))
        return
    if args.out is None:
        parser.error("--out is required (or --table)")
    out = args.out.resolve()
    if (out / "store").exists():
        raise SystemExit(f"{out / 'store'} exists: give a fresh --out")
    out.mkdir(parents=True, exist_ok=True)
    models = (args.models or out.parent / "models").resolve()
    params = build_models(models)
    commit = subprocess.run(
        ["git", "-C", str(args.code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    record = run_opd(out, models, args.code.resolve(), args.set, args.timeout)
    record.update(
        code=str(args.code.resolve()),
        commit=commit,
        code_label=args.code_label or commit,
        params=params,
        sets=args.set,
        figures=run_figures(out),
        finished=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    recorded[args.label or out.name] = record
    print(table(recorded))
    write_results(RESULTS, {"config": str(CONFIG.relative_to(ROOT)), "runs": recorded})


if __name__ == "__main__":
    main()
