"""The vLLM scorer: the pure conversion of `prompt_logprobs` here; the engine itself in tests/test_vllm_engines.py.

The fake outputs follow vLLM's documented structure (vllm/logprobs.py):
`PromptLogprobs = list[dict[int, Logprob] | None]`, entry 0 is None (an empty
dict with flat logprobs), entry j holds the top-k ids with ranks 1..k plus the
actual token j, an extra entry carrying its vocabulary rank when it is outside
the top-k.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import pytest

from opd_cache.annotate.vllm_score import convert_prompt_logprobs


@dataclass
class FakeLogprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(np.float32)


def fake_prompt_logprobs(logprobs: np.ndarray, tokens: np.ndarray, k: int, first=None, logprob_cls=FakeLogprob):
    """What vLLM returns for `tokens` given the full `[len(tokens), V]` log-probs of each position's predictor."""
    out = [first]
    for j in range(1, len(tokens)):
        order = np.argsort(-logprobs[j], kind="stable")
        entry = {int(t): logprob_cls(float(logprobs[j, t]), rank + 1, None) for rank, t in enumerate(order[:k])}
        actual = int(tokens[j])
        if actual not in entry:
            entry[actual] = logprob_cls(float(logprobs[j, actual]), int(np.nonzero(order == actual)[0][0]) + 1, None)
        out.append(entry)
    return out


def make_case(seed: int, prompt_len: int, response_len: int, vocab: int = 50):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=prompt_len + response_len)
    # position j's distribution predicts tokens[j]; row 0 has none
    logprobs = log_softmax(rng.normal(size=(prompt_len + response_len, vocab)) * 3)
    return tokens, logprobs


@pytest.mark.parametrize("first", [None, {}])
def test_conversion_matches_the_full_distribution(first):
    k, prompt_len, response_len = 6, 4, 30
    tokens, logprobs = make_case(0, prompt_len, response_len)
    response = tokens[prompt_len:]
    # make sure both cases occur: the sampled token inside and outside the top-k
    inside = response_len // 2
    logprobs[prompt_len + inside] = log_softmax(np.where(np.arange(50) == response[inside], 10.0, 0.0))
    ids, lps, tok = convert_prompt_logprobs(fake_prompt_logprobs(logprobs, tokens, k, first), prompt_len, response, k)

    target = logprobs[prompt_len:]  # response token t is predicted at sequence position prompt_len + t
    expected_ids = np.argsort(-target, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(lps, np.take_along_axis(target, expected_ids, axis=1))
    np.testing.assert_array_equal(tok, target[np.arange(response_len), response])
    assert ids.dtype == np.int32 and lps.dtype == np.float32 and tok.dtype == np.float32
    in_topk = (ids == response[:, None]).any(axis=1)
    assert in_topk.any() and (~in_topk).any()


def test_conversion_of_an_empty_response_and_one_token_prompt():
    tokens, logprobs = make_case(1, 1, 3)
    ids, lps, tok = convert_prompt_logprobs(fake_prompt_logprobs(logprobs, tokens, 2), 1, tokens[1:], 2)
    assert ids.shape == (3, 2)
    np.testing.assert_array_equal(tok, logprobs[np.arange(1, 4), tokens[1:]])
    ids, lps, tok = convert_prompt_logprobs(fake_prompt_logprobs(logprobs[:1], tokens[:1], 2), 1, tokens[1:1], 2)
    assert ids.shape == (0, 2) and lps.shape == (0, 2) and tok.shape == (0,)


def test_conversion_refuses_malformed_outputs():
    tokens, logprobs = make_case(2, 3, 4)
    good = fake_prompt_logprobs(logprobs, tokens, 3)
    with pytest.raises(ValueError, match="7 prompt log-prob entries for a sequence of 3 prompt \\+ 5 response"):
        convert_prompt_logprobs(good, 3, np.concatenate([tokens[3:], [0]]), 3)
    missing = [dict(e) if e else e for e in good]
    del missing[4][int(tokens[4])]
    with pytest.raises(ValueError, match="no log-prob for response token 1"):
        convert_prompt_logprobs(missing, 3, tokens[3:], 3)
    with pytest.raises(ValueError, match="max_logprobs >= 5"):
        convert_prompt_logprobs(good, 3, tokens[3:], 5)


@pytest.mark.vllm  # runs in the vLLM tier (CI step 5), where vLLM is installed
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (optional extra)")
def test_conversion_accepts_vllms_own_logprob_objects():
    from vllm.logprobs import Logprob

    tokens, logprobs = make_case(3, 2, 8)
    ids, lps, tok = convert_prompt_logprobs(
        fake_prompt_logprobs(logprobs, tokens, 4, logprob_cls=Logprob), 2, tokens[2:], 4
    )
    np.testing.assert_array_equal(tok, logprobs[np.arange(2, 10), tokens[2:]])
