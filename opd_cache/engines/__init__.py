"""Model back-ends.

- `hf_generate.py` / `vllm_generate.py`: sampling for `opd rollout`
  (`generate(prompt_token_ids, n, sampling) -> responses, behavior log-probs, finish reasons`).
- `hf_score.py` / `vllm_score.py`: teacher scoring for `opd annotate`
  (`score(sequences, k, support_ids=None) -> top-k ids/log-probs, sampled-token log-prob`).

HF transformers is the embedded default (CPU or GPU); vLLM is an optional extra
imported only when selected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class EngineInfo:
    """What produced a shard, recorded in its metadata: the engine, its library's version, the model's dtype."""

    engine: str  # "hf" | "vllm"
    version: str  # transformers.__version__ or vllm.__version__
    dtype: str  # the dtype the weights were loaded in (not the one asked for: they must agree)


def hf_engine_info(model: torch.nn.Module) -> EngineInfo:
    import transformers

    return EngineInfo("hf", transformers.__version__, str(next(model.parameters()).dtype).removeprefix("torch."))


def engine_fields(engine) -> dict:
    """ShardMeta keyword arguments for `engine.info` (none for an engine without one, e.g. a test double)."""
    info = getattr(engine, "info", None)
    if not isinstance(info, EngineInfo):
        return {}
    return {"engine": info.engine, "engine_version": info.version, "model_dtype": info.dtype}
