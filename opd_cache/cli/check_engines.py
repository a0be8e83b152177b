"""`opd check-engines --model PATH`: do the HF and vLLM engines agree on this model, on this machine?

The first thing to run on a new GPU box (or after upgrading vLLM): the same prompts are sampled by each
engine and scored by the other, and both score the same sequences with top-k log-probs:

    rollout  vLLM samples at temperature 1; an HF forward of the same weights scores the sampled tokens
    rollout  HF samples; vLLM's prompt log-probs score the sampled tokens
    annotate both engines' top-k ids and log-probs over the same sequences

One vLLM engine serves all three (its prompt log-probs are the raw distribution whatever its logprobs
mode), so the check costs one engine start. Prints the largest log-prob difference and exits 1 when it is
above --tolerance.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import typer

from opd_cache.cli.common import app, console, user_errors

DEFAULT_PROMPTS = [
    "What is 12 + 7? Answer with a number.",
    "Write one sentence about the sea.",
    "List three colours:",
    "def fibonacci(n):",
    "The capital of France is",
    "Translate to French: good morning",
    "Q: If I have 3 apples and eat one, how many are left?\nA:",
    "Once upon a time",
]


@app.command("check-engines")
@user_errors
def check_engines_command(
    model: str = typer.Option(..., "--model", help="Checkpoint folder (safetensors) to load in both engines."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16 (both engines)."),
    prompts: str | None = typer.Option(
        None, "--prompts", help="Prompt file (JSONL/parquet) instead of the built-in prompts."
    ),
    num_prompts: int = typer.Option(8, "--num-prompts", min=1, help="How many prompts to use."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1, help="Tokens sampled per prompt."),
    top_k: int = typer.Option(8, "--top-k", min=1, help="Top-k log-probs compared per position."),
    device: str = typer.Option("auto", "--device", help="Device of the HF engine (auto: cuda if available)."),
    tolerance: float = typer.Option(1e-3, "--tolerance", help="Largest log-prob difference accepted (exit 1 above)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
) -> None:
    """Sample and score the same prompts with HF and vLLM; print the largest log-prob difference."""
    import torch  # here, not at the top: importing the CLI (e.g. the `opd run` supervisor) stays torch-free

    from opd_cache.annotate.hf_score import HFScorer
    from opd_cache.config import SamplingConfig
    from opd_cache.engine import torch_dtype
    from opd_cache.rollout.hf_generate import HFGenerator
    from opd_cache.tokenizer import load_tokenizer
    from opd_cache.vllm_common import import_vllm

    torch_dtype(dtype)  # a bad name fails before any model loads
    vllm = import_vllm()
    if not os.path.isdir(model):
        raise ValueError(f"--model {model}: not a checkpoint folder")
    tokenizer = load_tokenizer(model, padding_side="left")
    if prompts:
        from opd_cache.tasks.prompts import load_prompts

        prompt_ids = [list(map(int, p)) for p in load_prompts(prompts, tokenizer).prompt_ids[:num_prompts]]
    else:
        prompt_ids = [tokenizer(text)["input_ids"] for text in (DEFAULT_PROMPTS * num_prompts)[:num_prompts]]
    prompt_ids = [p for p in prompt_ids if p]
    if not prompt_ids:
        raise ValueError("no non-empty prompt to check")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens)

    import transformers

    console.print(
        f"check-engines {model}: dtype {dtype}, {len(prompt_ids)} prompts x {max_new_tokens} tokens, "
        f"top-{top_k}; vllm {vllm.__version__}, transformers {transformers.__version__}",
        soft_wrap=True,
    )
    from opd_cache.annotate.vllm_score import VLLMScorer
    from opd_cache.rollout.vllm_generate import VLLMGenerator

    console.print("starting the vLLM engine (a minute or more)...")
    v_sampler = VLLMGenerator(model, dtype=dtype, seed=seed, max_logprobs=max(top_k, 1))
    v_scorer = VLLMScorer(model, max_top_k=top_k, model_dtype=dtype, llm=v_sampler.llm)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    hf_sampler = HFGenerator(
        model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
        vocab_limit=len(tokenizer),
        seed=seed,
    )
    hf_scorer = HFScorer(hf_sampler.model)
    try:
        with torch.inference_mode():
            rows, ids_agree = _compare(v_sampler, v_scorer, hf_sampler, hf_scorer, prompt_ids, sampling, top_k, seed)
    finally:
        # The engine stops here: left to the interpreter's exit, vLLM 0.32's CPU engine sometimes aborted the
        # process ("terminate called without an active exception", exit -6) after the check had run.
        del v_scorer
        v_sampler.close()

    for label, diff, tokens in rows:
        console.print(f"  {label:40s} {tokens:6d} tokens  max |diff| {diff:.2e}")
    console.print(f"  {'annotate: top-' + str(top_k) + ' ids equal':40s} {ids_agree:.2%} of positions")
    largest = max(diff for _, diff, _ in rows)
    verdict = "OK" if largest <= tolerance else "ABOVE TOLERANCE"
    console.print(f"largest log-prob difference: {largest:.2e} (tolerance {tolerance:g}): {verdict}")
    sys.stdout.flush()
    if largest > tolerance:
        raise typer.Exit(1)


def _compare(v_sampler, v_scorer, hf_sampler, hf_scorer, prompt_ids, sampling, top_k: int, seed: int):
    """[(label, largest |log-prob difference|, tokens)] of the three comparisons, and the top-k id agreement."""
    from opd_cache.engine import SampleRequest  # imports torch: not at the top (the CLI's import stays torch-free)

    as_arrays = lambda seqs: [np.asarray(s, dtype=np.int64) for s in seqs]  # noqa: E731
    rows = []

    def sample_and_score(sampler, scorer, label: str):
        """One engine samples, the other scores the sampled tokens: a row comparing their log-probs."""
        out = sampler.generate(prompt_ids, SampleRequest(sampling, seed=seed))
        scored = scorer.score(as_arrays(prompt_ids), as_arrays([r.token_ids for r in out]), 1)
        diff = _max_diff(np.concatenate([r.logprobs for r in out]), scored.token_logprob)
        rows.append((label, diff, int(scored.num_tokens)))
        return out

    # 1. vLLM samples, HF scores the sampled tokens; 2. the other way round
    v_out = sample_and_score(v_sampler, hf_scorer, "rollout: vLLM samples, HF scores")
    sample_and_score(hf_sampler, v_scorer, "rollout: HF samples, vLLM scores")
    # 3. both score the same sequences (vLLM's samples) with top-k
    responses = as_arrays([r.token_ids for r in v_out])
    v_top = v_scorer.score(as_arrays(prompt_ids), responses, top_k)
    hf_top = hf_scorer.score(as_arrays(prompt_ids), responses, top_k)
    ids_agree = float((v_top.topk_ids == hf_top.topk_ids).mean()) if hf_top.num_tokens else 1.0
    rows.append(
        (
            f"annotate: top-{top_k} log-probs, vLLM vs HF",
            _max_diff(v_top.topk_logprobs, hf_top.topk_logprobs),
            int(hf_top.num_tokens),
        )
    )
    return rows, ids_agree


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max()) if a.size else 0.0
