"""Model back-ends.

- `hf_generate.py` / `vllm_generate.py`: sampling for `opd rollout`
  (`generate(prompt_token_ids, n, sampling) -> responses, behavior log-probs, finish reasons`).
- `hf_score.py` / `vllm_score.py`: teacher scoring for `opd annotate`
  (`score(sequences, k, support_ids=None) -> top-k ids/log-probs, sampled-token log-prob`).

HF transformers is the embedded default (CPU or GPU); vLLM is an optional extra
imported only when selected.
"""

from __future__ import annotations

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
