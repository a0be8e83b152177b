"""Peak memory and time of the distillation loss: naive full log_softmax vs fused_token_losses.

    python benchmarks/bench_losses.py            # N=8192,V=32768 and N=2048,V=151936, H=1024
    python benchmarks/bench_losses.py --quick    # small sizes, a smoke run

Three variants compute the same loss (forward KL on the teacher's top-k with a
tail bucket, token-mean weights) and its gradients w.r.t. the hidden states and
the output layer, in float32 on the CPU:

  naive        logits = h @ W.T, full log_softmax, gather, tail by a masked
               logsumexp, plain autograd (what a trainer writes first)
  materialised token_losses(h @ W.T, ...): the reference path of opd_cache
  fused        fused_token_losses(h, W, ...): chunks of tokens, gradients in the forward

How memory is measured: each variant runs in a fresh Python process. After
building the inputs and a tiny warm-up (kernels, thread pools), the process
reads its current resident set size (VmRSS); it then runs one forward+backward
and reads its peak resident set size (`ru_maxrss`, the kernel's high-water mark
of resident pages). The difference is the extra memory that forward+backward
needed at its worst moment, the gradients of h and W included. glibc serves
blocks above 32 MiB with mmap and unmaps them when freed, so at the full sizes
(every [N, V] or [chunk, V] buffer is >= 128 MiB) RSS follows the live
tensors; a fresh process per variant keeps one variant's high-water mark from
hiding another's. (At the --quick sizes small blocks come from the heap and
the numbers are only a smoke test.)

How time is measured: forward+backward with `--threads` torch threads
(default 1), as CPU time of the process (`time.process_time`, user + system)
and as wall time. On a CPU shared with other work, wall time mostly measures
how long the process waited for a core; CPU time measures the work done
(page faults of fresh buffers included), so the CPU-time ratio is the one to
read, the wall-time ratio is kept. `--rounds` processes per variant run in
alternating order (A B C, C B A) so that a change of load hits all variants;
the reported times are the min over the timed runs (the least disturbed).
Ratios are fused / naive and materialised / naive from the same run.
Results: a table on stdout and benchmarks/results/bench_losses.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

from common import child_json, naive_topk_kl, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_losses.json"
FULL_CONFIGS = [(8192, 32768, 1024), (2048, 151936, 1024)]
QUICK_CONFIGS = [(1024, 4096, 128), (256, 16384, 128)]
VARIANTS = ("naive", "materialised", "fused")
TOP_K = 20


def make_inputs(n: int, vocab: int, hidden: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g) / hidden**0.25).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.25).requires_grad_()
    # A teacher's top-k: random ids with log-probs of a peaked distribution (sum of p < 1).
    ids = torch.stack([torch.randperm(vocab, generator=g)[:TOP_K] for _ in range(min(n, 64))])
    ids = ids.repeat((n + 63) // 64, 1)[:n]
    logits = torch.randn(n, TOP_K, generator=g).sort(1, descending=True).values * 2
    logprobs = logits.log_softmax(1) + torch.log(torch.tensor(0.9))  # top-k holds 90% of the mass
    weights = torch.full((n,), 1.0 / n)
    return h, w, ids, logprobs, weights


def current_rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def run_variant(variant: str, n: int, vocab: int, hidden: int, chunk_size: int, repeats: int, threads: int) -> dict:
    import torch

    from opd_cache.losses import LossConfig, fused_token_losses, token_losses

    if threads:
        torch.set_num_threads(threads)

    def step(h, w, ids, logprobs, weights):
        if variant == "naive":
            loss = naive_topk_kl(h, w, ids, logprobs, weights)
        elif variant == "materialised":
            loss = (weights * token_losses(h @ w.t(), ids, logprobs)).sum()
        else:
            loss, _ = fused_token_losses(h, w, ids, logprobs, weights, LossConfig(chunk_size=chunk_size))
        loss.backward()
        return loss.detach()

    step(*make_inputs(16, 256, 16))  # warm-up: kernels, thread pools, imports
    inputs = make_inputs(n, vocab, hidden)
    h, w = inputs[0], inputs[1]
    baseline_kb = current_rss_kb()
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = step(*inputs)
    first_s, first_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grad_norms = (float(h.grad.norm()), float(w.grad.norm()))
    times, cpu_times = [], []
    for _ in range(repeats):
        h.grad = w.grad = None
        start, start_cpu = time.perf_counter(), time.process_time()
        step(*inputs)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
    return {
        "variant": variant,
        "peak_extra_mib": (peak_kb - baseline_kb) / 1024,
        "baseline_mib": baseline_kb / 1024,
        "first_run_s": first_s,
        "first_run_cpu_s": first_cpu_s,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "loss": float(loss),
        "grad_norm_hidden": grad_norms[0],
        "grad_norm_weight": grad_norms[1],
        "threads": torch.get_num_threads(),
    }


def spawn(variant: str, n: int, vocab: int, hidden: int, chunk_size: int, repeats: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--sizes", f"{n},{vocab},{hidden}",
           "--chunk-size", str(chunk_size), "--repeats", str(repeats), "--threads", str(threads)]  # fmt: skip
    print(f"  N={n} V={vocab} {variant} ...", file=sys.stderr, flush=True)
    return child_json(cmd, f"{variant} at N={n}, V={vocab}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs after the memory-measured one, per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per variant, in alternating order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        sys.path.insert(0, str(ROOT))
        n, vocab, hidden = map(int, args.sizes.split(","))
        print(json.dumps(run_variant(args.worker, n, vocab, hidden, args.chunk_size, args.repeats, args.threads)))
        return

    configs = QUICK_CONFIGS if args.quick else FULL_CONFIGS
    variants = args.variants.split(",")
    rows = []
    for n, vocab, hidden in configs:
        # Rounds alternate the order (A B C, C B A, ...) so that a change in the
        # machine's load hits every variant alike; memory is the max over rounds
        # (it does not depend on load), time the min over all timed runs (the
        # run least disturbed by other processes).
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for round_index in range(args.rounds):
            order = variants if round_index % 2 == 0 else variants[::-1]
            for v in order:
                runs[v].append(spawn(v, n, vocab, hidden, args.chunk_size, args.repeats, args.threads))
        results = {}
        for v, rs in runs.items():
            times = [t for r in rs for t in r["times_s"]] or [r["first_run_s"] for r in rs]
            cpu_times = [t for r in rs for t in r["cpu_times_s"]] or [r["first_run_cpu_s"] for r in rs]
            results[v] = {**rs[0], "peak_extra_mib": max(r["peak_extra_mib"] for r in rs),
                          "time_s": min(times), "median_s": statistics.median(times), "times_s": times,
                          "cpu_s": min(cpu_times), "cpu_times_s": cpu_times, "rounds": len(rs)}  # fmt: skip
        naive = results.get("naive")
        for v, r in results.items():
            r.update(n=n, vocab=vocab, hidden=hidden, chunk_size=args.chunk_size)
            if naive:
                r["memory_ratio"] = r["peak_extra_mib"] / naive["peak_extra_mib"]
                r["cpu_time_ratio"] = r["cpu_s"] / naive["cpu_s"]
                r["time_ratio"] = r["time_s"] / naive["time_s"]
                r["median_time_ratio"] = r["median_s"] / naive["median_s"]
                r["loss_abs_diff_vs_naive"] = abs(r["loss"] - naive["loss"])
            rows.append(r)

    header = (f"{'N':>6} {'V':>7} {'variant':>13} {'peak MiB':>9} {'mem ratio':>9} {'cpu s':>7} {'cpu ratio':>9} "
              f"{'wall s':>7} {'wall ratio':>10} {'|dloss|':>8}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['n']:>6} {r['vocab']:>7} {r['variant']:>13} {r['peak_extra_mib']:>9.0f} "
            f"{r.get('memory_ratio', float('nan')):>9.3f} {r['cpu_s']:>7.2f} "
            f"{r.get('cpu_time_ratio', float('nan')):>9.3f} {r['time_s']:>7.2f} {r.get('time_ratio', float('nan')):>10.3f} "
            f"{r.get('loss_abs_diff_vs_naive', float('nan')):>8.1e}"
        )
    meta = {"quick": args.quick, "machine": platform.machine(), "python": platform.python_version(),
            "top_k": TOP_K, "repeats": args.repeats, "rounds": args.rounds, "threads": args.threads,
            "dtype": "float32", "device": "cpu", "cpus": os.cpu_count()}  # fmt: skip
    write_results(RESULTS, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
