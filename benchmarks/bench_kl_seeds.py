"""Held-out KL after `opd run` on bench_trl's workload, over seeds and settings (issue #25, session 8).

bench_trl.py compares one opd run with one TRL run; at 400 steps the held-out KL sits where the student leaves
its 0.3–0.4 plateau, and one run of the same seed and settings measured anywhere from 0.029 to 0.086. This script
runs only the opd side, for several seeds and setting variants, so that settings are compared over seeds:

    python benchmarks/bench_kl_seeds.py --seeds 0 1 2 --variant "" --variant "annotate.top_k=32"

Each variant is a comma-separated list of `opd run --set` overrides ("" = the demo config). Each run: the demo
config with `train.max_steps` (400) and the evaluator off, `opd run` as bench_trl runs it, then the project's
evaluator on the final policy (greedy answers to the 200 held-out prompts; KL(teacher ‖ student) per token over
the full vocabulary), as bench_trl evaluates both sides. Prints one row per run and a median per variant, and
appends every run to --results (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import measure, run_pipeline

from opd_cache.evaluate import evaluate_model, first_prompts, load_teacher, resolve_model
from opd_cache.launch.demo import demo_config, ensure_demo_models
from opd_cache.tasks.prompts import load_prompts
from opd_cache.tokenizer import load_tokenizer

RESULTS = ROOT / "benchmarks" / "results" / "bench_kl_seeds.jsonl"


def run_variant(folder: Path, seed: int, sets: list[str], steps: int) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = demo_config(folder, seed, [f"train.max_steps={steps}", "run.evaluate=false", *sets])
    clock = run_pipeline(folder.name, folder, cfg, timeout=120 + steps * 6.0)
    if clock["status"] != 0:
        raise SystemExit(f"`opd run` failed (status {clock['status']}): see {folder / 'logs'}")
    measured = measure(folder / "store", clock)
    model, _, _ = resolve_model(str(folder / "store"))
    tokenizer = load_tokenizer(cfg.rollout.student)
    prompts = first_prompts(load_prompts(cfg.eval.prompts, tokenizer), cfg.eval.max_prompts)
    teacher = load_teacher(cfg.annotate.teacher, tokenizer, "cpu")
    result = evaluate_model(model, prompts, tokenizer, teacher=teacher, max_new_tokens=cfg.eval.max_new_tokens)
    return {
        "seed": seed,
        "sets": sets,
        "steps": steps,
        "kl": result.kl,
        "strict": result.strict,
        "time_to_last_step_s": measured["time_to_last_step_s"],
        "cpu_s": measured["cpu_s"],
        "mean_staleness": measured["mean_staleness"],
        "expired": measured["expired_samples"],
        "load_avg": measured["load_avg"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", action="append", default=None, help='comma-separated --set overrides ("": none)')
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, help="folder for the runs (default: a temp folder, removed)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    variants = [[s for s in v.split(",") if s] for v in (args.variant or [""])]

    from rich.console import Console

    ensure_demo_models(Console())
    torch.set_num_threads(1)
    out = args.out or Path(tempfile.mkdtemp(prefix="opd-bench-kl-"))
    rows = []
    for seed in args.seeds:  # seeds outside, variants inside: drift of the load spreads over the variants
        for i, sets in enumerate(variants):
            row = run_variant(out / f"s{seed}-v{i}", seed, sets, args.steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")

    print("\n| variant | seed | held-out KL | strict | to last step (s) | CPU (s) | mean staleness |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        name = ", ".join(row["sets"]) or "demo config"
        print(
            f"| {name} | {row['seed']} | {row['kl']:.4f} | {row['strict']:.3f} | {row['time_to_last_step_s']:.1f} "
            f"| {row['cpu_s']:.1f} | {row['mean_staleness']:.2f} |"
        )
    for sets in variants:
        kls = [r["kl"] for r in rows if r["sets"] == sets]
        print(f"median KL, {', '.join(sets) or 'demo config'}: {statistics.median(kls):.4f} over {len(kls)} seeds")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
