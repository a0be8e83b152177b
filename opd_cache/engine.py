"""What every model back-end shares: the engine-neutral types, the two interfaces, device and dtype.

The back-ends live with the stage that uses them:

- `rollout/hf_generate.py` / `rollout/vllm_generate.py` implement `Generator` (sampling for `opd rollout`);
- `annotate/hf_score.py` / `annotate/vllm_score.py` implement `Scorer` (teacher scoring for `opd annotate`).

HF transformers is the embedded default (CPU or GPU); vLLM is an optional extra imported only when
selected (`vllm_common.py` holds what its two engines share).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from opd_cache.config import SamplingConfig

# One array per row of a batch: token ids [len], or a row's support ids [len, k_s].
RowArrays = Sequence[np.ndarray]

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


# ---------------------------------------------------------------- sampling (rollout)
FINISH_STOP = "stop"  # EOS or a stop string
FINISH_LENGTH = "length"  # max_new_tokens reached


@dataclass(frozen=True)
class SampleRequest:
    """What one `Generator.generate` call samples for each of its prompts."""

    sampling: SamplingConfig  # temperature, top-k / top-p, max_new_tokens, stop strings
    n: int = 1  # samples per prompt: response i * n + j is sample j of prompt i
    student_topk: int = 0  # also record the student's top-k ids at every position (union support)
    seed: int | None = None  # None: continue the engine's own random stream


@dataclass
class Response:
    """One sampled response, as every engine returns it."""

    token_ids: np.ndarray  # int32 [T]; includes the EOS token when finish_reason == "stop" by EOS
    logprobs: np.ndarray  # float32 [T]; behavior log-prob of each token (the distribution sampled from)
    finish_reason: str  # "stop" | "length"
    topk_ids: np.ndarray | None = None  # int32 [T, k_s]: the student's top-k ids per position, when asked


class Generator(Protocol):
    """A sampling back-end of `opd rollout` (rollout/hf_generate.py, rollout/vllm_generate.py)."""

    info: EngineInfo

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], request: SampleRequest) -> list[Response]: ...

    def load_policy(self, path: str | os.PathLike) -> None: ...


# ---------------------------------------------------------------- scoring (annotate)
@dataclass
class TeacherScores:
    """Teacher outputs for N rows, flattened over their response tokens (row after row, input order)."""

    lengths: np.ndarray  # [N] int64, response tokens per row
    topk_ids: np.ndarray  # [T, k] int32, sorted by log-prob, descending
    topk_logprobs: np.ndarray  # [T, k] float32
    token_logprob: np.ndarray  # [T] float32, log-prob of the sampled token (exact, even outside the top-k)
    support_logprobs: np.ndarray | None = None  # [T, k_s] float32, log-probs at the given support ids

    @classmethod
    def zeros(cls, lengths: np.ndarray, k: int, support_k: int | None = None) -> TeacherScores:
        """All-zero scores of rows with `lengths` response tokens, for a back-end to fill in (no support: None)."""
        total = int(lengths.sum())
        return cls(
            lengths=lengths,
            topk_ids=np.zeros((total, k), dtype=np.int32),
            topk_logprobs=np.zeros((total, k), dtype=np.float32),
            token_logprob=np.zeros(total, dtype=np.float32),
            support_logprobs=np.zeros((total, support_k), dtype=np.float32) if support_k is not None else None,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.token_logprob.shape[0])


class Scorer(Protocol):
    """A teacher back-end of `opd annotate` (annotate/hf_score.py, annotate/vllm_score.py)."""

    info: EngineInfo

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        k: int,
        support_ids: Sequence[np.ndarray] | None = None,
    ) -> TeacherScores: ...
