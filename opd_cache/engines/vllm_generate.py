"""Student sampling with vLLM (optional extra: `pip install 'opd-cache[vllm]'`, GPUs).

Same interface as `hf_generate.HFGenerator`:

    engine.generate(prompt_token_ids, n, sampling, student_topk=0, seed=None) -> list[Response]
    engine.load_policy(path)

Behavior log-probs. By default vLLM returns log-probs of the *raw* model
distribution (before temperature / top-k / top-p). OPD needs the distribution
the token was drawn from, so the engine is built with
`logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2). `logprobs=0` asks for
the sampled token only; `logprobs=k_s` adds the top-k_s ids, which then are
the top ids of the processed distribution (the same order as the raw one for
every token that survives top-k / top-p filtering).

The conversion of vLLM's output objects into our arrays is the pure function
`responses_from_vllm`, unit-tested with objects of vLLM's documented structure
(`RequestOutput.outputs: list[CompletionOutput]`; `CompletionOutput.token_ids`,
`.logprobs: list[dict[int, Logprob]]` (or a `FlatLogprobs`, which indexes the
same way), `.finish_reason`). Everything that touches vLLM itself is imported
lazily, so this module imports without it.

Reloading weights for a new policy version (`load_policy`): the worker
processes read the checkpoint's safetensors themselves and call the model's
`load_weights` through `LLM.collective_rpc`, then the prefix cache (computed by
the old weights) is reset. If this vLLM has no such path, the engine is
re-created from the new checkpoint (slower: minutes for big models, but
always correct). NOT TESTED in this repository's CI (no GPU / vLLM there).
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any, Sequence

import numpy as np

from opd_cache.config import SamplingConfig
from opd_cache.engines.hf_generate import FINISH_LENGTH, FINISH_STOP, Response

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- pure conversion (unit-tested anywhere)
def _sampled_logprob(position: dict, token_id: int, where: str) -> float:
    entry = position.get(token_id) if position else None
    if entry is None:
        raise ValueError(f"{where}: vLLM returned no log-prob for the sampled token {token_id} "
                         f"(was SamplingParams.logprobs set?)")
    return float(entry.logprob)


def _topk_ids(position: dict, k: int, where: str) -> list[int]:
    # The dict holds the sampled token (with its true rank) and the top-k tokens (ranks 1..k).
    ranked = sorted((entry.rank, token_id) for token_id, entry in position.items()
                    if entry.rank is not None and entry.rank <= k)
    if len(ranked) < k:
        raise ValueError(f"{where}: vLLM returned {len(ranked)} top log-probs, expected {k} "
                         f"(SamplingParams.logprobs must be >= student_topk)")
    return [token_id for _, token_id in ranked[:k]]


def responses_from_vllm(request_outputs: Sequence[Any], n: int, student_topk: int = 0) -> list[Response]:
    """vLLM `RequestOutput`s (one per prompt, in prompt order) -> `n` Responses per prompt, prompt-major."""
    responses: list[Response] = []
    for p, request in enumerate(request_outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise ValueError(f"vLLM returned {len(completions)} completions for prompt {p}, expected n={n}")
        for completion in completions:
            where = f"prompt {p} sample {completion.index}"
            token_ids = np.asarray(list(completion.token_ids), dtype=np.int32)
            positions = completion.logprobs
            if positions is None or len(positions) != len(token_ids):
                got = None if positions is None else len(positions)
                raise ValueError(f"{where}: {len(token_ids)} tokens but log-probs for {got} positions")
            logprobs = np.array([_sampled_logprob(positions[t], int(tok), where) for t, tok in enumerate(token_ids)],
                                dtype=np.float32)
            topk = None
            if student_topk:
                topk = np.array([_topk_ids(positions[t], student_topk, where) for t in range(len(token_ids))],
                                dtype=np.int32).reshape(len(token_ids), student_topk)
            if completion.finish_reason == "length":
                finish = FINISH_LENGTH
            elif completion.finish_reason == "stop":
                finish = FINISH_STOP
            else:  # "abort" or None: the request did not complete
                raise ValueError(f"{where}: vLLM finished with {completion.finish_reason!r}, "
                                 f"expected 'stop' or 'length'")
            responses.append(Response(token_ids=token_ids, logprobs=logprobs, finish_reason=finish, topk_ids=topk))
    return responses


def sampling_params_kwargs(sampling: SamplingConfig, n: int, student_topk: int = 0, seed: int | None = None) -> dict:
    """Keyword arguments of `vllm.SamplingParams` for our sampling config."""
    return {
        "n": n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # -1 = no top-k in every vLLM version
        "max_tokens": sampling.max_new_tokens,
        "logprobs": student_topk,  # 0 = only the sampled token's log-prob
        "stop": list(sampling.stop) or None,
        "seed": seed,
        "detokenize": bool(sampling.stop),  # text is only needed to find stop strings
    }


# ---------------------------------------------------------------- the engine (needs vLLM and a GPU)
def _load_weights_on_worker(worker, path: str) -> int:
    """Runs inside every vLLM worker process: stream the checkpoint into the model in place."""
    from safetensors.torch import safe_open

    def weights():
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    for key in f.keys():
                        yield key, f.get_tensor(key)

    worker.model_runner.model.load_weights(weights=weights())
    return 1


class VLLMGenerator:
    def __init__(self, model_path: str | os.PathLike, *, tensor_parallel_size: int = 1, dtype: str = "auto",
                 seed: int = 0, max_logprobs: int = 20, gpu_memory_utilization: float = 0.85,
                 trust_remote_code: bool = False, **llm_kwargs):
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise ValueError("engine vllm: vLLM is not installed (pip install 'opd-cache[vllm]'), "
                             "or use --engine hf") from None
        # collective_rpc pickles `_load_weights_on_worker` to vLLM's worker processes (our own processes);
        # vLLM V1 only allows sending functions when this is set.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm_kwargs.setdefault("load_format", "safetensors")  # "auto" falls back to pickled *.bin weights
        self._llm_kwargs = dict(tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                                max_logprobs=max_logprobs, gpu_memory_utilization=gpu_memory_utilization,
                                trust_remote_code=trust_remote_code, logprobs_mode="processed_logprobs",
                                **llm_kwargs)
        self.llm = self._make_llm(os.fspath(model_path))

    def _make_llm(self, model_path: str):
        from vllm import LLM

        return LLM(model=model_path, **self._llm_kwargs)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig,
                 student_topk: int = 0, seed: int | None = None) -> list[Response]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompt_token_ids:
            return []
        params = SamplingParams(**sampling_params_kwargs(sampling, n, student_topk, seed))
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return responses_from_vllm(outputs, n, student_topk)

    def load_policy(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        try:
            self.llm.collective_rpc(_load_weights_on_worker, args=(path,))
            self.llm.reset_prefix_cache()
            return
        except Exception as e:  # noqa: BLE001 - any failure falls back to the always-correct path
            logger.warning("vLLM in-place weight reload failed (%s); re-creating the engine from %s", e, path)
        del self.llm
        gc.collect()
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
        self.llm = self._make_llm(path)
