"""The loss on the GPU: fused_token_losses vs a materialised log-softmax, peak memory and time, at V = 151,936.

Each variant computes a distillation loss of N student positions and its gradients w.r.t. the hidden states
[N, H] and the output layer [V, H], both bf16 (what FSDP2's bf16 parameters hand the loss), teacher top-20:

  naive         logits = h @ W.T, full log_softmax, gather, masked logsumexp tail, plain autograd
  materialised  token_losses(h @ W.T, ...): opd_cache's reference path (opd_cache/losses/materialised.py)
  fused         fused_token_losses(h, W, ...): chunks of tokens, gradients in the forward (losses/fused.py);
                it computes in float32, so its matmuls run at float32 speed (TF32 off, torch's default)
  fused_tf32    the same with torch.backends.cuda.matmul.allow_tf32 = True
  fused_jsd     fused_token_losses with JSD (beta 0.5) on the teacher's top-20
  liger_jsd     Liger-Kernel's LigerFusedLinearJSD (beta 0.5), when its wheel is installed: the full-vocabulary
                teacher computed in the kernel from teacher hidden states [N, H] and weights [V, H] (its usage;
                the cache gives opd_cache the teacher's top-k instead), so it also does the teacher's matmul

Forward KL with a tail bucket, token-mean weights, unless named. Peak memory: `torch.cuda.max_memory_allocated`
above what the inputs hold, over one forward+backward; time: the median of 3 forward+backward, CUDA events,
after one warm-up. Ratios are from the same process: fused / materialised, materialised / naive, liger / fused_jsd.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from common import naive_topk_kl
from gpu_measure import median_time, peak_memory

TOP_K = 20
GPU_SIZES = [(4096, 151936, 896), (16384, 151936, 896)]  # (N, V, H): micro-batches of a 0.5B student
TOY_SIZES = [(64, 1000, 32)]
VARIANTS = ("naive", "materialised", "fused", "fused_tf32", "fused_jsd", "liger_jsd")


def make_inputs(n: int, vocab: int, hidden: int, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    scale = hidden**-0.25
    h = (torch.randn(n, hidden, generator=g, device=device) * scale).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, device=device) * scale).bfloat16().requires_grad_()
    ids = torch.randint(0, vocab, (n, TOP_K), generator=g, device=device)
    logits = torch.randn(n, TOP_K, generator=g, device=device).sort(1, descending=True).values * 2
    logprobs = logits.log_softmax(1) + torch.log(torch.tensor(0.9, device=device))  # top-k holds 90% of the mass
    weights = torch.full((n,), 1.0 / n, device=device)
    return dict(h=h, w=w, ids=ids, logprobs=logprobs, weights=weights)


def variant_step(variant: str, x: dict, api, chunk_size: int):
    """A zero-argument forward+backward of `variant` on inputs `x`; returns the loss (detached)."""
    kl, jsd = api.LossConfig(chunk_size=chunk_size), api.LossConfig(divergence="jsd", beta=0.5, chunk_size=chunk_size)
    h, w, ids, lps, weights = x["h"], x["w"], x["ids"], x["logprobs"], x["weights"]
    liger = None
    if variant == "liger_jsd":
        liger = api.liger_fused_linear_jsd(0.5)
        teacher_h, teacher_w = h.detach().clone(), w.detach().clone().mul_(2.0)

    def step():
        h.grad = w.grad = None
        if variant == "naive":
            loss = naive_topk_kl(h, w, ids, lps, weights)
        elif variant == "materialised":
            loss = (weights * api.token_losses(h @ w.t(), ids, lps, kl)).sum()
        elif variant in ("fused", "fused_tf32"):
            loss, _ = api.fused_token_losses(h, w, ids, lps, weights, kl)
        elif variant == "fused_jsd":
            loss, _ = api.fused_token_losses(h, w, ids, lps, weights, jsd)
        else:
            loss = liger(h, w, teacher_h, teacher_w)
        loss.backward()
        return loss.detach()

    return step


@contextlib.contextmanager
def tf32(enabled: bool):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@dataclasses.dataclass
class Result:
    seconds: float
    peak_bytes: int | None
    loss: float


def measure(variant: str, n: int, vocab: int, hidden: int, device, api, repeats: int) -> Result:
    x = make_inputs(n, vocab, hidden, device)
    step = variant_step(variant, x, api, chunk_size=1024 if device.type == "cuda" else 16)
    with tf32(variant == "fused_tf32"):
        loss, peak = peak_memory(step, device)  # the first run: memory (and the warm-up)
        seconds = median_time(step, device, repeats)
    return Result(seconds, peak, float(loss))


def run(record, device: torch.device, toy: bool) -> None:
    import gpu_api as api

    try:
        api.liger_fused_linear_jsd(0.5)
        liger_note = ""
    except ImportError as e:
        liger_note = f"liger-kernel not installed ({e})"
    repeats = 1 if toy else 3
    for n, vocab, hidden in TOY_SIZES if toy else GPU_SIZES:
        size = f"N={n} V={vocab} H={hidden}"
        results: dict[str, Result] = {}
        for variant in VARIANTS:
            if variant == "liger_jsd" and (liger_note or device.type != "cuda"):
                record.item(f"{size} {variant}", "skipped", note=liger_note or "Liger's kernels are triton: CUDA only")
                continue
            if variant == "fused_tf32" and device.type != "cuda":
                continue  # TF32 is a CUDA setting
            try:
                r = results[variant] = measure(variant, n, vocab, hidden, device, api, repeats)
            except torch.cuda.OutOfMemoryError:
                record.item(f"{size} {variant}", "failed", note="out of GPU memory")
                continue
            except Exception as e:
                record.item(f"{size} {variant}", "failed", note=f"{type(e).__name__}: {e}"[:300])
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            memory = f", peak {r.peak_bytes / 2**20:,.0f} MiB above the inputs" if r.peak_bytes is not None else ""
            record.figure(f"{size} {variant} time", round(r.seconds * 1000, 3), "ms", f"loss {r.loss:.5f}{memory}")
        ratio_pairs = [("fused", "materialised"), ("fused_tf32", "materialised"), ("materialised", "naive"),
                       ("liger_jsd", "fused_jsd")]  # fmt: skip
        for a, b in ratio_pairs:
            if a not in results or b not in results:
                continue
            ra, rb = results[a], results[b]
            record.figure(f"{size} time {a} / {b}", round(ra.seconds / rb.seconds, 3), "x")
            if ra.peak_bytes is not None and rb.peak_bytes:
                record.figure(f"{size} peak memory {a} / {b}", round(ra.peak_bytes / rb.peak_bytes, 4), "x")
        if "fused" in results and "materialised" in results:
            gap = abs(results["fused"].loss - results["materialised"].loss)
            ok = gap <= 1e-3 * max(1.0, abs(results["materialised"].loss))
            record.item(f"{size} |loss fused - materialised|", "passed" if ok else "failed", gap, "",
                        "same loss on both paths (tolerance 1e-3 relative)")  # fmt: skip
