"""How the GPU check measures: the device, timing with CUDA events, peak memory, the 0.5B student, MFU.

Shared by benchmarks/gpu_loss.py, gpu_engines.py and gpu_train.py. Every measurement runs at one of two sizes:
the real one on a CUDA device, or `toy` (the dry run: tiny sizes on the CPU, the same code path).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizer"

# Dense bf16 peak (no sparsity) used for MFU, by a word in the device name. H200 SXM and H100 SXM: 989 TFLOP/s
# (NVIDIA's 1,979 is with 2:4 sparsity). Another device: GPU_CHECK_PEAK_TFLOPS=... or no MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}

# Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 query / 2 key-value heads, V = 151,936, tied embeddings):
# 494M parameters, built from this config alone (nothing is downloaded). The toy one runs on a CPU in seconds.
STUDENT_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                   rms_norm_eps=1e-6, tie_word_embeddings=True)  # fmt: skip
STUDENT_TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip
# A random model's next-token distributions are nearly uniform (logit std ~0.6 at init); the final norm scaled by
# this makes them peaked like a trained LM's (logit std ~5), so the bf16 parities are measured on a real spread.
FINAL_NORM_SCALE = 8.0


def pick_device(toy: bool) -> torch.device:
    """cuda for the real sizes (an error without one); the CPU for the toy sizes of the dry run."""
    if toy:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False); the dry run is --dry-run")
    return torch.device("cuda")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call: CUDA events around it on a GPU (device time, no host-side jitter), else wall time."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    return statistics.median(time_once(fn, device) for _ in range(repeats))


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[object, int | None]:
    """(fn(), bytes allocated at its peak above what was allocated before), None off CUDA.

    `torch.cuda.max_memory_allocated` counts live tensors (not the caching allocator's reserve), so one process
    can measure variants one after the other."""
    if device.type != "cuda":
        return fn(), None
    sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    sync(device)
    return result, torch.cuda.max_memory_allocated(device) - before


def peak_flops(device_name: str) -> float | None:
    import os

    if os.environ.get("GPU_CHECK_PEAK_TFLOPS"):
        return float(os.environ["GPU_CHECK_PEAK_TFLOPS"]) * 1e12
    return next((flops for word, flops in PEAK_BF16_FLOPS.items() if word in device_name), None)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---------------------------------------------------------------- the student
def student_config(toy: bool):
    from transformers import Qwen2Config

    return Qwen2Config(**(STUDENT_TOY if toy else STUDENT_05B))


def count_parameters(config) -> tuple[int, int]:
    """(all parameters, those outside the input embedding) of a model of `config`, built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


def ensure_student(folder: Path, toy: bool, device: torch.device) -> Path:
    """A Qwen2-style student saved in `folder` (bf16 safetensors + the shipped tiny tokenizer), built once per
    check from its config on `device` and reused by the later steps."""
    from gpu_api import load_tokenizer, save_causal_lm
    from transformers import AutoModelForCausalLM

    ready = folder / "_READY"
    if ready.exists():
        return folder
    tokenizer = load_tokenizer(str(TOKENIZER))
    config = student_config(toy)
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    with torch.no_grad():
        model.model.norm.weight.mul_(FINAL_NORM_SCALE)
    save_causal_lm(model, tokenizer, folder)
    ready.write_text("ok\n")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return folder


def random_prompts(count: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in sizes]
