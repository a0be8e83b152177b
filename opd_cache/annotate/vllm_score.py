"""Teacher scoring with vLLM (CPU build or GPUs): prompt log-probs over prompt + response.

vLLM scores a sequence without generating from it when asked for *prompt*
log-probs: we submit prompt + response as the prompt, generate one throw-away
token, and read `RequestOutput.prompt_logprobs`:

    prompt_logprobs[0]      None (nothing predicts the first token; {} with flat logprobs)
    prompt_logprobs[j]      {token_id: Logprob(logprob, rank, decoded_token)} for the distribution
                            that predicts token j: the top-k ids (rank 1..k) plus the actual
                            token j, which is an extra (k+1-th) entry when it is outside the top-k

Response token t sits at sequence position prompt_len + t, so its entry is
`prompt_logprobs[prompt_len + t]`. `convert_prompt_logprobs` turns that
structure into our arrays and is a pure function (unit-tested without vLLM).

Log-probs are vLLM's default raw log-probs: the model's distribution before
any sampling processing, at temperature 1. vLLM cannot return log-probs at
arbitrary extra ids, so union support (`teacher_support_logprobs`) needs the
hf engine. vLLM's softmax runs over the model's whole (possibly padded)
embedding; padded rows are untrained and carry no mass in practice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opd_cache.engine import EngineInfo, RowArrays, TeacherScores
from opd_cache.vllm_common import start_llm, vllm_engine_info


def convert_prompt_logprobs(
    prompt_logprobs: Sequence[Mapping[int, Any] | None], prompt_len: int, response_ids: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's `prompt_logprobs` of one prompt+response sequence -> (top-k ids, top-k log-probs, token log-prob).

    Returns `[R, k]` int32 ids sorted by log-prob (descending), `[R, k]` float32
    log-probs and `[R]` float32 log-probs of the response tokens, R = len(response_ids).
    """
    response_ids = np.asarray(response_ids)
    n = len(response_ids)
    if len(prompt_logprobs) != prompt_len + n:
        raise ValueError(
            f"vLLM returned {len(prompt_logprobs)} prompt log-prob entries for a sequence of "
            f"{prompt_len} prompt + {n} response tokens"
        )
    ids = np.zeros((n, k), dtype=np.int32)
    logprobs = np.zeros((n, k), dtype=np.float32)
    token_logprob = np.zeros(n, dtype=np.float32)
    for t in range(n):
        entry = prompt_logprobs[prompt_len + t]
        token = int(response_ids[t])
        if not entry or token not in entry:
            raise ValueError(
                f"vLLM returned no log-prob for response token {t} (id {token}); "
                f"was the request made with prompt_logprobs={k}?"
            )
        token_logprob[t] = entry[token].logprob
        # The sampled token is an extra entry when outside the top-k: keep the k best by log-prob
        # (ties broken by vLLM's rank, then id, so the choice is deterministic).
        ranked = sorted(entry.items(), key=lambda kv: (-kv[1].logprob, kv[1].rank or 0, kv[0]))
        if len(ranked) < k:
            raise ValueError(
                f"vLLM returned {len(ranked)} log-probs at response position {t}, expected at least "
                f"{k}; start the engine with max_logprobs >= {k}"
            )
        ids[t] = [token_id for token_id, _ in ranked[:k]]
        logprobs[t] = [lp.logprob for _, lp in ranked[:k]]
    return ids, logprobs, token_logprob


class VLLMScorer:
    """Scores (prompt, response) token sequences with vLLM; same interface as `HFScorer`."""

    def __init__(
        self,
        model_path: str,
        *,
        max_top_k: int,
        model_dtype: str = "float32",
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        gpu_memory_utilization: float = 0.9,
        vocab_limit: int | None = None,
        seed: int = 0,
        llm=None,
        **llm_kwargs,
    ):
        self.name = str(model_path)
        self.max_top_k = max_top_k
        if llm is not None:
            # An engine already started on this model (`opd check-engines` shares its sampler's): prompt
            # log-probs are the raw distribution in every logprobs_mode that returns log-probs.
            if llm.model_config.max_logprobs < max_top_k:
                raise ValueError(
                    f"top-k {max_top_k} is above the vllm engine's max_logprobs {llm.model_config.max_logprobs}"
                )
            self.llm = llm
        else:
            # max_logprobs: vLLM refuses prompt_logprobs above it (default 20), so it is the store's top_k
            self.llm = start_llm(
                model_path,
                model_dtype,
                max_logprobs=max_top_k,
                tensor_parallel_size=tensor_parallel_size,
                trust_remote_code=trust_remote_code,
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                **llm_kwargs,
            )
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
        self.embedding_size = int(getattr(config, "vocab_size", 0) or config.get_text_config().vocab_size)
        self.vocab_limit = min(vocab_limit or self.embedding_size, self.embedding_size)

    @property
    def info(self) -> EngineInfo:
        return vllm_engine_info(self.llm)

    def score(
        self, prompts: RowArrays, responses: RowArrays, k: int, support_ids: RowArrays | None = None
    ) -> TeacherScores:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if support_ids is not None:
            raise ValueError("teacher log-probs at the student's top-k ids (union support) need --engine hf")
        if not 1 <= k <= self.max_top_k:
            raise ValueError(
                f"top-k {k} is above the vllm engine's max_logprobs {self.max_top_k}"
                if k > self.max_top_k
                else f"top-k {k} must be at least 1"
            )
        lengths = np.array([len(r) for r in responses], dtype=np.int64)
        out = TeacherScores.zeros(lengths, k)
        rows = np.nonzero(lengths > 0)[0]  # empty responses have nothing to score
        requests = [
            TokensPrompt(prompt_token_ids=np.concatenate([prompts[i], responses[i]]).astype(int).tolist()) for i in rows
        ]
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, detokenize=False)
        results = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i, result in zip(rows, results):
            ids, lps, tok = convert_prompt_logprobs(result.prompt_logprobs, len(prompts[i]), responses[i], k)
            out.topk_ids[offsets[i] : offsets[i + 1]] = ids
            out.topk_logprobs[offsets[i] : offsets[i + 1]] = lps
            out.token_logprob[offsets[i] : offsets[i + 1]] = tok
        return out
