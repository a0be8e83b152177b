"""The hf scoring engine against a direct computation: log_softmax of the teacher's full logits, then top-k.

The reference in every test is the plain, unbatched `model(prompt + response).logits`
of one sequence; the scorer must reproduce it from padded, length-bucketed
batches with the output layer applied in chunks of response positions only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd_cache.annotate.hf_score import HFScorer, plan_batches
from opd_cache.models import build_tiny_model

VOCAB = 99  # the shipped tokenizer's size


def random_rows(seed: int, n: int = 12, max_prompt: int = 9, max_response: int = 11, support_k: int = 3):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, size=rng.integers(1, max_prompt + 1)).astype(np.int32) for _ in range(n)]
    responses = [rng.integers(0, VOCAB, size=rng.integers(0, max_response + 1)).astype(np.int32) for _ in range(n)]
    responses[0] = responses[0][:0]  # an empty response contributes zero positions
    responses[1] = rng.integers(0, VOCAB, size=1).astype(np.int32)  # a one-token response
    support = [rng.integers(0, VOCAB, size=(len(r), support_k)).astype(np.int32) for r in responses]
    return prompts, responses, support


@torch.inference_mode()
def direct_logprobs(model, prompt: np.ndarray, response: np.ndarray) -> torch.Tensor:
    """[len(response), V] float32: row t is log_softmax of the logits that predict response[t]."""
    ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
    logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def split_rows(scores, lengths):
    bounds = np.cumsum(lengths)[:-1]
    return (
        np.split(scores.topk_ids, bounds),
        np.split(scores.topk_logprobs, bounds),
        np.split(scores.token_logprob, bounds),
        np.split(scores.support_logprobs, bounds) if scores.support_logprobs is not None else None,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_scores_equal_direct_log_softmax_topk(arch):
    model = build_tiny_model(arch=arch, vocab_size=VOCAB, seed=3)
    prompts, responses, support = random_rows(seed=0)
    k = 5
    scores = HFScorer(model, max_tokens_per_batch=40, head_chunk_tokens=7).score(prompts, responses, k, support)

    lengths = [len(r) for r in responses]
    assert scores.lengths.tolist() == lengths
    assert scores.topk_ids.shape == (sum(lengths), k) and scores.topk_ids.dtype == np.int32
    outside_topk = 0
    for p, r, s, ids, lps, tok, sup in zip(prompts, responses, support, *split_rows(scores, lengths)):
        assert len(ids) == len(r)
        if not len(r):
            continue
        ref = direct_logprobs(model, p, r)
        top = torch.topk(ref, k, dim=-1)
        np.testing.assert_array_equal(ids, top.indices.numpy())
        np.testing.assert_allclose(lps, top.values.numpy(), rtol=0, atol=1e-6)
        assert (np.diff(lps, axis=1) <= 0).all()  # sorted, descending
        # the sampled token's log-prob is exact, also when it is not among the top-k
        np.testing.assert_allclose(
            tok, ref.gather(1, torch.from_numpy(r.astype(np.int64))[:, None])[:, 0].numpy(), rtol=0, atol=1e-6
        )
        outside_topk += int((~(ids == r[:, None]).any(axis=1)).sum())
        # union support: the teacher's log-probs at the student's top-k ids
        np.testing.assert_allclose(sup, ref.gather(1, torch.from_numpy(s.astype(np.int64))).numpy(), rtol=0, atol=1e-6)
    assert outside_topk > 10  # the exactness above really covered tokens outside the top-k


def test_padding_side_budget_and_chunking_do_not_change_results():
    model = build_tiny_model(vocab_size=VOCAB, seed=4)
    prompts, responses, _ = random_rows(seed=1, n=20)
    reference = HFScorer(model, max_tokens_per_batch=1).score(prompts, responses, 8)  # one row per batch, no padding
    for side, budget, chunk in [
        ("right", 16, 1),
        ("right", 57, 5),
        ("right", 10_000, None),
        ("left", 16, None),
        ("left", 10_000, 5),
    ]:
        got = HFScorer(model, max_tokens_per_batch=budget, padding_side=side, head_chunk_tokens=chunk).score(
            prompts, responses, 8
        )
        np.testing.assert_array_equal(got.topk_ids, reference.topk_ids)
        # CPU matmul kernels are not bitwise batch-invariant (results depend on the batch shape
        # by an ulp); the values agree to float32 rounding.
        np.testing.assert_allclose(got.topk_logprobs, reference.topk_logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got.token_logprob, reference.token_logprob, rtol=0, atol=1e-6)


def test_same_budget_is_bitwise_deterministic():
    model = build_tiny_model(vocab_size=VOCAB, seed=4)
    prompts, responses, support = random_rows(seed=2)
    a = HFScorer(model, max_tokens_per_batch=30).score(prompts, responses, 4, support)
    b = HFScorer(model, max_tokens_per_batch=30).score(prompts, responses, 4, support)
    for name in ("topk_ids", "topk_logprobs", "token_logprob", "support_logprobs"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes()


def test_output_layer_runs_only_on_response_positions_in_chunks():
    model = build_tiny_model(vocab_size=VOCAB, seed=5)
    scorer = HFScorer(model, max_tokens_per_batch=64, head_chunk_tokens=6)
    rows_seen = []
    hook = scorer.head.register_forward_hook(lambda mod, inp, out: rows_seen.append(out.shape))
    try:
        prompts, responses, _ = random_rows(seed=3)
        scorer.score(prompts, responses, 3)
    finally:
        hook.remove()
    assert all(len(shape) == 2 and shape[0] <= 6 for shape in rows_seen)  # never [batch, seq, vocab]
    assert sum(shape[0] for shape in rows_seen) == sum(len(r) for r in responses)  # prompt positions skipped


def test_bfloat16_teacher_is_close_to_its_float32_reference():
    model = build_tiny_model(vocab_size=VOCAB, seed=6)
    prompts, responses, _ = random_rows(seed=4, n=6)
    ref = HFScorer(model, max_tokens_per_batch=64).score(prompts, responses, 4)
    bf16 = HFScorer(build_tiny_model(vocab_size=VOCAB, seed=6).to(torch.bfloat16), max_tokens_per_batch=64)
    got = bf16.score(prompts, responses, 4)
    assert got.topk_logprobs.dtype == np.float32  # reduced in float32 whatever the model dtype
    np.testing.assert_allclose(got.token_logprob, ref.token_logprob, atol=0.1)
    np.testing.assert_allclose(got.topk_logprobs, ref.topk_logprobs, atol=0.1)


def test_vocab_limit_leaves_padded_embedding_rows_out():
    model = build_tiny_model(vocab_size=128, seed=7)  # embedding padded beyond a 99-token tokenizer
    prompts, responses, _ = random_rows(seed=5, n=5)
    scores = HFScorer(model, vocab_limit=VOCAB).score(prompts, responses, 4)
    assert scores.topk_ids.max() < VOCAB
    for p, r, lps, tok in zip(
        prompts,
        responses,
        np.split(scores.topk_logprobs, np.cumsum(scores.lengths)[:-1]),
        np.split(scores.token_logprob, np.cumsum(scores.lengths)[:-1]),
    ):
        if len(r):
            with torch.inference_mode():
                ids = torch.from_numpy(np.concatenate([p, r]).astype(np.int64))[None]
                ref = torch.log_softmax(model(input_ids=ids).logits[0, :, :VOCAB].float(), -1)[len(p) - 1 : -1]
            np.testing.assert_allclose(
                tok, ref.gather(1, torch.from_numpy(r.astype(np.int64))[:, None])[:, 0], atol=1e-6
            )
            np.testing.assert_allclose(lps, torch.topk(ref, 4).values, atol=1e-6)


def test_plan_batches_fits_budget_and_covers_every_row_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=200)
    batches = plan_batches(lengths, 120)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(200))
    for batch in batches:
        assert len(batch) * lengths[batch].max() <= 120
    # length bucketing: longest first, so little padding overall
    padded = sum(len(b) * lengths[b].max() for b in batches)
    assert padded <= 1.25 * lengths.sum()
    assert [len(b) for b in plan_batches(np.array([500, 3]), 100)] == [1, 1]  # an over-long row runs alone


def test_bad_arguments_are_one_line_errors():
    scorer = HFScorer(build_tiny_model(vocab_size=VOCAB, seed=0))
    prompts, responses, _ = random_rows(seed=6, n=3)
    with pytest.raises(ValueError, match=r"top-k 100 must be between 1 and the vocabulary size .* \(99 tokens\)"):
        scorer.score(prompts, responses, 100)
    with pytest.raises(ValueError, match="row 1 has an empty prompt"):
        scorer.score([prompts[0], prompts[0][:0]], responses[:2], 4)
    with pytest.raises(ValueError, match=r"support_ids row 0: shape"):
        scorer.score(prompts, responses, 4, support_ids=[np.zeros((99, 2), np.int32)] * 3)
