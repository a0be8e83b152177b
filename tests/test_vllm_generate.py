"""The vLLM engine: the output conversion runs everywhere; the engine itself where vLLM and a GPU are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from opd_cache.config import SamplingConfig
from opd_cache.engines.vllm_generate import responses_from_vllm, sampling_params_kwargs


# Stand-ins with the documented structure of vllm.outputs.RequestOutput / CompletionOutput and
# vllm.logprobs.Logprob (field names and types as in vLLM's source).
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def position(sampled: int, sampled_lp: float, sampled_rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """What vLLM returns per position: the sampled token (true rank) first, then the top-k (ranks 1..k)."""
    entries = {sampled: Logprob(sampled_lp, sampled_rank)}
    for rank, (token, lp) in enumerate(top, start=1):
        entries[token] = Logprob(lp, rank)
    return entries


def test_responses_from_vllm_converts_the_documented_structure():
    # prompt 0: two samples delivered out of order; sample 1 samples a token outside the top-2
    s0 = CompletionOutput(index=0, text="ab", token_ids=[7, 1], cumulative_logprob=-1.5, finish_reason="stop",
                          logprobs=[position(7, -0.5, 1, [(7, -0.5), (3, -1.2)]),
                                    position(1, -1.0, 2, [(4, -0.7), (1, -1.0)])])
    s1 = CompletionOutput(index=1, text="xyz", token_ids=(9, 9, 5), cumulative_logprob=-9.0, finish_reason="length",
                          logprobs=[position(9, -4.0, 6, [(3, -0.1), (7, -2.5)]),
                                    position(9, -0.2, 1, [(9, -0.2), (2, -2.0)]),
                                    position(5, -0.3, 1, [(5, -0.3), (8, -1.6)])])
    p1 = CompletionOutput(index=0, text="", token_ids=[1], cumulative_logprob=-0.1, finish_reason="stop",
                          logprobs=[position(1, -0.1, 1, [(1, -0.1), (6, -2.6)])])
    p1b = CompletionOutput(index=1, text="", token_ids=[], cumulative_logprob=0.0, finish_reason="length", logprobs=[])
    outputs = [RequestOutput("0", None, [4, 5], None, [s1, s0]), RequestOutput("1", None, [6], None, [p1, p1b])]

    responses = responses_from_vllm(outputs, n=2, student_topk=2)
    assert len(responses) == 4
    a, b, c, d = responses
    assert a.token_ids.tolist() == [7, 1] and a.token_ids.dtype == np.int32
    np.testing.assert_array_equal(a.logprobs, np.float32([-0.5, -1.0]))
    assert a.finish_reason == "stop" and a.topk_ids.tolist() == [[7, 3], [4, 1]]
    assert b.token_ids.tolist() == [9, 9, 5] and b.finish_reason == "length"
    np.testing.assert_array_equal(b.logprobs, np.float32([-4.0, -0.2, -0.3]))
    assert b.topk_ids.tolist() == [[3, 7], [9, 2], [5, 8]]  # the rank-6 sampled token is not in the top-2
    assert c.token_ids.tolist() == [1] and c.topk_ids.tolist() == [[1, 6]]
    assert d.token_ids.tolist() == [] and d.logprobs.shape == (0,) and d.topk_ids.shape == (0, 2)

    without_topk = responses_from_vllm(outputs, n=2)
    assert all(r.topk_ids is None for r in without_topk)
    np.testing.assert_array_equal(without_topk[1].logprobs, b.logprobs)


def test_responses_from_vllm_refuses_incomplete_outputs():
    ok = CompletionOutput(index=0, text="", token_ids=[3], cumulative_logprob=None, finish_reason="stop",
                          logprobs=[position(3, -0.4, 1, [])])
    with pytest.raises(ValueError, match="1 completions for prompt 0, expected n=2"):
        responses_from_vllm([RequestOutput("0", None, [1], None, [ok])], n=2)
    no_logprobs = CompletionOutput(index=0, text="", token_ids=[3], cumulative_logprob=None, finish_reason="stop",
                                   logprobs=None)
    with pytest.raises(ValueError, match="prompt 0 sample 0: 1 tokens but log-probs for None positions"):
        responses_from_vllm([RequestOutput("0", None, [1], None, [no_logprobs])], n=1)
    wrong_token = CompletionOutput(index=0, text="", token_ids=[3], cumulative_logprob=None, finish_reason="stop",
                                   logprobs=[{4: Logprob(-0.1, 1)}])
    with pytest.raises(ValueError, match="no log-prob for the sampled token 3"):
        responses_from_vllm([RequestOutput("0", None, [1], None, [wrong_token])], n=1)
    aborted = CompletionOutput(index=0, text="", token_ids=[3], cumulative_logprob=None, finish_reason="abort",
                               logprobs=[position(3, -0.4, 1, [])])
    with pytest.raises(ValueError, match="finished with 'abort'"):
        responses_from_vllm([RequestOutput("0", None, [1], None, [aborted])], n=1)
    with pytest.raises(ValueError, match="returned 1 top log-probs, expected 2"):
        responses_from_vllm([RequestOutput("0", None, [1], None, [ok])], n=1, student_topk=2)


def test_sampling_params_kwargs_map_our_config():
    kwargs = sampling_params_kwargs(SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=33), n=4, seed=11)
    assert kwargs == {"n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 33, "logprobs": 0,
                      "stop": None, "seed": 11, "detokenize": False}
    kwargs = sampling_params_kwargs(SamplingConfig(top_k=8, stop=["\n\n"]), n=1, student_topk=5)
    assert kwargs["top_k"] == 8 and kwargs["logprobs"] == 5 and kwargs["stop"] == ["\n\n"] and kwargs["detokenize"]


def test_vllm_engine_samples_with_processed_logprobs(tiny_model_factory, tokenizer):
    pytest.importorskip("vllm", reason="vLLM is an optional extra (pip install 'opd-cache[vllm]')")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a GPU")
    from opd_cache.engines.vllm_generate import VLLMGenerator
    from opd_cache.models import load_causal_lm

    path = tiny_model_factory("student")
    engine = VLLMGenerator(path, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True)
    prompts = [tokenizer("What is 3 + 4?\n")["input_ids"], tokenizer("Hi\n")["input_ids"]]
    responses = engine.generate(prompts, 2, SamplingConfig(max_new_tokens=12), student_topk=3, seed=0)
    model = load_causal_lm(path)
    for i, r in enumerate(responses):
        ids = torch.tensor([prompts[i // 2] + r.token_ids.tolist()])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)[len(prompts[i // 2]) - 1: -1]
        expected = logprobs.gather(-1, torch.as_tensor(r.token_ids, dtype=torch.long)[:, None]).squeeze(-1).numpy()
        np.testing.assert_allclose(r.logprobs, expected, atol=2e-3)
        assert r.topk_ids.shape == (len(r.token_ids), 3)
    engine.load_policy(tiny_model_factory("student", seed=5))  # in place (or re-created) without error
    assert len(engine.generate(prompts, 1, SamplingConfig(max_new_tokens=4), seed=0)) == 2
