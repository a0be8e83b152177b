"""Which back-end scores for `opd annotate`: `annotate.engine` names one of SCORERS.

Each builder loads the teacher once per worker and returns a `Scorer` (opd_cache/engine.py) able to keep `top_k`
log-probs per token over the first `vocab_size` ids (the tokenizer's). A new back-end is one more builder in
SCORERS (and one more value of `AnnotateConfig.engine`); its module is imported only when selected, so vLLM stays
optional.
"""

from __future__ import annotations

from collections.abc import Callable

from opd_cache.config import AnnotateConfig
from opd_cache.engine import Scorer


def _settings(cfg: AnnotateConfig, *names: str) -> dict:
    """The named `annotate` settings, as keyword arguments of the engine's constructor (same names)."""
    return {name: getattr(cfg, name) for name in names}


def hf_scorer(cfg: AnnotateConfig, top_k: int, vocab_size: int) -> Scorer:
    """transformers (annotate/hf_score.py), CPU or GPU: batches packed by padded tokens, the head in chunks."""
    from opd_cache.annotate.hf_score import HFScorer

    settings = _settings(
        cfg, "model_dtype", "device", "attn_implementation", "trust_remote_code", "max_tokens_per_batch",
        "head_chunk_tokens", "padding_side",
    )  # fmt: skip
    return HFScorer.load(cfg.teacher, vocab_limit=vocab_size, **settings)


def vllm_scorer(cfg: AnnotateConfig, top_k: int, vocab_size: int) -> Scorer:
    """vLLM (annotate/vllm_score.py): prompt log-probs, its engine sized for `top_k`."""
    from opd_cache.annotate.vllm_score import VLLMScorer

    settings = _settings(cfg, "model_dtype", "tensor_parallel_size", "trust_remote_code", "gpu_memory_utilization")
    return VLLMScorer(cfg.teacher, max_top_k=top_k, vocab_limit=vocab_size, **settings)


# annotate.engine -> the builder of its Scorer(cfg, top_k, vocab_size)
SCORERS: dict[str, Callable[[AnnotateConfig, int, int], Scorer]] = {"hf": hf_scorer, "vllm": vllm_scorer}


def make_scorer(cfg: AnnotateConfig, top_k: int, vocab_size: int) -> Scorer:
    """The configured scoring engine, loaded once per worker."""
    build = SCORERS.get(cfg.engine)
    if build is None:
        raise ValueError(f"--engine {cfg.engine!r}: no such annotate engine; use one of {', '.join(SCORERS)}")
    return build(cfg, top_k, vocab_size)
