"""The `packed` annotation codec (opd_cache/storage/codec.py, its id packings in idpack.py).

Round trips are checked entry by entry against the bound stated in the codec's
docstring (entries come back in rank order, so rows are compared as sets of
(id, log-prob) pairs); the distillation losses computed from packed annotations are
compared with those from float32 annotations on the shipped, trained demo
teacher scoring the demo student's own samples, and on a SmolLM2-vocabulary
Llama built from a config; `opd annotate` with `codec: packed` writes packed
columns that every reader decodes through `read_shard`.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from opd_cache.annotate import run_annotate
from opd_cache.config import AnnotateConfig, Config
from opd_cache.losses import LossConfig, token_losses
from opd_cache.models import build_tiny_model, load_causal_lm
from opd_cache.storage import codec, idpack, layout, quantize, schema
from opd_cache.storage.schema import ANNOTATED, ShardError, ShardMeta, annotated_table, read_shard, write_shard
from opd_cache.storage.store import Store, make_shard_id
from opd_cache.tokenizer import load_tokenizer
from opd_cache.train.shard_data import load_shard
from tests.conftest import REPO, write_random_rollout_shard
from tests.helpers import truncate_packed_field


def sorted_logprobs(rng, n: int, vocab: int, k: int, sharpness: float) -> np.ndarray:
    """Top-k log-probs (descending) of random softmax distributions; larger sharpness = more peaked."""
    logits = rng.standard_normal((n, vocab)) * sharpness
    logp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    return -np.sort(-logp, axis=1)[:, :k]


# ---------------------------------------------------------------- ids
@pytest.mark.parametrize("vocab,k", [(2, 1), (2, 7), (3, 5), (99, 8), (49152, 32), (151936, 64), (2**31, 3)])
def test_ids_round_trip_exactly_at_ceil_log2_v_bits(vocab, k):
    rng = np.random.default_rng(vocab + k)
    ids = rng.integers(0, vocab, size=(257, k))
    ids[0] = vocab - 1  # the largest id needs every bit
    bits = idpack.id_bits(vocab)
    assert bits == int(np.ceil(np.log2(vocab)))
    packed = idpack.pack_ids(ids, bits)
    assert packed.shape == (257, (k * bits + 7) // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(idpack.unpack_ids(packed, k, bits), ids)


@pytest.mark.parametrize("vocab,k", [(2, 1), (2, 2), (9, 4), (99, 32), (99, 64), (99, 99), (1000, 200)])
def test_id_sets_round_trip_exactly_through_a_bitmap(vocab, k):
    rng = np.random.default_rng(vocab * k)
    ids = np.sort(np.argsort(rng.random((300, vocab)), axis=1)[:, :k], axis=1)  # k distinct ids per row, ascending
    ids[0] = np.arange(vocab - k, vocab)  # the largest ids
    bitmap = idpack.pack_id_bitmap(ids, vocab)
    assert bitmap.shape == (300, (vocab + 7) // 8) and bitmap.dtype == np.uint8
    np.testing.assert_array_equal(idpack.unpack_id_bitmap(bitmap, k), ids)


def test_a_bitmap_without_k_ids_in_a_position_is_refused():
    bitmap = idpack.pack_id_bitmap(np.array([[1, 5], [0, 2]]), 9)
    bitmap[1, 0] |= 0b1000  # a third id in the second position
    with pytest.raises(codec.CodecError, match=r"^p: an id bitmap holds 5 ids in 2 positions, expected 2 each$"):
        idpack.unpack_id_bitmap(bitmap, 2, "p")


def test_an_id_outside_the_bit_width_is_refused():
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\) for 2-bit packing"):
        idpack.pack_ids(np.array([[1, 4]]), 2)


# ---------------------------------------------------------------- log-probs
@pytest.mark.parametrize("k,sharpness", [(1, 1.0), (8, 0.3), (32, 3.0), (64, 8.0), (64, 30.0)])
def test_logprobs_round_trip_within_the_stated_bound_and_keep_the_mass_exact(k, sharpness):
    rng = np.random.default_rng(k)
    lp = sorted_logprobs(rng, 300, 500, k, sharpness)
    if k > 2:
        lp[0, 2:] = -np.inf  # a row whose distribution has fewer than k nonzero entries
        lp[1, 1:] = -1e4 - np.arange(k - 1)  # very negative entries: a huge range in one row
        lp[2, 1:] = -3e38
    codes, log_mass, log_range = codec.quantize_logprobs(lp)
    decoded = codec.dequantize_logprobs(codes, log_mass, log_range)
    finite = np.isfinite(lp)
    np.testing.assert_array_equal(np.isfinite(decoded), finite)  # -inf stays -inf, nothing else becomes it
    error = np.where(finite, np.abs(decoded.astype(np.float64) - np.where(finite, lp, 0.0)), 0.0)
    bound = quantize.logprob_bound(lp, mass_quantized=False)  # (the mass as the float32 these functions return)
    # float32 storage adds its own rounding of the result (|lp| * 2**-24 relative)
    slack = 1e-6 + np.abs(np.where(finite, lp, 0.0)) * 2.0**-23
    worst = np.unravel_index(np.argmax(error - bound - slack), error.shape)
    assert (error <= bound + slack).all(), (worst, error[worst], bound[worst])
    # the top-k mass (so the tail bucket 1 - sum p) is the stored float32 value, not a sum of rounded terms
    true_mass = np.logaddexp.reduce(lp, axis=1)
    np.testing.assert_allclose(np.logaddexp.reduce(decoded.astype(np.float64), axis=1), true_mass, rtol=0, atol=1e-6)
    if k == 1:
        np.testing.assert_allclose(decoded, lp, rtol=1e-7)


def test_the_bound_is_tight_enough_to_fail_a_one_code_error():
    lp = sorted_logprobs(np.random.default_rng(1), 50, 200, 16, 3.0)
    codes, log_mass, log_range = codec.quantize_logprobs(lp)
    codes[:, 8] = np.minimum(codes[:, 8] + 1, 254)  # off by one code step
    decoded = codec.dequantize_logprobs(codes, log_mass, log_range)
    assert (np.abs(decoded - lp) > quantize.logprob_bound(lp, mass_quantized=False)).any()


@pytest.mark.parametrize("tail", [0.0, 1e-30, 1e-12, 1e-5, 0.01, 0.5, 0.99, 1 - 1e-6, 1.0])
def test_the_mass_round_trips_within_its_bound_on_both_sides(tail):
    """log m within (1 - m) * 2**-9 * e**(2**-9) and the log tail within m * 2**-9 * e**(2**-9): a peaked row's top
    entries and a flat row's tail both keep their precision; m = 0 and m = 1 (no tail) stay exact."""
    log_mass = np.array([np.log1p(-tail) if tail < 1 else -np.inf], dtype=np.float32)  # float32, as stored
    decoded = quantize.dequantize_mass(quantize.quantize_mass(log_mass)).astype(np.float64)
    true = log_mass.astype(np.float64)
    if tail in (0.0, 1.0):
        np.testing.assert_array_equal(decoded, true)
        return
    half = quantize.MASS_STEP / 2 * np.exp(quantize.MASS_STEP / 2)
    m, tail_mass = np.exp(true), -np.expm1(true)
    assert np.abs(decoded - true) <= tail_mass * half + 1e-7 * np.abs(true)
    assert np.abs(np.log(-np.expm1(decoded)) - np.log(-np.expm1(true))) <= m * half + 1e-6
    np.testing.assert_array_less(np.abs(decoded - true), quantize.log_mass_bound(true) + 1e-7 * np.abs(true) + 1e-12)


def test_a_mass_one_code_off_is_outside_the_bound():
    log_mass = np.log(np.array([0.3, 0.9, 0.999], dtype=np.float32))
    codes = quantize.quantize_mass(log_mass) + np.int16(1)
    assert (np.abs(quantize.dequantize_mass(codes) - log_mass) > quantize.log_mass_bound(log_mass)).all()


def test_the_sampled_token_log_prob_round_trips_within_half_a_step():
    lp = np.array([0.0, 1e-7, -1e-4, -0.5, -12.34567, -127.9, -np.inf, -500.0], dtype=np.float32)
    decoded = quantize.dequantize_token_logprob(quantize.quantize_token_logprob(lp))
    finite = np.isfinite(lp)
    assert np.isneginf(decoded[~finite]).all() and np.isfinite(decoded[finite]).all()
    in_range = finite & (lp >= -127.99)
    assert (np.abs(decoded[in_range] - np.minimum(lp[in_range], 0)) <= quantize.TOKEN_STEP / 2 + 1e-6).all()
    assert decoded[-1] == np.float32(-65534 * quantize.TOKEN_STEP)  # far below the range: its edge, p < 1e-55
    with pytest.raises(ValueError, match="NaN"):
        quantize.quantize_token_logprob(np.array([np.nan]))


# ---------------------------------------------------------------- parts on a store
VOCAB = 99  # the shipped tokenizer


def plain_part(rng, k: int = 4, rows: int = 5, vocab: int = VOCAB) -> pa.Table:
    """A plain annotated table: k distinct ids per position, half the sampled tokens' log-probs among them."""
    lengths = rng.integers(1, 6, size=rows)
    total = int(lengths.sum())
    lp = sorted_logprobs(rng, total, vocab, k, 2.0)
    token = np.where(np.arange(total) % 2 == 0, lp[:, min(1, k - 1)], -rng.random(total) - 8.0)
    return annotated_table(
        sample_ids=[f"s{i}" for i in range(rows)],
        lengths=lengths,
        topk_ids=np.argsort(rng.random((total, vocab)), axis=1)[:, :k],
        topk_logprobs=lp,
        token_logprob=token,
    )


def packed_part(store, rng, k: int = 4, rows: int = 5):
    """A packed annotated table and its metadata, from random plain columns."""
    plain = plain_part(rng, k, rows)
    table, codec_meta = codec.encode_annotation(plain, VOCAB)
    run = store.manifest.require()
    meta = ShardMeta(
        kind=ANNOTATED,
        run_id=run["run_id"],
        tokenizer_fingerprint=run["tokenizer_fingerprint"],
        shard_id=make_shard_id(0, "w00", 0),
        policy_version=0,
        top_k=k,
        teacher="teacher",
        codec="packed",
        codec_id_bits=int(codec_meta[codec.META_ID_BITS]),
    )
    return plain, table, meta


def children(table: pa.Table) -> dict[str, pa.Field]:
    """The per-token fields of a version-3 packed part (its one list<struct> column), by name."""
    return {f.name: f for f in table.schema.field(codec.PACKED).type.value_type}


def by_id(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each position's entries sorted by id: the top-k as a set, whatever order a part stores them in."""
    order = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)


def legacy_bound(lp: np.ndarray) -> np.ndarray:
    """The bound of a version 1 or 2 part: gap scale 4, the mass an exact float32."""
    return quantize.logprob_bound(lp, gap_scale=quantize.LEGACY_GAP_SCALE, mass_quantized=False)


def assert_decodes_within_bound(got: pa.Table, plain: pa.Table, legacy=False) -> None:
    """`got` (a decoded packed part) holds plain's entries, in rank order, each within the codec's bound, and the
    sampled token's log-prob within half a step (exact in version 1 and 2 parts)."""
    assert got.schema.names == plain.schema.names and got["sample_id"].equals(plain["sample_id"])
    ids, lp = schema.flat_values(plain["teacher_topk_ids"]), schema.flat_values(plain["teacher_topk_logprobs"])
    got_ids, got_lp = schema.flat_values(got["teacher_topk_ids"]), schema.flat_values(got["teacher_topk_logprobs"])
    assert (got_lp[:, :-1] >= got_lp[:, 1:]).all()  # best first, as a plain part
    sorted_ids, sorted_lp = by_id(ids, lp.astype(np.float64))
    got_sorted_ids, got_sorted_lp = by_id(got_ids, got_lp.astype(np.float64))
    np.testing.assert_array_equal(got_sorted_ids, sorted_ids)
    finite = np.isfinite(sorted_lp)
    np.testing.assert_array_equal(np.isfinite(got_sorted_lp), finite)
    bound = by_id(ids, legacy_bound(lp) if legacy else quantize.logprob_bound(lp))[1]
    error = np.where(finite, np.abs(got_sorted_lp - np.where(finite, sorted_lp, 0.0)), 0.0)
    assert (error <= bound + 1e-6).all()
    token, got_token = (schema.flat_values(t["teacher_token_logprob"]).astype(np.float64) for t in (plain, got))
    finite = np.isfinite(token)
    np.testing.assert_array_equal(np.isfinite(got_token), finite)
    tolerance = 0.0 if legacy else quantize.TOKEN_STEP / 2 + 1e-6
    assert (np.abs(got_token[finite] - token[finite]) <= tolerance).all()


@pytest.mark.parametrize("k,layout", [(4, "ids_packed"), (32, "ids_bitmap")])
def test_a_packed_part_reads_back_as_its_plain_columns(student_store, k, layout):
    plain, table, meta = packed_part(student_store, np.random.default_rng(0), k=k)
    assert table.schema.names == ["sample_id", codec.PACKED]  # one per-token column: one list offsets buffer
    assert layout in children(table)  # a bitmap when ceil(V/8) bytes beat k ids at ceil(log2 V) bits
    assert "range_level" in children(table)
    write_shard(student_store, "annotated/p.arrow", table, meta)
    got, got_meta = read_shard(student_store, "annotated/p.arrow", kind=ANNOTATED, run=student_store.manifest.require())
    assert (got_meta.codec, got_meta.codec_id_bits) == ("packed", 7)
    assert_decodes_within_bound(got, plain)


@pytest.mark.parametrize(
    "version,column",
    [
        # commit 4790354: ids in rank order at 7 bits, float32 row ranges, the sampled token's exact log-prob
        (1, "teacher_topk_log_range"),
        # commit 3588faa: flat columns, a 13-byte id bitmap (k = 32), range levels, exact float32 mass and token
        (2, "teacher_topk_ids_bitmap"),
    ],
)
def test_parts_of_earlier_codec_versions_still_decode(version, column):
    """tests/data/codec_v<version>: a part as that codec version wrote it, next to the plain part it encodes; it
    decodes with its own gap scale (4) and its exact float32 mass and sampled-token log-prob."""
    store = Store(REPO / f"tests/data/codec_v{version}")
    packed_raw = pa.ipc.open_stream(pa.BufferReader(store.read_buffer("packed.arrow")[:-64])).schema
    assert packed_raw.metadata[b"opd.codec_version"] == str(version).encode() and column in packed_raw.names
    plain, _ = read_shard(store, "plain.arrow", kind=ANNOTATED)
    got, meta = read_shard(store, "packed.arrow", kind=ANNOTATED)
    assert (meta.codec, meta.codec_version) == ("packed", version)
    assert_decodes_within_bound(got, plain, legacy=True)


def test_rows_spanning_more_than_the_range_grid_keep_a_float32_range(student_store):
    plain = plain_part(np.random.default_rng(4), k=8, rows=6)
    lp = schema.flat_values(plain["teacher_topk_logprobs"]).copy()
    lp[3, 4:] = -3e38  # one row spans more than MAX_GRID_GAP nats: its range is off the grid
    plain = plain.set_column(
        2, "teacher_topk_logprobs", schema.ragged_fixed(lp, schema.list_lengths(plain[3]), pa.float32())
    )
    table, _ = codec.encode_annotation(plain, VOCAB)
    assert "log_range" in children(table) and "range_level" not in children(table)
    assert_decodes_within_bound(codec.decode_annotation(table, 8, 7), plain)


def test_repeated_ids_in_a_position_fall_back_from_the_bitmap_to_packed_ids():
    plain = plain_part(np.random.default_rng(6), k=32, rows=4)
    ids = schema.flat_values(plain["teacher_topk_ids"]).copy()
    ids[2, 5] = ids[2, 6]  # as a buggy scorer might write it: not a set
    plain = plain.set_column(1, "teacher_topk_ids", schema.ragged_fixed(ids, schema.list_lengths(plain[3]), pa.int32()))
    table, _ = codec.encode_annotation(plain, VOCAB)
    assert "ids_packed" in children(table)
    assert_decodes_within_bound(codec.decode_annotation(table, 32, 7), plain)


def test_packed_ids_keep_the_entry_order_that_compresses_better():
    rng = np.random.default_rng(8)
    plain = plain_part(rng, k=32, rows=100, vocab=5000)  # random sets: sorting the ids gains zstd little
    table, _ = codec.encode_annotation(plain, 5000)
    assert children(table)["lp_codes"].metadata == {b"opd.entry_order": b"rank"}
    assert_decodes_within_bound(codec.decode_annotation(table, 32, 13), plain)
    plain = plain_part(rng, k=8, rows=40, vocab=5000)
    ids = schema.flat_values(plain["teacher_topk_ids"])
    same_set = np.argsort(rng.random(ids.shape), axis=1) + 4000  # one set everywhere, shuffled: sorted, it repeats
    plain = plain.set_column(
        1, "teacher_topk_ids", schema.ragged_fixed(same_set, schema.list_lengths(plain[3]), pa.int32())
    )
    table, _ = codec.encode_annotation(plain, 5000)
    assert children(table)["lp_codes"].metadata == {b"opd.entry_order": b"id"}
    assert_decodes_within_bound(codec.decode_annotation(table, 8, 13), plain)


@pytest.mark.parametrize("k,name,width", [(4, "ids_packed", 4), (32, "ids_bitmap", 13), (8, "lp_codes", 8)])
def test_a_truncated_packed_column_is_refused_in_one_line(student_store, monkeypatch, k, name, width):
    _, table, meta = packed_part(student_store, np.random.default_rng(2), k=k)
    table = truncate_packed_field(table, name)
    expected = (
        f"packed column '{codec.PACKED}.{name}' is truncated: {width - 1} bytes per position, expected {width} "
        f"(k={k}, 7-bit ids)"
    )
    with pytest.raises(ShardError, match=re.escape(expected)):  # the writer refuses it ...
        write_shard(student_store, "annotated/p.arrow", table, meta)
    monkeypatch.setattr(schema, "validate_table", lambda *a, **kw: None)
    write_shard(student_store, "annotated/p.arrow", table, meta)  # ... so write it as a buggy writer would
    monkeypatch.undo()
    with pytest.raises(ShardError) as e:
        read_shard(student_store, "annotated/p.arrow")
    assert str(e.value) == f"{student_store.path('annotated/p.arrow')}: {expected}"


def test_annotate_with_codec_packed_writes_columns_that_decode_to_the_plain_annotation(
    student_store, tiny_model_factory
):
    teacher = tiny_model_factory("teacher", seed=1)
    shard_id = make_shard_id(0, "w00", 0)
    write_random_rollout_shard(
        student_store,
        shard_id=shard_id,
        num_rows=40,
        max_response=16,
        vocab_size=VOCAB,
        seed=3,
        run=student_store.manifest.require(),
    )
    part = layout.annotated_path(shard_id, "teacher")
    run_annotate(Config(annotate=AnnotateConfig(teacher=str(teacher), top_k=8)), student_store)
    plain, _ = read_shard(student_store, part)
    plain_bytes = student_store.fs.get_file_info(student_store.path(part)).size
    student_store.fs.delete_file(student_store.path(part))
    run_annotate(Config(annotate=AnnotateConfig(teacher=str(teacher), top_k=8, codec="packed")), student_store)

    raw = pa.ipc.open_stream(pa.BufferReader(student_store.read_buffer(part))).read_all()  # the bytes as stored
    assert "ids_packed" in children(raw) and "teacher_topk_ids" not in raw.schema.names
    assert raw.schema.metadata[b"opd.codec"] == b"packed" and raw.schema.metadata[b"opd.codec_id_bits"] == b"7"
    assert student_store.fs.get_file_info(student_store.path(part)).size < 0.6 * plain_bytes  # k=8, V=99

    got, meta = read_shard(student_store, part, kind=ANNOTATED, run=student_store.manifest.require())
    assert meta.codec == "packed"
    assert_decodes_within_bound(got, plain)

    # the trainer's reader gets the same decoded tensors
    data = load_shard(student_store, student_store.manifest.require(), shard_id, ["teacher"])
    np.testing.assert_array_equal(data.topk_ids, schema.flat_values(got["teacher_topk_ids"]))
    np.testing.assert_array_equal(data.topk_logprobs, schema.flat_values(got["teacher_topk_logprobs"]))
    np.testing.assert_array_equal(data.token_logprob, schema.flat_values(got["teacher_token_logprob"]))

    # `opd inspect STORE` names the codec of the parts
    from opd_cache.cli.inspect import summarize_store

    assert summarize_store(student_store)["teachers"]["teacher"]["codec"] == ["packed v3"]


# ---------------------------------------------------------------- loss parity
def assert_losses_match(
    student_logits: torch.Tensor, topk_ids: np.ndarray, topk_lp: np.ndarray, sampled: np.ndarray, token_lp: np.ndarray
) -> None:
    """token_losses from float32 vs packed annotations (encoded and decoded as a part): the mean loss within
    1e-3 nats/token and 1% relative, for the top-k divergences and the k3 estimator of the sampled token.

    The mean absolute per-token difference is also bounded (1% of the mean loss), so errors cannot hide by
    cancelling across tokens.
    """
    n = len(topk_ids)
    plain = annotated_table(
        sample_ids=["s0"], lengths=np.array([n]), topk_ids=topk_ids, topk_logprobs=topk_lp, token_logprob=token_lp
    )
    table, _ = codec.encode_annotation(plain, student_logits.shape[1])
    decoded = codec.decode_annotation(table, topk_ids.shape[1], idpack.id_bits(student_logits.shape[1]))
    sampled_ids = torch.from_numpy(sampled)
    for divergence in ("forward_kl", "reverse_kl", "jsd", "k3"):
        config = LossConfig(divergence=divergence, tail="bucket")
        ref, got = (
            token_losses(
                student_logits,
                torch.from_numpy(schema.flat_values(t["teacher_topk_ids"]).copy()),
                torch.from_numpy(schema.flat_values(t["teacher_topk_logprobs"]).astype(np.float32)),
                config,
                sampled_ids=sampled_ids,
                teacher_token_logprobs=torch.from_numpy(schema.flat_values(t["teacher_token_logprob"]).copy()),
            ).double()
            for t in (plain, decoded)
        )
        mean_error = (got.mean() - ref.mean()).abs().item()
        relative = mean_error / ref.mean().item()
        per_token = (got - ref).abs().mean().item()
        assert mean_error <= 1e-3 and relative <= 0.01 and per_token <= 0.01 * ref.mean().item(), (
            divergence,
            mean_error,
            relative,
            per_token,
            ref.mean().item(),
        )


@torch.inference_mode()
def test_losses_from_packed_match_float32_on_the_trained_demo_teacher():
    tok = load_tokenizer(str(REPO / "data/models/student"))
    student = load_causal_lm(REPO / "data/models/student").eval()
    teacher = load_causal_lm(REPO / "data/models/teacher").eval()
    # all 400 held-out prompts (~3,800 tokens): reverse KL's per-token errors spread ~0.014 nats, so the mean of a
    # few hundred tokens would measure sampling noise (~1e-3), not the codec's bias (< 2e-4 on 19,716 tokens)
    prompts = pq.read_table(REPO / "data/arithmetic/test.parquet").column("prompt").to_pylist()
    texts = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    torch.manual_seed(0)
    out = student.generate(**batch, do_sample=True, max_new_tokens=10, pad_token_id=tok.pad_token_id)
    full = torch.cat([batch["attention_mask"], torch.ones_like(out[:, batch["input_ids"].shape[1] :])], 1)
    start = batch["input_ids"].shape[1] - 1  # logits at position t predict response token t + 1
    teacher_lp = torch.log_softmax(teacher(input_ids=out, attention_mask=full).logits[:, start:-1].float(), -1)
    student_logits = student(input_ids=out, attention_mask=full).logits[:, start:-1].float()
    vocab = teacher_lp.shape[-1]
    sampled = out[:, start + 1 :].reshape(-1)  # the response tokens (padding after eos counts as sampled too)
    teacher_lp, student_logits = teacher_lp.reshape(-1, vocab), student_logits.reshape(-1, vocab)
    token_lp = teacher_lp.gather(1, sampled[:, None])[:, 0].numpy()
    assert teacher_lp.exp().max(-1).values.median() > 0.9  # trained: peaked, the hard case for quantization
    for k in (8, 32, 64):
        top = torch.topk(teacher_lp, k)
        assert_losses_match(student_logits, top.indices.int().numpy(), top.values.numpy(), sampled.numpy(), token_lp)


@torch.inference_mode()
def test_losses_from_packed_match_float32_on_a_smollm2_vocabulary_llama():
    vocab = 49152  # SmolLM2's vocabulary (random ids within it); the model is built here from a config
    teacher = build_tiny_model(vocab_size=vocab, hidden_size=64, num_layers=2, seed=1)
    student = build_tiny_model(vocab_size=vocab, hidden_size=64, num_layers=2, seed=2)
    with torch.no_grad():  # random weights give near-uniform outputs; sharpen the teacher's head to peak it
        teacher.get_output_embeddings().weight.mul_(40.0)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, size=(2, 48)))
    teacher_lp = torch.log_softmax(teacher(input_ids=ids).logits.float(), -1).reshape(-1, vocab)
    student_logits = student(input_ids=ids).logits.float().reshape(-1, vocab)
    assert teacher_lp.exp().max(-1).values.median() > 0.3
    top = torch.topk(teacher_lp, 64)
    torch.manual_seed(3)
    sampled = torch.distributions.Categorical(logits=student_logits).sample()
    sampled[::2] = top.indices[::2, 1]  # half the sampled tokens among the teacher's top-k, as on a trained pair
    token_lp = teacher_lp.gather(1, sampled[:, None])[:, 0].numpy()
    assert_losses_match(student_logits, top.indices.int().numpy(), top.values.numpy(), sampled.numpy(), token_lp)


def test_parts_written_before_the_range_grid_still_decode_within_their_bound(monkeypatch):
    """Ranges off the lookup grid (parts from before it, rows spanning > MAX_GRID_GAP) take the exact path."""
    lp = sorted_logprobs(np.random.default_rng(5), 200, 400, 32, 3.0)
    grid_codes, grid_mass, grid_range = codec.quantize_logprobs(lp)
    monkeypatch.setattr(quantize, "_row_ranges", lambda max_gaps, c=quantize.GAP_SCALE: np.log1p(max_gaps / c))
    codes, log_mass, log_range = codec.quantize_logprobs(lp)  # off the grid (exact L), as version 1 wrote every row
    bound = quantize.logprob_bound(lp, mass_quantized=False)
    monkeypatch.undo()
    assert not np.array_equal(log_range, grid_range)  # really off the grid
    decoded = codec.dequantize_logprobs(codes, log_mass, log_range)
    assert (np.abs(decoded - lp) <= bound + 1e-6).all()
    # mixed: half the rows on the grid, half off, decode each by its own path
    mixed = codec.dequantize_logprobs(
        np.concatenate([grid_codes[:100], codes[100:]]),
        np.concatenate([grid_mass[:100], log_mass[100:]]),
        np.concatenate([grid_range[:100], log_range[100:]]),
    )
    np.testing.assert_array_equal(mixed[100:], decoded[100:])
    np.testing.assert_array_equal(mixed[:100], codec.dequantize_logprobs(grid_codes, grid_mass, grid_range)[:100])


def test_a_packed_part_keeps_the_support_log_probs_beside_its_struct(student_store):
    """With `train.support: union` annotate also scores the student's top-k: that column stays plain float32 next to
    the packed struct, its lengths are checked against it, and it reads back unchanged."""
    rng = np.random.default_rng(9)
    plain = plain_part(rng, k=8, rows=6)
    n = len(schema.flat_values(plain["teacher_token_logprob"]))
    plain = annotated_table(
        sample_ids=plain["sample_id"].to_pylist(),
        lengths=schema.list_lengths(plain["teacher_token_logprob"]),
        topk_ids=schema.flat_values(plain["teacher_topk_ids"]),
        topk_logprobs=schema.flat_values(plain["teacher_topk_logprobs"]),
        token_logprob=schema.flat_values(plain["teacher_token_logprob"]),
        support_logprobs=-rng.random((n, 3)).astype(np.float32) - 5,
    )
    table, codec_meta = codec.encode_annotation(plain, VOCAB)
    assert table.schema.names == ["sample_id", codec.PACKED, "teacher_support_logprobs"]
    _, _, meta = packed_part(student_store, rng, k=8)
    write_shard(student_store, "annotated/s.arrow", table, meta)
    got, _ = read_shard(student_store, "annotated/s.arrow", kind=ANNOTATED, run=student_store.manifest.require())
    assert got["teacher_support_logprobs"].equals(plain["teacher_support_logprobs"])
    assert_decodes_within_bound(
        got.drop_columns(["teacher_support_logprobs"]), plain.drop_columns(["teacher_support_logprobs"])
    )
    # a support column one position short in a row is refused, naming the row
    lengths = schema.list_lengths(plain["teacher_token_logprob"])
    short = lengths.copy()
    short[2] -= 1
    support = schema.flat_values(plain["teacher_support_logprobs"])
    keep = np.ones(len(support), bool)
    keep[int(lengths[:3].sum()) - 1] = False
    bad = table.set_column(2, "teacher_support_logprobs", schema.ragged_fixed(support[keep], short, pa.float32()))
    with pytest.raises(ShardError, match=r"row 2 \(sample 's2'\) has \d+ entries in 'teacher_support_logprobs'"):
        write_shard(student_store, "annotated/s2.arrow", bad, meta)
