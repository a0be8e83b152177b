"""The trainer on the GPU: tokens/s and MFU of the 0.5B student, alone and as FSDP2 over NCCL in a world of one.

`train`: `opd_cache.train.train` (what `opd train` runs) on one GPU: float32 weights, bf16 autocast, the fused
loss (forward KL, tail bucket) on synthetic annotated shards (prompts 64-192 tokens, responses 128-640, teacher
top-32), 64 rows a step, micro-batches of 16,384 padded tokens, 16 steps. Steps 1-2 are warm-up; throughput is
Σ input tokens of steps 3.. over the wall time between the metrics records of step 2 and the last step (each
record is written after the step's gradient norm is read, a device sync), so it includes data waits.

MFU = model FLOP/s / the device's dense bf16 peak (gpu_measure.PEAK_BF16_FLOPS: 989 TFLOP/s for an H200), with
model FLOPs per step = 6 x (parameters outside the embedding) x input tokens (body, forward + backward)
+ 6 x V x H x response tokens (the output layer runs on response positions only) + 6 x layers x H x Σ s²
(causal attention scores and values, s = each row's length; Σ s² estimated from the shards' mean s²).
Padding is not counted: MFU is useful work.

`train-fsdp` runs under `torchrun --nproc_per_node 1`: one GPU is a world of one, where `opd train` runs as a
single process without a process group (train/distributed.py). To exercise the multi-GPU path anyway, the check
initialises the NCCL process group and a one-rank device mesh itself and hands the trainer a DistEnv that says
distributed: FSDP2 shards the student over the one rank (bf16 parameters, float32 reductions), every collective
(NCCL all-reduce, full-state-dict gather for publishing, DCP resume state) runs, degenerate but real.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gpu_measure import count_parameters, device_name, ensure_student, peak_flops, student_config

TOP_K = 32
GPU = dict(shards=8, rows=64, prompt_len=(64, 192), response_len=(128, 640), steps=16, batch=64, micro=16384)
GPU_FSDP = dict(GPU, steps=8)
TOY = dict(shards=2, rows=8, prompt_len=(4, 8), response_len=(2, 8), steps=3, batch=4, micro=64)


def make_store(api, root: Path, student: Path, sizes: dict):
    tokenizer = api.load_tokenizer(str(student))
    store = api.Store(root)
    run = store.manifest.ensure(student=str(student), tokenizer_fingerprint=api.tokenizer_fingerprint(tokenizer),
                                vocab_size=len(tokenizer), top_k=TOP_K, teachers={"teacher": "synthetic"})  # fmt: skip
    api.write_synthetic_store(store, run, sizes["shards"], num_rows=sizes["rows"], prompt_len=sizes["prompt_len"],
                              response_len=sizes["response_len"])  # fmt: skip
    return store


def mean_square_length(sizes: dict) -> float:
    """E[s²] of a row: prompt and response lengths uniform on their ranges, independent."""
    p = np.arange(sizes["prompt_len"][0], sizes["prompt_len"][1] + 1)
    r = np.arange(sizes["response_len"][0], sizes["response_len"][1] + 1)
    return float((p.mean() + r.mean()) ** 2 + p.var() + r.var())


def train_config(api, store, sizes: dict, device: torch.device):
    return api.load_config(None, overrides={
        "store.uri": store.uri, "train.max_steps": sizes["steps"], "train.global_batch_samples": sizes["batch"],
        "train.micro_batch_tokens": sizes["micro"], "max_staleness": 100, "train.lr": 1e-5,
        "train.publish_every": 1000, "train.save_every": 1000, "train.publish_dtype": "bfloat16",
        "train.keep_versions": 1, "train.keep_states": 1, "train.device": device.type,
        "train.mixed_precision": "auto", "train.poll_seconds": 0.1,
    })  # fmt: skip


@dataclass
class Throughput:
    steps: int
    input_tokens_per_s: float
    response_tokens_per_s: float
    flops_per_s: float
    mfu: float | None
    losses: list[float]


def throughput(store, sizes: dict, toy: bool, device: torch.device) -> Throughput:
    records = [json.loads(line) for line in store.read_bytes("metrics/train-0.jsonl").decode().splitlines()]
    records = [r for r in records if "tokens_per_s" in r]
    warm = 2 if len(records) > 3 else 0  # steps 1-2 warm up (kernels, allocator); too few steps: all of them
    timed = records[warm:]
    if warm:  # from the end of step `warm` (its record) to the end of the last step
        seconds = records[-1]["time"] - records[warm - 1]["time"]
    else:
        seconds = sum(r["step_time_s"] for r in records)
    seconds = max(seconds, 1e-9)
    inputs = sum(r["input_tokens"] for r in timed)
    responses = sum(r["tokens"] for r in timed)
    rows = sum(r["samples"] for r in timed)
    config = student_config(toy)
    _, body = count_parameters(config)
    hidden, vocab, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    flops = 6 * body * inputs + 6 * vocab * hidden * responses + 6 * layers * hidden * rows * mean_square_length(sizes)
    peak = peak_flops(device_name(device))
    flops_per_s = flops / seconds
    return Throughput(
        steps=len(records),
        input_tokens_per_s=inputs / seconds,
        response_tokens_per_s=responses / seconds,
        flops_per_s=flops_per_s,
        mfu=flops_per_s / peak if peak and device.type == "cuda" else None,
        losses=[r["loss"] for r in records],
    )


def report(record, label: str, result, store, sizes, toy, device, seconds: float) -> None:
    t = throughput(store, sizes, toy, device)
    ok = result.step == sizes["steps"] and all(np.isfinite(t.losses))
    record.item(f"{label}: trained", "passed" if ok else "failed", result.step, "steps",
                f"stopped: {result.stopped}; {seconds:.1f} s in all (load, train, publish, save)")  # fmt: skip
    record.figure(f"{label}: input tokens/s", round(t.input_tokens_per_s), "tokens/s",
                  f"response tokens/s {t.response_tokens_per_s:,.0f}; steps 3..{t.steps}")  # fmt: skip
    peak = peak_flops(device_name(device))
    if t.mfu is not None:
        record.figure(f"{label}: MFU", round(100 * t.mfu, 1), "%",
                      f"{t.flops_per_s / 1e12:.0f} model TFLOP/s of {peak / 1e12:.0f} (dense bf16 peak)")  # fmt: skip
    else:
        record.item(f"{label}: MFU", "skipped", note=f"no bf16 peak known for {device_name(device)} "
                    "(GPU_CHECK_PEAK_TFLOPS=...)" if device.type == "cuda" else "CPU (dry run)")  # fmt: skip
    published = store.latest_version()
    record.item(f"{label}: published and saved", "passed" if published >= 1 else "failed", published, "version",
                "the policy version written at the end (bf16) and the resume state")  # fmt: skip
    if device.type == "cuda":
        record.figure(f"{label}: peak GPU memory", round(torch.cuda.max_memory_allocated(device) / 2**30, 1), "GiB")


def run(record, device: torch.device, toy: bool, work: Path) -> None:
    import gpu_api as api

    sizes = TOY if toy else GPU
    student = ensure_student(work / "student", toy, device)
    store = make_store(api, work / "train-store", student, sizes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    result = api.run_train(train_config(api, store, sizes, device), store)
    report(record, "train (1 GPU, bf16 autocast)" if not toy else "train (CPU)", result, store, sizes, toy, device,
           time.perf_counter() - start)  # fmt: skip


def run_fsdp(record, device: torch.device, toy: bool, work: Path) -> None:
    """Under torchrun --nproc_per_node 1: NCCL (gloo on the CPU), a one-rank mesh, FSDP2 forced on."""
    import gpu_api as api
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    if int(os.environ.get("WORLD_SIZE", "0")) != 1:
        raise RuntimeError("train-fsdp runs under torchrun --nproc_per_node 1 (WORLD_SIZE=1)")
    sizes = TOY if toy else GPU_FSDP
    student = ensure_student(work / "student", toy, device)  # rank 0 alone: no race
    store = make_store(api, work / "fsdp-store", student, sizes)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    check = torch.ones(3, device=device)
    dist.all_reduce(check)
    record.item(f"{backend} process group + all_reduce", "passed" if check.tolist() == [1.0] * 3 else "failed",
                dist.get_world_size(), "ranks", f"torch.distributed {backend}; a world of one")  # fmt: skip

    @dataclass
    class OneRankFSDP(api.DistEnv):
        @property
        def distributed(self) -> bool:  # a world of one, run as the multi-GPU path
            return True

    mesh = init_device_mesh(device.type, (1,))
    env = OneRankFSDP(rank=0, world_size=1, device=device, mesh=mesh, data_group=dist.new_group(backend="gloo"),
                      owns_group=True)  # fmt: skip
    start = time.perf_counter()
    try:
        trainer = api.Trainer(train_config(api, store, sizes, device), store, env)
        sharded = isinstance(trainer.objective, FSDPModule)
        record.item("FSDP2 applied (fully_shard over the one-rank mesh)", "passed" if sharded else "failed",
                    note=f"{type(trainer.objective).__name__}")  # fmt: skip
        result = trainer.run()
    finally:
        env.close()
    report(record, f"train FSDP2/{backend} (torchrun, 1 rank)", result, store, sizes, toy, device,
           time.perf_counter() - start)  # fmt: skip
