"""Multi-turn rollouts (`rollout.agent`, the calculator) vs single-turn rollouts, through the whole `opd rollout`.

    python benchmarks/bench_agent_rollout.py            # 64 prompts x 4 samples, 2 rounds
    python benchmarks/bench_agent_rollout.py --quick    # 16 prompts x 4, 1 round

Both sides run `opd_cache.rollout.run_rollout` with the shipped demo student on the arithmetic prompts, the same
batch (16 prompts x n=4), temperature 1 and 12 new tokens per turn, on one CPU thread, into a fresh local store:

  single  one response per sample (a shard row = prompt + response)
  agent   a conversation per sample with the calculator environment (require_tool, at most 3 assistant turns,
          96 tokens): each round of turns is one `generate` call on the whole context (no prefix cache)

Figures per side (the median round): rows/s, response tokens/s (every token of the row, environment text
included), trained tokens/s (loss_mask = 1: what the trainer learns from) and CPU-seconds per row. The clock runs
around `run_rollout` (model load included). Results: a table on stdout and
benchmarks/results/bench_agent_rollout.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_agent_rollout.json"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one_round(side: str, prompts: int) -> dict:
    import torch

    from opd_cache.config import load_config
    from opd_cache.rollout import run_rollout
    from opd_cache.storage.schema import list_lengths, read_shard, trained_lengths
    from opd_cache.storage.store import Store

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        store = Store(os.path.join(folder, "store"))
        overrides = {
            "store.uri": store.uri,
            "rollout.student": str(ROOT / "data/models/student"),
            "rollout.prompts": str(ROOT / "data/arithmetic/train.parquet"),
            "rollout.n": 4,
            "rollout.batch_prompts": 16,
            "rollout.flush_rows": 64,
            "rollout.max_samples": prompts * 4,
            "rollout.sampling.max_new_tokens": 12,
            "rollout.device": "cpu",
        }
        if side == "agent":
            overrides.update(
                {
                    "rollout.agent.environment": "calculator",
                    "rollout.agent.environment_options": {"require_tool": True},
                    "rollout.agent.chat_template": str(ROOT / "data/chat_templates/arithmetic_tools.jinja"),
                    "rollout.agent.max_turns": 3,
                    "rollout.agent.max_tokens": 96,
                }
            )
        cfg = load_config(None, overrides=overrides)
        cpu, wall = cpu_seconds(), time.perf_counter()
        result = run_rollout(cfg, store)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        rows = tokens = trained = 0
        for info in store.shards.rollouts():
            table, _ = read_shard(store, info.path)
            rows += table.num_rows
            tokens += int(list_lengths(table["response_ids"]).sum())
            trained += int(trained_lengths(table).sum())
    assert rows == result.samples
    return dict(rows=rows, tokens=tokens, trained_tokens=trained, wall_s=wall, cpu_s=cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts, one round")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    prompts, repeats = (16, 1) if args.quick else (args.prompts, args.repeats)
    rounds: dict[str, list[dict]] = {"single": [], "agent": []}
    for _ in range(repeats):  # alternate the sides, so a busy spell of the machine falls on both
        for side in rounds:
            rounds[side].append(one_round(side, prompts))

    summary = {}
    for side, runs in rounds.items():
        median = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        summary[side] = dict(
            rows_per_s=statistics.median(r["rows"] / r["wall_s"] for r in runs),
            tokens_per_s=statistics.median(r["tokens"] / r["wall_s"] for r in runs),
            trained_tokens_per_s=statistics.median(r["trained_tokens"] / r["wall_s"] for r in runs),
            cpu_s_per_row=statistics.median(r["cpu_s"] / r["rows"] for r in runs),
            tokens_per_row=median("tokens") / median("rows"),
            trained_per_row=median("trained_tokens") / median("rows"),
        )
    table = [
        [
            side,
            f"{s['rows_per_s']:.1f}",
            f"{s['tokens_per_s']:.0f}",
            f"{s['trained_tokens_per_s']:.0f}",
            f"{s['cpu_s_per_row'] * 1000:.1f}",
            f"{s['tokens_per_row']:.1f}",
            f"{s['trained_per_row']:.1f}",
        ]
        for side, s in summary.items()
    ]
    header = ["side", "rows/s", "tokens/s", "trained tok/s", "CPU ms/row", "tokens/row", "trained/row"]
    print(markdown_table(header, "lrrrrrr", table))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    write_results(
        RESULTS,
        dict(
            prompts=prompts,
            n=4,
            repeats=repeats,
            summary=summary,
            rounds=rounds,
            load_average=load,
            machine=platform.platform(),
            python=sys.version.split()[0],
        ),
    )


if __name__ == "__main__":
    main()
