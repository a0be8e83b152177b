"""Throughput and peak memory of `opd rollout` (end to end) vs plain `model.generate`.

    python benchmarks/bench_rollout.py            # 128 prompts x 4 samples, 32 new tokens, ~4M-parameter model
    python benchmarks/bench_rollout.py --quick    # a smoke run

Both sides sample the same prompts (the arithmetic test set, chat-templated),
from the same model, with the same batch (16 prompts x n=4 = 64 sequences),
temperature 1, no top-k / top-p, the same max_new_tokens, on the CPU with the
same thread count:

  generate  `model.generate(do_sample=True, num_return_sequences=n)` on
            left-padded batches; nothing is recorded but the tokens
  rollout   `opd_cache.rollout.run_rollout`: the whole worker, i.e. tokenizer,
            prompt file, run.json, model load, sampling with behavior log-probs,
            Arrow shards written atomically to a local store, metrics

Each measurement is a fresh Python process (so peak RSS, the kernel's
high-water mark `ru_maxrss`, belongs to one side only); the clock runs from
before the model is loaded to the end (both sides load one model; modules are
imported before the clock starts). Tokens are response tokens (up to and
including EOS). Sides alternate for `--repeats` rounds.

Throughput is judged in tokens per CPU-second of the process (median over the
rounds): with one thread this is what wall-clock throughput is on an idle
core, and it is not disturbed by the process waiting for a CPU on a shared
machine, which moved single wall-clock rounds by +-30% where this was written.
Wall-clock tokens/s (best and median round) are printed beside it and kept in
the JSON with every round. Ratios are rollout / generate.
Targets: throughput >= 0.85x, peak memory <= 1.2x.
Results: a table on stdout and benchmarks/results/bench_rollout.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import benchmark_parser, child_json, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_rollout.json"
MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024)  # ~4M parameters with tied embeddings


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- the two sides (each in its own process)
def import_model_code() -> None:
    """Import what both sides need before the clock starts: import time is not what we compare."""
    import transformers.generation.utils  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401


def run_generate(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import_model_code()
    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.spec).read_text())
    prompts, n, max_new = spec["prompts"], spec["n"], spec["max_new_tokens"]
    pad, eos = spec["pad_token_id"], spec["eos_token_id"]
    start, cpu_start = time.perf_counter(), cpu_seconds()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    # Plain sampling from the full distribution (no top-k / top-p cut), as the rollout side samples.
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    outputs = dict(max_new_tokens=max_new, num_return_sequences=n, pad_token_id=pad, eos_token_id=eos)  # per prompt
    tokens = 0
    torch.manual_seed(0)
    for b in range(0, len(prompts), spec["batch_prompts"]):
        batch = prompts[b : b + spec["batch_prompts"]]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **sampling, **outputs)
        new = out[:, width:]
        is_eos = (new == eos).int()
        # a row's response runs up to and including its first EOS
        first_eos = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, torch.full((len(new),), new.shape[1]))
        tokens += int(first_eos.sum())
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "tokens": tokens,
        "samples": len(prompts) * n,
        "peak_rss_mib": peak_rss_mib(),
    }


def run_rollout_side(args) -> dict:
    import pandas  # noqa: F401  (pyarrow imports it lazily on the first parquet read)
    import torch

    import opd_cache.rollout.hf_generate  # noqa: F401  (run_rollout imports its engine lazily)
    from opd_cache.config import Config, RolloutConfig, SamplingConfig
    from opd_cache.rollout import run_rollout
    from opd_cache.storage.store import Store

    import_model_code()
    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.spec).read_text())
    cfg = RolloutConfig(
        student=spec["model"],
        prompts=spec["prompt_file"],
        n=spec["n"],
        sampling=SamplingConfig(max_new_tokens=spec["max_new_tokens"]),
        batch_prompts=spec["batch_prompts"],
        flush_rows=spec["batch_prompts"] * spec["n"],
        max_samples=len(spec["prompts"]) * spec["n"],
        device="cpu",
    )
    with tempfile.TemporaryDirectory() as store_dir:
        start, cpu_start = time.perf_counter(), cpu_seconds()
        result = run_rollout(Config(rollout=cfg), Store(store_dir))
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "tokens": result.tokens,
        "samples": result.samples,
        "shards": len(result.shards),
        "peak_rss_mib": peak_rss_mib(),
    }


# ---------------------------------------------------------------- the driver
def prepare(workdir: Path, num_prompts: int, n: int, max_new: int, batch_prompts: int) -> Path:
    """A ~4M-parameter student and the first `num_prompts` arithmetic prompts, tokenized once for both sides."""
    import pyarrow.parquet as pq

    from opd_cache.models import build_tiny_model, save_causal_lm
    from opd_cache.tasks.prompts import load_prompts
    from opd_cache.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    model_dir = workdir / "student"
    model = build_tiny_model(vocab_size=len(tokenizer), seed=0, **MODEL)
    save_causal_lm(model, tokenizer, model_dir)
    source = ROOT / "data" / "arithmetic" / "test.parquet"
    prompt_file = workdir / "prompts.parquet"
    if source.exists():
        pq.write_table(pq.read_table(source).slice(0, num_prompts), prompt_file)
    else:  # a checkout without the shipped data: synthetic questions of varied length
        prompt_file = workdir / "prompts.jsonl"
        prompt_file.write_text(
            "".join(json.dumps({"question": f"What is {i} + {3 * i % 97}?"}) + "\n" for i in range(num_prompts))
        )
    prompts = load_prompts(prompt_file, tokenizer)
    # The worker visits prompts in its seeded order; the baseline gets the same prompts in that order.
    from opd_cache.rollout.prompt_stream import PromptStream

    order = PromptStream(len(prompts), 0, "w00").take(0, len(prompts))
    spec = {
        "model": str(model_dir),
        "prompt_file": str(prompt_file),
        "n": n,
        "max_new_tokens": max_new,
        "batch_prompts": batch_prompts,
        "prompts": [prompts.prompt_ids[i] for i in order],
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    path = workdir / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def measure(side: str, spec: Path, threads: int) -> dict:
    return child_json([sys.executable, __file__, "--side", side, "--spec", str(spec), "--threads", str(threads)], side)


def main() -> None:
    parser = benchmark_parser(__doc__.splitlines()[0], quick_help="small sizes, one round", threads=1, repeats=5)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-prompts", type=int, default=16)
    parser.add_argument("--side", choices=["generate", "rollout"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:  # a child process: one measurement, JSON on the last line
        result = run_generate(args) if args.side == "generate" else run_rollout_side(args)
        print(json.dumps(result))
        return

    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats = 32, 16, 1
    with tempfile.TemporaryDirectory() as workdir:
        spec_path = prepare(Path(workdir), args.prompts, args.n, args.max_new_tokens, args.batch_prompts)
        spec = json.loads(spec_path.read_text())
        rounds = {"generate": [], "rollout": []}
        for r in range(args.repeats):
            for side in ("generate", "rollout"):
                rounds[side].append(measure(side, spec_path, args.threads))
                m = rounds[side][-1]
                print(
                    f"round {r + 1} {side:8s}: {m['tokens'] / m['seconds']:7.1f} tok/s "
                    f"({m['tokens'] / m['cpu_seconds']:7.1f} per CPU-second)  "
                    f"{m['peak_rss_mib']:6.0f} MiB peak  ({m['tokens']} tokens in {m['seconds']:.1f} s)",
                    flush=True,
                )

    def ratio_row(label: str, values: dict, ratio: float, target: str = "", met: bool | None = None) -> str:
        verdict = "" if met is None else ("  ok" if met else "  MISSED")
        return f"{label:22s}{values['generate']:10.1f}{values['rollout']:10.1f}{ratio:8.2f}{target:>9s}{verdict}"

    def per_side(fn) -> dict:
        return {side: fn(ms) for side, ms in rounds.items()}

    cpu_tps = per_side(lambda ms: statistics.median(m["tokens"] / m["cpu_seconds"] for m in ms))
    best_tps = per_side(lambda ms: max(m["tokens"] / m["seconds"] for m in ms))
    median_tps = per_side(lambda ms: statistics.median(m["tokens"] / m["seconds"] for m in ms))
    peak = per_side(lambda ms: min(m["peak_rss_mib"] for m in ms))
    ratios = {
        "throughput": cpu_tps["rollout"] / cpu_tps["generate"],
        "throughput_wall_best": best_tps["rollout"] / best_tps["generate"],
        "throughput_wall_median": median_tps["rollout"] / median_tps["generate"],
        "peak_rss": peak["rollout"] / peak["generate"],
    }
    targets = {"throughput": ">= 0.85", "peak_rss": "<= 1.2"}
    met = {"throughput": ratios["throughput"] >= 0.85, "peak_rss": ratios["peak_rss"] <= 1.2}

    print()
    print(
        f"{spec['parameters'] / 1e6:.1f}M-parameter model, {args.prompts} prompts x n={args.n}, "
        f"{args.max_new_tokens} new tokens, batch {args.batch_prompts} prompts, {args.threads} thread(s), "
        f"{args.repeats} rounds"
    )
    print(f"{'':22s}{'generate':>10s}{'rollout':>10s}{'ratio':>8s}{'target':>9s}")
    print(ratio_row("tokens/CPU-s, median", cpu_tps, ratios["throughput"], targets["throughput"], met["throughput"]))
    print(ratio_row("tokens/s wall, best", best_tps, ratios["throughput_wall_best"]))
    print(ratio_row("tokens/s wall, median", median_tps, ratios["throughput_wall_median"]))
    print(ratio_row("peak RSS MiB", peak, ratios["peak_rss"], targets["peak_rss"], met["peak_rss"]))

    write_results(
        RESULTS,
        {
            "benchmark": "bench_rollout",
            "settings": {
                "prompts": args.prompts,
                "n": args.n,
                "max_new_tokens": args.max_new_tokens,
                "batch_prompts": args.batch_prompts,
                "threads": args.threads,
                "repeats": args.repeats,
                "model_parameters": spec["parameters"],
                "model": MODEL,
                "device": "cpu",
            },
            "tokens_per_cpu_second_median": cpu_tps,
            "tokens_per_s_best": best_tps,
            "tokens_per_s_median": median_tps,
            "peak_rss_mib": peak,
            "ratios": ratios,
            "targets": targets,
            "met": met,
            "rounds": rounds,
            "machine": {"python": platform.python_version(), "platform": platform.platform()},
        },
    )


if __name__ == "__main__":
    main()
