"""The HF sampling engine: behavior log-probs are those of the distribution actually sampled from."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from opd_cache.config import SamplingConfig
from opd_cache.engine import SampleRequest
from opd_cache.models import build_tiny_model, load_causal_lm, save_causal_lm
from opd_cache.rollout.hf_generate import HFGenerator, left_pad, sampling_logprobs

QUESTIONS = ["What is 3 + 4?", "Hi", "What is 12 + 85? Think step by step, then answer."]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer(q + "\n")["input_ids"] for q in QUESTIONS]
    assert len({len(p) for p in ids}) == len(ids)  # different lengths: the batch is left-padded
    return ids


def make_engine(path, tokenizer, **kwargs) -> HFGenerator:
    return HFGenerator(
        path, tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, **kwargs
    )


def full_forward_logits(model, prompt, response) -> torch.Tensor:
    """Logits `[T, V]` that predict each response token, from one unpadded forward over prompt + response."""
    ids = torch.tensor([list(prompt) + [int(t) for t in response]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def gather(logprobs: torch.Tensor, tokens) -> np.ndarray:
    return logprobs.gather(-1, torch.as_tensor(np.asarray(tokens), dtype=torch.long)[:, None]).squeeze(-1).numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_behavior_logprobs_match_teacher_forced_forward(tiny_model_factory, tokenizer, prompts, arch):
    path = tiny_model_factory("student", arch=arch)
    engine = make_engine(path, tokenizer)
    n, max_new = 4, 48
    responses = engine.generate(
        prompts, SampleRequest(SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=max_new), n=n, seed=3)
    )
    assert len(responses) == len(prompts) * n

    model = load_causal_lm(path)
    eos = tokenizer.eos_token_id
    for i, r in enumerate(responses):
        prompt = prompts[i // n]  # prompt-major: response i is sample i % n of prompt i // n
        assert r.token_ids.dtype == np.int32 and r.logprobs.dtype == np.float32 and len(r.logprobs) == len(r.token_ids)
        expected = gather(torch.log_softmax(full_forward_logits(model, prompt, r.token_ids), -1), r.token_ids)
        np.testing.assert_allclose(r.logprobs, expected, atol=1e-4, rtol=0)
        # EOS ends the response and belongs to it; otherwise the response ran to the limit.
        assert eos not in r.token_ids[:-1].tolist()
        if r.finish_reason == "stop":
            assert r.token_ids[-1] == eos
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == max_new and r.token_ids[-1] != eos
    reasons = {r.finish_reason for r in responses}
    assert reasons == {"stop", "length"}, "the seed should exercise both ways to finish"
    # the n samples of a prompt are different draws
    assert len({tuple(r.token_ids.tolist()) for r in responses[:n]}) > 1


def test_temperature_and_top_k_logprobs_are_of_the_processed_distribution(tiny_model_factory, tokenizer, prompts):
    path = tiny_model_factory("student")
    engine = make_engine(path, tokenizer)
    temperature, top_k = 0.7, 5
    responses = engine.generate(
        prompts, SampleRequest(SamplingConfig(temperature=temperature, top_k=top_k, max_new_tokens=16), n=3, seed=0)
    )
    model = load_causal_lm(path)
    for i, r in enumerate(responses):
        logits = full_forward_logits(model, prompts[i // 3], r.token_ids) / temperature
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        processed = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        np.testing.assert_allclose(r.logprobs, gather(processed, r.token_ids), atol=1e-4, rtol=0)
        raw = gather(torch.log_softmax(full_forward_logits(model, prompts[i // 3], r.token_ids), -1), r.token_ids)
        assert not np.allclose(r.logprobs, raw, atol=1e-3)  # really not the raw distribution
        sampled_logits = logits.gather(-1, torch.as_tensor(r.token_ids, dtype=torch.long)[:, None])
        ranks = (logits > sampled_logits).sum(-1)
        assert int(ranks.max()) < top_k  # every sampled token is in the top-k


def test_top_p_samples_stay_in_the_nucleus_and_logprobs_renormalise(tiny_model_factory, tokenizer, prompts):
    path = tiny_model_factory("student")
    top_p = 0.3
    sampling = SamplingConfig(top_p=top_p, max_new_tokens=12)
    responses = make_engine(path, tokenizer).generate(prompts, SampleRequest(sampling, n=2, seed=1))
    model = load_causal_lm(path)
    for i, r in enumerate(responses):
        probs = torch.softmax(full_forward_logits(model, prompts[i // 2], r.token_ids), -1).numpy().astype(np.float64)
        for t, token in enumerate(r.token_ids):
            order = np.argsort(-probs[t], kind="stable")
            mass_before = np.cumsum(probs[t][order]) - probs[t][order]
            nucleus = order[mass_before < top_p]  # the smallest top set whose mass reaches top_p
            assert token in nucleus
            assert abs(r.logprobs[t] - np.log(probs[t][token] / probs[t][nucleus].sum())) < 1e-4


def test_student_topk_ids_are_the_models_top_ids(tiny_model_factory, tokenizer, prompts):
    path = tiny_model_factory("student")
    responses = make_engine(path, tokenizer).generate(
        prompts, SampleRequest(SamplingConfig(max_new_tokens=10), n=2, student_topk=4, seed=2)
    )
    model = load_causal_lm(path)
    for i, r in enumerate(responses):
        assert r.topk_ids.shape == (len(r.token_ids), 4) and r.topk_ids.dtype == np.int32
        expected = torch.topk(full_forward_logits(model, prompts[i // 2], r.token_ids), 4, dim=-1).indices.numpy()
        np.testing.assert_array_equal(r.topk_ids, expected)


def test_seed_makes_sampling_reproducible(tiny_model_factory, tokenizer, prompts):
    engine = make_engine(tiny_model_factory("student"), tokenizer)
    sampling = SamplingConfig(max_new_tokens=12)
    a, b, c = (engine.generate(prompts, SampleRequest(sampling, n=2, seed=s)) for s in (7, 7, 8))
    assert [r.token_ids.tolist() for r in a] == [r.token_ids.tolist() for r in b]
    assert [r.token_ids.tolist() for r in a] != [r.token_ids.tolist() for r in c]


def test_stop_string_ends_the_response_where_it_first_appears(tiny_model_factory, tokenizer, prompts):
    engine = make_engine(tiny_model_factory("student"), tokenizer)
    free = engine.generate(prompts, SampleRequest(SamplingConfig(max_new_tokens=30), n=1, seed=4))
    # Pick a 2-character string from the middle of the first free-running response (a character tokenizer:
    # token j is character j), then sample again with the same seed: same draws, cut where it completes.
    text_tokens = [tokenizer.decode([t]) for t in free[0].token_ids.tolist()]
    j = next(j for j in range(5, 29) if all(len(tokenizer.decode([t])) == 1 for t in free[0].token_ids[j - 1 : j + 1]))
    stop = text_tokens[j - 1] + text_tokens[j]
    first_end = next(k for k in range(1, len(text_tokens)) if stop in "".join(text_tokens[: k + 1]))
    cut = engine.generate(prompts, SampleRequest(SamplingConfig(max_new_tokens=30, stop=[stop]), n=1, seed=4))
    assert cut[0].finish_reason == "stop"
    assert cut[0].token_ids.tolist() == free[0].token_ids[: first_end + 1].tolist()
    np.testing.assert_allclose(cut[0].logprobs, free[0].logprobs[: first_end + 1])
    for other_free, other_cut in zip(free[1:], cut[1:]):  # the other rows are untouched unless they contain it
        text = tokenizer.decode(other_free.token_ids.tolist())
        if stop not in text:
            assert other_cut.token_ids.tolist() == other_free.token_ids.tolist()


def test_padded_embedding_ids_beyond_the_tokenizer_are_never_sampled(tokenizer, prompts, tmp_path):
    path = tmp_path / "padded"  # a model whose embedding is padded beyond the tokenizer
    save_causal_lm(build_tiny_model(vocab_size=len(tokenizer) + 60), tokenizer, path)
    engine = make_engine(path, tokenizer, vocab_limit=len(tokenizer))
    responses = engine.generate(prompts, SampleRequest(SamplingConfig(max_new_tokens=20), n=4, seed=0))
    assert max(int(r.token_ids.max()) for r in responses) < len(tokenizer)
    unlimited = make_engine(path, tokenizer).generate(
        prompts, SampleRequest(SamplingConfig(max_new_tokens=20), n=4, seed=0)
    )
    assert max(int(r.token_ids.max()) for r in unlimited) >= len(tokenizer)  # the mask is what keeps them out


def test_load_policy_swaps_weights_in_place(tiny_model_factory, tokenizer, prompts, tmp_path):
    engine = make_engine(tiny_model_factory("student"), tokenizer)
    new_path = tiny_model_factory("student", seed=5)
    model_before = engine.model
    engine.load_policy(new_path)
    assert engine.model is model_before  # same module, new weights
    responses = engine.generate(prompts[:1], SampleRequest(SamplingConfig(max_new_tokens=10), n=2, seed=0))
    new_model = load_causal_lm(new_path)
    for r in responses:
        expected = gather(torch.log_softmax(full_forward_logits(new_model, prompts[0], r.token_ids), -1), r.token_ids)
        np.testing.assert_allclose(r.logprobs, expected, atol=1e-4, rtol=0)

    other = tiny_model_factory("wide", hidden_size=32, num_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match=r"policy .*wide.*: .* has shape"):
        engine.load_policy(other)
    empty = tmp_path / "empty"
    shutil.copytree(new_path, empty, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        engine.load_policy(empty)


def test_empty_prompt_is_refused(tiny_model_factory, tokenizer, prompts):
    engine = make_engine(tiny_model_factory("student"), tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([prompts[0], []], SampleRequest(SamplingConfig(max_new_tokens=4), n=1))


def test_sampling_logprobs_filters_in_the_documented_order():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])
    out = sampling_logprobs(logits, temperature=0.5, top_k=3, top_p=0.9)
    scaled = logits / 0.5
    probs_top3 = torch.softmax(scaled[0, [4, 0, 1]], -1)  # top-3 by logit: ids 4, 0, 1
    # top-p on the renormalised top-3: keep the most likely ids until their mass reaches 0.9
    keep = [4, 0] if probs_top3[0] < 0.9 else [4]
    expected = torch.full((5,), float("-inf"))
    expected[keep] = torch.log_softmax(scaled[0, keep], -1)
    torch.testing.assert_close(out[0], expected)
    assert torch.isinf(sampling_logprobs(logits, vocab_limit=3)[0, 3:]).all()


def test_left_pad_puts_padding_first():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
