"""The trainer's data path: reader throughput, and step time streaming vs preloaded.

    python benchmarks/bench_train.py            # the measurement reported in docs/train.md
    python benchmarks/bench_train.py --quick    # small sizes, a smoke run

1. Reader (one core, k = 32): synthetic annotated shards (prompts 64-128
   tokens, responses 128-384, V = 32768, teacher top-32 log-probs in float32)
   on a local store, read back into training tensors.
     - "reader": the whole path of one optimizer step — the stream lists the
       store, opens and validates shards (memory-mapped), builds the global
       batch, splits it over 8 ranks and micro-batches, and every rank's
       micro-batches are decoded (padded input ids, positions, targets,
       weights). Cold cache: each run starts with no shard loaded.
     - "decode": decode_rows alone on shards already loaded.
   Reported as decoded response tokens per second. Target >= 1,000,000.
2. Step time (same run, same batches): a tiny student trained for a few
   steps, once with the batches preloaded in memory and once streaming from
   the shards through the prefetch thread (BatchLoader), alternating the two
   in several rounds to cancel machine drift. Reported: median step times,
   and the median over rounds of (streaming / preloaded). Target <= 1.05.

Results: a table on stdout and benchmarks/results/bench_train.json.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import write_results

from opd_cache.storage.store import Store
from opd_cache.testing import write_synthetic_store
from opd_cache.train.loader import BatchLoader
from opd_cache.train.microbatch import decode_rows
from opd_cache.train.shard_data import ShardCache
from opd_cache.train.stream import ShardStream, StreamEnd, assign_ranks

RESULTS = ROOT / "benchmarks" / "results" / "bench_train.json"


def make_store(root: Path, *, shards: int, rows: int, vocab: int, top_k: int, prompt_len, response_len) -> Store:
    store = Store(root)
    run = store.manifest.ensure(
        student="bench", tokenizer_fingerprint="fp-bench", vocab_size=vocab, top_k=top_k, teachers={"teacher": "bench"}
    )
    write_synthetic_store(store, run, shards, num_rows=rows, prompt_len=prompt_len, response_len=response_len)
    return store


def stream_of(store: Store, batch_samples: int) -> tuple[ShardStream, ShardCache]:
    run = store.manifest.require()
    cache = ShardCache(store, run, ["teacher"])
    return ShardStream(store, run, cache, max_staleness=100, batch_samples=batch_samples, batch_tokens=None), cache


def decode_batch(batch, cache, ranks: int):
    out = []
    for rank in range(ranks):
        for m in range(batch.num_micro):
            sel = np.nonzero((batch.rank_of_row == rank) & (batch.micro_of_row == m))[0]
            if len(sel):
                out.append(
                    decode_rows(
                        cache,
                        batch.shard_ids,
                        batch.row_shard[sel],
                        batch.row_index[sel],
                        aggregation="token-mean",
                        global_tokens=batch.response_tokens,
                        global_seqs=batch.global_seqs,
                    )
                )
    return out


def bench_reader(store: Store, *, batch_samples: int, ranks: int, micro_tokens: int, repeats: int) -> dict:
    """Response tokens per second through stream + plan + decode (cold shards), and decode alone (warm)."""
    full, warm = [], []
    for _ in range(repeats):
        stream, cache = stream_of(store, batch_samples)
        tokens, t0 = 0, time.perf_counter()
        batches = []
        step = 0
        while True:
            step += 1
            batch = stream.next_batch(step, 0)
            if isinstance(batch, StreamEnd):
                break
            assign_ranks(batch, ranks, micro_tokens)
            micro = decode_batch(batch, cache, ranks)
            tokens += sum(mb.num_tokens for mb in micro)
            batches.append(batch)
        full.append(tokens / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        tokens = sum(mb.num_tokens for batch in batches for mb in decode_batch(batch, cache, ranks))
        warm.append(tokens / (time.perf_counter() - t0))
    return {
        "reader_tokens_per_s": statistics.median(full),
        "decode_tokens_per_s": statistics.median(warm),
        "response_tokens": tokens,
    }


def bench_steps(store: Store, *, steps: int, batch_samples: int, micro_tokens: int, vocab: int, rounds: int) -> dict:
    """Median step time with batches preloaded in memory vs streamed through the prefetch thread."""
    from opd_cache.losses import LossConfig
    from opd_cache.models import build_tiny_model
    from opd_cache.train.objective import DistillationObjective

    def loader():
        stream, cache = stream_of(store, batch_samples)
        return BatchLoader(
            cache=cache,
            stream=stream,
            rank=0,
            world_size=1,
            first_step=1,
            max_steps=steps,
            version_of_step=lambda s: 0,
            micro_batch_tokens=micro_tokens,
            aggregation="token-mean",
        )

    def train(next_step) -> list[float]:
        model = build_tiny_model(vocab_size=vocab, hidden_size=128, num_layers=2, intermediate_size=512, seed=0)
        objective = DistillationObjective(model, LossConfig(chunk_size=1024)).train()
        optimizer = torch.optim.AdamW(objective.parameters(), lr=1e-4)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            item = next_step()  # the data wait is part of the step time
            for mb in item.micro_batches:
                loss, _, _ = objective(mb)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(objective.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return times[1:]  # the first step warms up kernels and the allocator

    results = {"preloaded": [], "streaming": []}
    ratios = []

    def preloaded_run() -> list[float]:
        ld = loader().start()
        batches = iter([ld.get() for _ in range(steps)])
        ld.close()
        return train(lambda: next(batches))

    def streaming_run() -> list[float]:
        ld = loader().start()
        try:
            return train(ld.get)
        finally:
            ld.close()

    for r in range(rounds):  # alternate the two modes (and their order); the machine's speed drifts
        if r % 2 == 0:
            pre, stream = preloaded_run(), streaming_run()
        else:
            stream, pre = streaming_run(), preloaded_run()
        results["preloaded"] += pre
        results["streaming"] += stream
        ratios.append(statistics.median(stream) / statistics.median(pre))
    return {
        "step_s_preloaded": statistics.median(results["preloaded"]),
        "step_s_streaming": statistics.median(results["streaming"]),
        "ratio": statistics.median(ratios),
        "ratio_per_round": ratios,
        "steps_measured": len(results["streaming"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # "on one core"

    vocab, top_k = 32768, 32
    if args.quick:
        reader = dict(shards=2, rows=64, prompt_len=(32, 64), response_len=(32, 96))
        steps = dict(shards=2, rows=64, prompt_len=(16, 32), response_len=(16, 48))
        step_cfg = dict(steps=4, batch_samples=16, micro_tokens=1024, rounds=1)
        train_vocab = 1024
    else:
        reader = dict(shards=8, rows=512, prompt_len=(64, 128), response_len=(128, 384))
        steps = dict(shards=4, rows=128, prompt_len=(32, 64), response_len=(32, 96))
        step_cfg = dict(steps=8, batch_samples=32, micro_tokens=2048, rounds=5)
        train_vocab = 4096
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        store = make_store(tmp / "reader", vocab=vocab, top_k=top_k, **reader)
        read = bench_reader(store, batch_samples=256, ranks=8, micro_tokens=16384, repeats=3)
        step_store = make_store(tmp / "steps", vocab=train_vocab, top_k=top_k, **steps)
        step = bench_steps(step_store, vocab=train_vocab, **step_cfg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows = [
        ("reader: stream+plan+decode, tokens/s (1 core, k=32)", f"{read['reader_tokens_per_s']:,.0f}", ">= 1,000,000"),
        ("decode only (shards loaded), tokens/s", f"{read['decode_tokens_per_s']:,.0f}", ""),
        ("step time preloaded (s)", f"{step['step_s_preloaded']:.4f}", ""),
        ("step time streaming (s)", f"{step['step_s_streaming']:.4f}", ""),
        ("streaming / preloaded (median of rounds)", f"{step['ratio']:.3f}", "<= 1.05"),
        ("  per round", " ".join(f"{r:.2f}" for r in step["ratio_per_round"]), ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure'.ljust(width)}  {'value':>14}  target")
    for name, value, target in rows:
        print(f"{name.ljust(width)}  {value:>14}  {target}")
    write_results(
        RESULTS,
        {
            "quick": args.quick,
            "machine": platform.platform(),
            "torch_threads": torch.get_num_threads(),
            "reader": {
                **read,
                "vocab": vocab,
                "top_k": top_k,
                "ranks": 8,
                **{k: list(v) if isinstance(v, tuple) else v for k, v in reader.items()},
            },
            "steps": {
                **step,
                "vocab": train_vocab,
                **{k: list(v) if isinstance(v, tuple) else v for k, v in steps.items()},
                **step_cfg,
            },
            "targets": {"reader_tokens_per_s": 1_000_000, "streaming_over_preloaded": 1.05},
        },
    )


if __name__ == "__main__":
    main()
