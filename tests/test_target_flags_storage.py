"""The `target_flags` column of cross-tokenizer parts (schema version 2): plain and packed parts, validation, the
trainer's reading of it (shard_data, microbatch, objective)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd_cache.losses import LossConfig, SpanTermConfig
from opd_cache.storage import codec
from opd_cache.storage.quantize import TOKEN_STEP
from opd_cache.storage.schema import (
    ANNOTATED,
    TARGET_FLAGS,
    ShardError,
    ShardMeta,
    annotated_table,
    flat_values,
    read_shard,
    validate_table,
    write_shard,
)
from opd_cache.target_flags import EXCLUDED, GROUP_END, SAME_TOKENIZER, TOPK_VALID, excluded_rows
from opd_cache.train.shard_data import part_target_flags

K, VOCAB = 4, 300


def cross_part(seed: int = 0, lengths=(3, 5, 2)):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    n = int(lengths.sum())
    ids = np.stack([rng.permutation(VOCAB)[:K] for _ in range(n)]).astype(np.int32)
    lp = np.sort(rng.normal(-3, 1, (n, K)), axis=1)[:, ::-1].astype(np.float32)
    flags = rng.choice([TOPK_VALID | GROUP_END, GROUP_END, TOPK_VALID, 0], size=n).astype(np.uint8)
    flags[-lengths[-1] :] = EXCLUDED  # the last row failed its round trip
    group_lp = np.where(flags & GROUP_END, -rng.random(n) * 40, 0).astype(np.float32)
    group_lp[0] = -300.0  # a long, unlikely group: below the packed range
    flags[0] |= GROUP_END
    table = annotated_table(
        sample_ids=[f"s{i}" for i in range(len(lengths))],
        lengths=lengths,
        topk_ids=ids,
        topk_logprobs=lp,
        token_logprob=group_lp,
        target_flags=flags,
    )
    return table, flags, group_lp


def meta(**fields) -> ShardMeta:
    return ShardMeta(
        kind=ANNOTATED,
        run_id="r",
        tokenizer_fingerprint="fp",
        shard_id="v00000000-w0-000000",
        policy_version=0,
        top_k=K,
        teacher="t",
        **fields,
    )


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_flags_round_trip_through_a_written_part(local_store, packed):
    table, flags, group_lp = cross_part()
    m = meta()
    if packed:
        table, codec_meta = codec.encode_annotation(table, VOCAB)
        m.codec, m.codec_id_bits = "packed", int(codec_meta[codec.META_ID_BITS])
        assert codec.packed_has_flags(table)
    write_shard(local_store, "annotated/x.arrow", table, m)
    back, _ = read_shard(local_store, "annotated/x.arrow", kind=ANNOTATED)
    assert TARGET_FLAGS in back.schema.names
    np.testing.assert_array_equal(flat_values(back[TARGET_FLAGS]), flags)
    got = flat_values(back["teacher_token_logprob"])
    if packed:  # the group log-prob in the token code's steps; below the range it is stored as the bound, -128
        np.testing.assert_allclose(got[1:], group_lp[1:], atol=TOKEN_STEP / 2 + 1e-6)
        assert -128.0 <= got[0] < -127.99
    else:
        np.testing.assert_array_equal(got, group_lp)
    assert excluded_rows(flags, [3, 5, 2]) == 1


def test_a_version_1_part_with_flags_and_unknown_bits_are_refused():
    table, flags, _ = cross_part()
    with pytest.raises(ShardError, match="schema version 1 part with column 'target_flags'"):
        validate_table(table, meta(schema_version=1), "p")
    bad = annotated_table(
        sample_ids=["a"],
        lengths=np.array([2]),
        topk_ids=np.zeros((2, K), np.int32) + np.arange(K, dtype=np.int32),
        topk_logprobs=np.zeros((2, K), np.float32),
        token_logprob=np.zeros(2, np.float32),
        target_flags=np.array([3, 8], np.uint8),
    )
    with pytest.raises(ShardError, match="target_flags value 8"):
        validate_table(bad, meta(), "p")


def test_same_tokenizer_parts_carry_no_flags_and_mix_as_same_tokenizer():
    plain = annotated_table(
        sample_ids=["a"],
        lengths=np.array([2]),
        topk_ids=np.tile(np.arange(K, dtype=np.int32), (2, 1)),
        topk_logprobs=np.zeros((2, K), np.float32),
        token_logprob=np.zeros(2, np.float32),
    )
    assert TARGET_FLAGS not in plain.schema.names
    packed, _ = codec.encode_annotation(plain, VOCAB)
    assert not codec.packed_has_flags(packed)
    assert part_target_flags([plain]) is None
    cross, flags, _ = cross_part()
    mixed = part_target_flags([plain, cross])
    np.testing.assert_array_equal(mixed, np.concatenate([[SAME_TOKENIZER] * 2, flags]))


def test_objective_on_same_tokenizer_flags_is_todays_loss_bit_for_bit(tiny_model_factory):
    """A micro-batch whose flags are all SAME_TOKENIZER goes through fused_cross_tokenizer_losses and gives
    exactly the loss and gradients of the same micro-batch without flags (fused_token_losses)."""
    from opd_cache.models import load_causal_lm
    from opd_cache.train.microbatch import MicroBatch
    from opd_cache.train.objective import DistillationObjective

    model = load_causal_lm(tiny_model_factory("student", seed=0))
    g = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(1, vocab, (2, 9), generator=g)
    positions = torch.tensor([3, 4, 5, 6, 7, 12, 13, 14, 15, 16])
    sampled = ids.flatten()[positions + 1]
    teacher = torch.log_softmax(torch.randn(10, vocab, generator=g), -1).topk(K)
    mb = MicroBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_positions=positions,
        sampled_ids=sampled,
        behavior_logprobs=-torch.rand(10, generator=g),
        teacher_topk_ids=teacher.indices.int(),
        teacher_topk_logprobs=teacher.values,
        teacher_token_logprobs=-torch.rand(10, generator=g),
        token_weights=torch.full((10,), 0.1),
    )
    objective = DistillationObjective(model, LossConfig(), SpanTermConfig())
    results = []
    for flags in (None, torch.full((10,), SAME_TOKENIZER, dtype=torch.uint8)):
        model.zero_grad()
        mb.target_flags = flags
        loss, per_token, _ = objective(mb)
        loss.backward()
        results.append((loss.detach(), per_token.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, tok_a, grad_a), (loss_b, tok_b, grad_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(tok_a, tok_b)
    assert all(torch.equal(a, b) for a, b in zip(grad_a, grad_b))
