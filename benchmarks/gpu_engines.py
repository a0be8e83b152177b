"""The HF engines on the GPU with the 0.5B student: rollout and annotate parity in bf16, attention, publish + reload.

1. rollout: `HFGenerator` in bfloat16 samples 64 prompts (32-128 tokens, left-padded) x 256 new tokens; each
   behavior log-prob is compared with a bf16 teacher-forced forward of prompt + response (the parity that
   tests/test_hf_generate.py::test_behavior_logprobs_match_teacher_forced_forward checks in float32 on a CPU,
   atol 1e-4); then the same in float32 on the GPU, 16 prompts x 64 tokens. Figures: mean / max |difference|,
   generated tokens/s.
2. annotate: `HFScorer` in bfloat16 scores those responses (top-64) and is compared with a direct bf16 forward's
   log-softmax top-64: top-k id agreement, max |log-prob difference|, scored tokens/s.
3. attention: the model loaded with attn_implementation sdpa, eager and flash_attention_2 (only when flash-attn
   imports), one bf16 forward of 8 x 1024 tokens each: time, and max |log-prob difference| from sdpa; what
   `auto` resolves to on this device.
4. publish + reload: `PolicyPublisher` writes the float32 weights as the trainer does (submit: the copy to the
   CPU; wait: the checkpoint written and published), in float32 and in bfloat16, then the rollout engine's
   `load_policy` reloads the bf16 version in place; the reloaded weights must equal the published ones.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from gpu_measure import median_time, random_prompts, sync

GPU = dict(prompts=64, prompt_len=(32, 128), new_tokens=256, fp32_prompts=16, fp32_new=64, top_k=64, attn=(8, 1024))
TOY = dict(prompts=4, prompt_len=(4, 12), new_tokens=8, fp32_prompts=2, fp32_new=4, top_k=8, attn=(2, 16))
BF16_MEAN_BOUND = 0.05  # nats: mean |behavior - forward| in bf16 (rounding of two different kernels' orders)
FP32_MAX_BOUND = 1e-3  # nats: max |behavior - forward| in float32 (the CPU tier's bound is 1e-4 on tiny models)


@torch.inference_mode()
def forward_logprobs(api, model, prompts: list[list[int]], responses: list, device) -> list[torch.Tensor]:
    """Log-probs [R_i, V] predicting each response token, from one right-padded forward of prompt + response."""
    rows = [list(p) + [int(t) for t in r] for p, r in zip(prompts, responses)]
    ids, mask = api.right_pad(rows, device)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return [
        torch.log_softmax(logits[i, len(p) - 1 : len(p) - 1 + len(r)], -1)
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]


def behavior_parity(api, student: Path, dtype: str, device, prompts, new_tokens: int, record, tokenizer):
    """Sample with HFGenerator in `dtype`; (responses, generator, [|behavior - forward|] over all tokens)."""
    generator = api.HFGenerator(student, device=str(device), dtype=dtype, attn_implementation="sdpa",
                                eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, seed=0)  # fmt: skip
    request = api.SampleRequest(api.SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens), n=1, seed=3)
    generator.generate(prompts[:2], api.SampleRequest(api.SamplingConfig(max_new_tokens=2), n=1, seed=0))  # warm-up
    sync(device)
    start = time.perf_counter()
    responses = generator.generate(prompts, request)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in responses)
    record.figure(f"rollout {dtype} generate", round(tokens / seconds), "tokens/s",
                  f"{len(prompts)} prompts x {new_tokens} new tokens, {seconds:.2f} s")  # fmt: skip
    expected = forward_logprobs(api, generator.model, prompts, [r.token_ids for r in responses], device)
    diffs = []
    for r, lp in zip(responses, expected):
        got = torch.as_tensor(r.logprobs, device=device)
        diffs.append((got - lp.gather(-1, torch.as_tensor(r.token_ids, device=device).long()[:, None])[:, 0]).abs())
    return responses, generator, torch.cat(diffs)


def rollout(api, student, device, sizes, record, tokenizer):
    vocab = generator_vocab(student)
    prompts = random_prompts(sizes["prompts"], sizes["prompt_len"], vocab)
    responses, generator, diff = behavior_parity(api, student, "bfloat16", device, prompts, sizes["new_tokens"], record, tokenizer)  # fmt: skip
    mean, top = float(diff.mean()), float(diff.max())
    record.item("rollout bf16 behavior log-probs vs bf16 forward: mean |diff|",
                "passed" if mean <= BF16_MEAN_BOUND else "failed", round(mean, 5), "nats",
                f"max {top:.4f}, p99 {float(diff.quantile(0.99)):.4f} over {diff.numel():,} tokens; bound {BF16_MEAN_BOUND}")  # fmt: skip
    _, fp32_generator, diff32 = behavior_parity(
        api, student, "float32", device, prompts[: sizes["fp32_prompts"]], sizes["fp32_new"], record, tokenizer
    )
    del fp32_generator
    top32 = float(diff32.max())
    record.item("rollout float32 behavior log-probs vs float32 forward: max |diff|",
                "passed" if top32 <= FP32_MAX_BOUND else "failed", top32, "nats",
                f"mean {float(diff32.mean()):.2e} over {diff32.numel():,} tokens; bound {FP32_MAX_BOUND}")  # fmt: skip
    return prompts, responses, generator


def generator_vocab(student: Path) -> int:
    import json

    return json.loads((student / "config.json").read_text())["vocab_size"]


def annotate(api, student, device, sizes, record, prompts, responses):
    import numpy as np

    k = sizes["top_k"]
    scorer = api.HFScorer.load(str(student), model_dtype="bfloat16", device=str(device), max_tokens_per_batch=16384)
    prompt_arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    response_arrays = [np.asarray(r.token_ids, dtype=np.int64) for r in responses]
    scorer.score(prompt_arrays[:2], response_arrays[:2], k)  # warm-up
    sync(device)
    start = time.perf_counter()
    scores = scorer.score(prompt_arrays, response_arrays, k)
    sync(device)
    seconds = time.perf_counter() - start
    record.figure("annotate bf16 score", round(scores.num_tokens / seconds), "tokens/s",
                  f"top-{k} of {scores.num_tokens:,} response tokens, {seconds:.2f} s")  # fmt: skip
    direct = torch.cat(forward_logprobs(api, scorer.model, prompts, [r.token_ids for r in responses], device))
    top = direct.topk(k, dim=-1)
    got_ids = torch.as_tensor(scores.topk_ids, device=device).long()
    agree = (got_ids[:, :, None] == top.indices[:, None, :]).any(-1).float().mean()
    value_gap = (torch.as_tensor(scores.topk_logprobs, device=device) - top.values).abs().max()
    targets = torch.as_tensor(np.concatenate(response_arrays), device=device)[:, None]
    token_gap = (torch.as_tensor(scores.token_logprob, device=device) - direct.gather(1, targets)[:, 0]).abs().max()
    record.item("annotate top-k ids agree with a direct bf16 forward", "passed" if float(agree) >= 0.99 else "failed",
                round(float(agree), 5), "", f"share of top-{k} ids in both (bound 0.99)")  # fmt: skip
    record.item("annotate top-k log-probs vs direct forward: max |diff|",
                "passed" if float(value_gap) <= 0.1 else "failed", round(float(value_gap), 5), "nats",
                f"sorted top-{k} values; sampled token's: {float(token_gap):.4f} (bound 0.1)")  # fmt: skip
    del scorer


def attention(api, student, device, sizes, record):
    rows, width = sizes["attn"]
    dtype = torch.bfloat16
    record.figure("attn_implementation auto resolves to", api.resolve_attn_implementation("auto", device, dtype))
    ids = torch.randint(1, generator_vocab(student), (rows, width), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    reference = None
    for impl in ("sdpa", "eager", "flash_attention_2"):
        if impl == "flash_attention_2":
            try:
                import flash_attn  # noqa: F401
            except ImportError:
                record.item(f"attention {impl}", "skipped", note="flash-attn not installed")
                continue
        try:
            model = api.load_causal_lm(student, dtype=dtype, attn_implementation=impl).to(device)
        except Exception as e:
            record.item(f"attention {impl}", "failed", note=f"load: {type(e).__name__}: {e}"[:300])
            continue
        with torch.inference_mode():
            forward = lambda m=model: m(input_ids=ids).logits  # noqa: E731
            logprobs = forward().float().log_softmax(-1)
            seconds = median_time(forward, device, 3)
        gap = "" if reference is None else f"; max |log-prob - sdpa's| {float((logprobs - reference).abs().max()):.4f}"
        record.figure(f"attention {impl} forward", round(seconds * 1000, 2), "ms", f"{rows} x {width} tokens bf16{gap}")
        if reference is None:
            reference = logprobs
        del model


def publish_and_reload(api, student, device, record, generator, work: Path):
    tokenizer = api.load_tokenizer(str(student))
    model = api.load_causal_lm(student, dtype=torch.float32).to(device)  # as the trainer holds it
    with torch.no_grad():  # "trained" weights: the reload must change what the rollout engine holds
        for param in model.parameters():
            param.mul_(1.25)
    holder = torch.nn.Module()
    holder.model = model  # the publisher reads `objective.model`
    store = api.Store(work / "publish-store")
    version = 0
    for dtype in ("float32", "bfloat16"):
        version += 1
        publisher = api.PolicyPublisher(store, model, tokenizer, dtype=dtype)
        try:
            start = time.perf_counter()
            publisher.submit(version, holder)
            submitted = time.perf_counter() - start
            publisher.wait()
            total = time.perf_counter() - start
        finally:
            publisher.close()
        size = sum(f.stat().st_size for f in store.local_path(api.layout.policy_dir(version)).iterdir())
        record.figure(f"publish {dtype}", round(total, 2), "s",
                      f"submit (copy to CPU) {submitted:.2f} s, then write + publish; {size / 2**20:,.0f} MiB")  # fmt: skip
    if generator is None:
        record.item("reload (load_policy)", "skipped", note="no rollout engine (the rollout part failed)")
        return
    folder = store.local_path(api.layout.policy_dir(version))
    published = model.get_input_embeddings().weight.to(torch.bfloat16)
    stale = not torch.equal(generator.model.get_input_embeddings().weight, published)
    sync(device)
    start = time.perf_counter()
    generator.load_policy(folder)
    sync(device)
    seconds = time.perf_counter() - start
    same = torch.equal(generator.model.get_input_embeddings().weight, published)
    ok = stale and same
    note = (
        "the engine's weights differed before and equal the published ones after"
        if ok
        else (f"differed before: {stale}, equal after: {same}")
    )
    record.item("reload bf16 policy into the rollout engine (load_policy)", "passed" if ok else "failed",
                round(seconds, 2), "s", note)  # fmt: skip


def run(record, device: torch.device, toy: bool, work: Path) -> None:
    import gpu_api as api
    from gpu_measure import ensure_student

    sizes = TOY if toy else GPU
    start = time.perf_counter()
    student = ensure_student(work / "student", toy, device)
    record.figure(
        "student built from its config and saved", round(time.perf_counter() - start, 1), "s", str(student.name)
    )
    tokenizer = api.load_tokenizer(str(student))
    generator = prompts = responses = None
    parts = [
        ("rollout", lambda: rollout(api, student, device, sizes, record, tokenizer)),
        ("annotate", lambda: annotate(api, student, device, sizes, record, prompts, responses)),
        ("attention", lambda: attention(api, student, device, sizes, record)),
        ("publish", lambda: publish_and_reload(api, student, device, record, generator, work)),
    ]
    for name, part in parts:
        if name == "annotate" and responses is None:
            record.item("annotate", "skipped", note="no responses (the rollout part failed)")
            continue
        try:
            out = part()
            if name == "rollout":
                prompts, responses, generator = out
        except Exception as e:  # one part failing does not stop the next
            record.item(name, "failed", note=f"{type(e).__name__}: {e}"[:400])
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
