"""Which back-end samples for `opd rollout`: `rollout.engine` names one of GENERATORS.

Each builder loads the student from a checkpoint folder and returns a `Generator` (opd_cache/engine.py). A new
back-end is one more builder in GENERATORS (and one more value of `RolloutConfig.engine`); its module is imported
only when selected, so vLLM stays optional.
"""

from __future__ import annotations

from collections.abc import Callable

from opd_cache.config import RolloutConfig
from opd_cache.engine import Generator


def hf_generator(cfg: RolloutConfig, model_path: str, tokenizer) -> Generator:
    """The transformers sampling loop (rollout/hf_generate.py), CPU or GPU; refuses a model smaller than the
    tokenizer."""
    from opd_cache.rollout.hf_generate import HFGenerator

    engine = HFGenerator(
        model_path,
        tokenizer=tokenizer,
        device=cfg.device,
        dtype=cfg.dtype,
        attn_implementation=cfg.attn_implementation,
        eos_token_ids=eos_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        vocab_limit=len(tokenizer),
        seed=cfg.seed,
        trust_remote_code=cfg.trust_remote_code,
    )
    output_layer = engine.model.get_output_embeddings()
    model_vocab = output_layer.weight.shape[0] if output_layer is not None else engine.model.config.vocab_size
    if model_vocab < len(tokenizer):
        raise ValueError(
            f"student {model_path}: the model's output layer has {model_vocab} rows but the tokenizer "
            f"has {len(tokenizer)} tokens"
        )
    return engine


def vllm_generator(cfg: RolloutConfig, model_path: str, tokenizer) -> Generator:
    """vLLM (rollout/vllm_generate.py): its CPU build or GPUs."""
    from opd_cache.rollout.vllm_generate import VLLMGenerator

    # cfg.dtype by name: vLLM's "auto" would load float32 weights in bfloat16 on its CPU back-end
    return VLLMGenerator(
        model_path,
        tensor_parallel_size=cfg.tensor_parallel_size,
        dtype=cfg.dtype,
        seed=cfg.seed,
        max_logprobs=max(20, cfg.student_topk),
        trust_remote_code=cfg.trust_remote_code,
    )


# rollout.engine -> the builder of its Generator(cfg, model_path, tokenizer)
GENERATORS: dict[str, Callable[[RolloutConfig, str, object], Generator]] = {
    "hf": hf_generator,
    "vllm": vllm_generator,
}


def make_engine(cfg: RolloutConfig, model_path: str, tokenizer) -> Generator:
    """The generation engine named by `cfg.engine`, loaded from `model_path`."""
    build = GENERATORS.get(cfg.engine)
    if build is None:
        raise ValueError(f"--engine {cfg.engine!r}: no such rollout engine; use one of {', '.join(GENERATORS)}")
    return build(cfg, model_path, tokenizer)


def eos_ids(tokenizer) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path}: no eos_token, so responses could never stop")
    return [tokenizer.eos_token_id]
