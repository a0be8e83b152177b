"""Step time with a policy version published every step vs never, on the demo configuration (issue #14).

    python benchmarks/bench_publish.py            # the measurement reported in docs/benchmarks.md
    python benchmarks/bench_publish.py --quick    # fewer steps and rounds, a smoke run

The demo's trainer (examples/arithmetic_cpu/config.yaml: the 2-layer student,
64 samples per step, top-8) trains on synthetic annotated shards shaped like
the demo's (prompts 12-20 tokens, responses 6-10) in a local store, three ways:

- "never": `publish_every` larger than the run (only the final version);
- "background": `publish_every: 1`, the writer thread of train/publish.py;
- "synchronous": `publish_every: 1`, each version written before the next step
  (PolicyPublisher(background=False): what the trainer did before issue #14).

Step time is the wall time between consecutive steps' metrics records (the
step, its ledger, publication hand-off, progress; the first `warmup` steps
left out), median over the run. The three variants alternate in several
rounds on fresh copies of the store, to cancel machine drift; reported: the
median step times and the median over rounds of each variant / "never".
Target: background / never <= 1.05.

Start-up (issue #14, item 5): one `opd run` on the demo configuration, timed
by benchmarks/bench_startup.py's `measure_startup` (that script compares two
checkouts, median of alternating rounds).

Results: a table on stdout and benchmarks/results/bench_publish.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_startup import measure_startup

from opd_cache.config import load_config
from opd_cache.storage.store import Store
from opd_cache.testing import write_synthetic_store
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint
from opd_cache.train import trainer as trainer_module
from opd_cache.train.publish import PolicyPublisher

RESULTS = ROOT / "benchmarks" / "results" / "bench_publish.json"
DEMO = ROOT / "examples" / "arithmetic_cpu" / "config.yaml"
STUDENT = ROOT / "data" / "models" / "student"
BATCH = 64


def make_store(root: Path, shards: int) -> Store:
    tokenizer = load_tokenizer(STUDENT)
    store = Store(root)
    run = store.manifest.ensure(
        student=str(STUDENT),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=len(tokenizer),
        top_k=8,
        teachers={"teacher": "bench"},
    )
    write_synthetic_store(store, run, shards, num_rows=BATCH, prompt_len=(12, 20), response_len=(6, 10))
    return store


def train_once(template: Path, workdir: Path, steps: int, variant: str, warmup: int) -> dict:
    root = workdir / f"store-{variant}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template, root)
    overrides = {
        "store.uri": str(root),
        "train.max_steps": steps,
        "max_staleness": 10**6,  # every synthetic row is of version 0
        "train.publish_every": 10**6 if variant == "never" else 1,
        "train.warmup_steps": 0,
    }
    cfg = load_config(DEMO, overrides=overrides)
    real = trainer_module.PolicyPublisher
    if variant == "synchronous":
        trainer_module.PolicyPublisher = functools.partial(PolicyPublisher, background=False)
    try:
        tic = time.perf_counter()
        result = trainer_module.run_train(cfg, Store(root))
        wall = time.perf_counter() - tic
    finally:
        trainer_module.PolicyPublisher = real
    store = Store(root)
    records = [json.loads(line) for line in store.read_bytes("metrics/train-0.jsonl").decode().splitlines()]
    times = [r["time"] for r in records if "step" in r]
    intervals = [b - a for a, b in zip(times[warmup:], times[warmup + 1 :])]
    compute = statistics.median(r["step_time_s"] for r in records[warmup:] if "step_time_s" in r)
    out = {
        "step_s": statistics.median(intervals),
        "compute_s": compute,
        "wall_s": wall,
        "versions": result.policy_version,
        "policy_bytes": sum(i.size for i in store.list_files("policy", recursive=True)),
    }
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up measurement")
    args = parser.parse_args()
    steps, rounds, warmup = (15, 1, 3) if args.quick else (40, 3, 5)
    torch.set_num_threads(1)
    variants = ["never", "background", "synchronous"]
    workdir = Path(tempfile.mkdtemp(prefix="opd-bench-publish-"))
    try:
        template = workdir / "template"
        make_store(template, steps)
        runs = {v: [] for v in variants}
        for r in range(rounds):
            for v in variants if r % 2 == 0 else reversed(variants):
                runs[v].append(train_once(template, workdir, steps, v, warmup))
                print(f"round {r + 1}/{rounds} {v:<12} step {runs[v][-1]['step_s'] * 1000:.1f} ms", flush=True)
        startup = None if args.no_startup else measure_startup(ROOT, workdir / "startup")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = {}
    for v in variants:
        ratios = [run["step_s"] / base["step_s"] for run, base in zip(runs[v], runs["never"])]
        table[v] = {
            "step_ms": round(1000 * statistics.median(run["step_s"] for run in runs[v]), 2),
            "compute_ms": round(1000 * statistics.median(run["compute_s"] for run in runs[v]), 2),
            "ratio_vs_never": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios],
            "versions": runs[v][0]["versions"],
            "policy_bytes_at_end": runs[v][0]["policy_bytes"],
        }
    print(f"\n{'variant':<12} {'step ms':>8} {'compute ms':>10} {'ratio':>6}  versions  policy/ bytes at end")
    for v, row in table.items():
        print(
            f"{v:<12} {row['step_ms']:>8.1f} {row['compute_ms']:>10.1f} {row['ratio_vs_never']:>6.3f}  "
            f"{row['versions']:>8}  {row['policy_bytes_at_end']:,}"
        )
    target = table["background"]["ratio_vs_never"] <= 1.05
    print(
        f"\nbackground / never {table['background']['ratio_vs_never']:.3f} (target <= 1.05: {'met' if target else 'NOT met'})"
    )
    if startup:
        print("start-up of `opd run` on the demo config (s from the command's start): " + json.dumps(startup))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "config": str(DEMO.relative_to(ROOT)),
                "steps": steps,
                "rounds": rounds,
                "warmup": warmup,
                "torch_threads": 1,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "results": table,
                "startup_s": startup,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
