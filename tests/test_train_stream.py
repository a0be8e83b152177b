"""The trainer's streaming reader: admission, order, staleness, resume cursor, batches, rank split, decoding."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from opd_cache.storage import layout
from opd_cache.storage.schema import ShardError, annotated_table, flat_values, read_shard
from opd_cache.storage.store import make_shard_id
from opd_cache.testing import write_annotated_part, write_synthetic_shard
from opd_cache.train.loader import BatchLoader
from opd_cache.train.microbatch import decode_rows
from opd_cache.train.shard_data import ShardCache, load_shard, required_teachers
from opd_cache.train.stream import (
    GlobalBatch,
    ShardStream,
    StreamCursor,
    StreamEnd,
    assign_ranks,
    group_advantages,
)

V, K = 32, 4


@pytest.fixture
def run(local_store):
    return local_store.manifest.ensure(
        student="student", tokenizer_fingerprint="fp-test", vocab_size=V, top_k=K, teachers={"teacher": "teacher-path"}
    )


def shard(store, run, version, seq, rows=6, worker="w00", annotate=True, **kwargs):
    shard_id = make_shard_id(version, worker, seq)
    write_synthetic_shard(
        store,
        run,
        shard_id,
        num_rows=rows,
        vocab_size=V,
        top_k=K,
        seed=version * 100 + seq,
        annotate=annotate,
        **kwargs,
    )
    return shard_id


def make_stream(store, run, cursor=None, **kwargs):
    options = dict(max_staleness=10, batch_samples=4, batch_tokens=None, poll_seconds=0.05)
    options.update(kwargs)
    cache = ShardCache(store, run, required_teachers(run))
    return ShardStream(store, run, cache, cursor=cursor, **options), cache


def drain(stream, version=0, limit=100):
    batches = []
    for step in range(1, limit):
        batch = stream.next_batch(step, version)
        if isinstance(batch, StreamEnd):
            return batches, batch
        batches.append(batch)
    raise AssertionError("stream did not end")


def skipped(store):
    out = {}
    for info in store.list_files("train/skipped"):
        shard_id = info.base_name.removesuffix(".jsonl")
        for line in store.read_bytes(layout.skipped_path(shard_id)).decode().splitlines():
            record = json.loads(line)
            out[record["sample_id"]] = record["reason"]
    return out


def test_required_teachers_follow_run_json():
    assert required_teachers({"teachers": {"t": "p"}}) == ["t"]
    assert required_teachers(
        {"teachers": {"a": "p", "b": "q"}, "routing": {"key": "data_source", "map": {"x": "a"}, "default": "b"}}
    ) == ["a", "b"]
    assert required_teachers({}) == []


def test_admits_complete_shards_only_oldest_version_first(local_store, run):
    newer = shard(local_store, run, 1, 0)
    older = shard(local_store, run, 0, 0, worker="w01")
    pending = shard(local_store, run, 0, 1, annotate=False)  # no teacher part yet
    stream, _ = make_stream(local_store, run, batch_samples=100)
    batches, end = drain(stream, version=1)
    ids = [sid for b in batches for sid in b.sample_ids]
    # one partial batch: all rows of the older shard first, then the newer one; never the pending shard
    assert ids == [f"{older}-{i}" for i in range(6)] + [f"{newer}-{i}" for i in range(6)]
    assert end.cursor.finished == [older, newer] and end.cursor.trained_samples == 12

    # once its part exists, a stream resumed from the cursor trains the pending shard
    write_synthetic_shard(local_store, run, pending, num_rows=6, vocab_size=V, top_k=K, seed=1)
    stream, _ = make_stream(local_store, run, cursor=end.cursor, batch_samples=100)
    batches, _ = drain(stream, version=1)
    assert [sid for b in batches for sid in b.sample_ids] == [f"{pending}-{i}" for i in range(6)]


def test_expired_shards_are_counted_listed_and_never_batched(local_store, run):
    stale_done = shard(local_store, run, 0, 0)
    stale_pending = shard(local_store, run, 0, 1, annotate=False)
    fresh = shard(local_store, run, 2, 0)
    stream, _ = make_stream(local_store, run, max_staleness=1, batch_samples=100)
    batches, end = drain(stream, version=3)
    assert [sid for b in batches for sid in b.sample_ids] == [f"{fresh}-{i}" for i in range(6)]
    assert batches[0].expired_rows == 12 and end.cursor.expired_samples == 12
    assert all(b.version - v <= 1 for b in batches for v in b.row_version)
    reasons = skipped(local_store)
    assert reasons == {f"{s}-{i}": "expired" for s in (stale_done, stale_pending) for i in range(6)}
    assert set(end.cursor.finished) == {stale_done, stale_pending, fresh}


def test_partially_consumed_shard_expires_its_remaining_rows(local_store, run):
    sid = shard(local_store, run, 0, 0, rows=8)
    stream, _ = make_stream(local_store, run, max_staleness=0, batch_samples=3)
    first = stream.next_batch(1, 0)
    assert first.sample_ids == [f"{sid}-{i}" for i in range(3)]
    end = stream.next_batch(2, 1)  # the student moved on to version 1: the rest of the v0 shard is too stale
    assert isinstance(end, StreamEnd) and end.expired_rows == 5
    assert skipped(local_store) == {f"{sid}-{i}": "expired" for i in range(3, 8)}
    assert end.cursor.trained_samples == 3 and end.cursor.expired_samples == 5


def test_resuming_from_a_batch_cursor_continues_exactly(local_store, run):
    for seq in range(4):
        shard(local_store, run, 0, seq, rows=7)
    stream, _ = make_stream(local_store, run, batch_samples=5)
    batches, _ = drain(stream)
    assert [len(b.sample_ids) for b in batches] == [5, 5, 5, 5, 5, 3]
    all_ids = [sid for b in batches for sid in b.sample_ids]
    assert len(all_ids) == len(set(all_ids)) == 28
    saved = json.loads(json.dumps(batches[1].cursor.to_dict()))  # as a resume state's trainer.json holds it
    resumed, _ = make_stream(local_store, run, cursor=StreamCursor.from_dict(saved), batch_samples=5)
    rest, _ = drain(resumed)
    assert [b.sample_ids for b in rest] == [b.sample_ids for b in batches[2:]]


def test_token_budget_batches(local_store, run):
    for seq in range(3):
        shard(local_store, run, 0, seq, rows=9)
    stream, _ = make_stream(local_store, run, batch_samples=None, batch_tokens=60)
    batches, _ = drain(stream)
    ids = [sid for b in batches for sid in b.sample_ids]
    assert len(ids) == len(set(ids)) == 27
    for b in batches[:-1]:
        tokens = int((b.prompt_lengths + b.response_lengths).sum())
        assert tokens <= 60 or b.num_rows == 1
        assert tokens > 60 - 25  # the next row would not have fit (rows are at most 8 + 12 tokens)


def test_routing_joins_each_row_with_its_teacher(local_store):
    run = local_store.manifest.ensure(
        student="s",
        tokenizer_fingerprint="fp",
        vocab_size=V,
        top_k=K,
        teachers={"math": "m", "code": "c"},
        routing={"key": "data_source", "map": {"gsm8k": "math", "mbpp": "code"}, "default": None},
    )
    sources = ["gsm8k", "mbpp", "other", "mbpp", "gsm8k", "gsm8k", "other", "mbpp", "gsm8k"]
    sid = make_shard_id(0, "w00", 0)
    write_synthetic_shard(
        local_store,
        run,
        sid,
        num_rows=9,
        vocab_size=V,
        top_k=K,
        seed=3,
        teachers={"math": None, "code": None},
        routing={"gsm8k": "math", "mbpp": "code"},
        data_sources=sources,
    )
    stream, cache = make_stream(local_store, run, batch_samples=100)
    batch = stream.next_batch(1, 0)
    routed = [i for i, s in enumerate(sources) if s != "other"]
    assert batch.sample_ids == [f"{sid}-{i}" for i in routed]
    assert batch.teachers == [{"gsm8k": "math", "mbpp": "code"}[sources[i]] for i in routed]
    assert skipped(local_store) == {f"{sid}-2": "unrouted", f"{sid}-6": "unrouted"}
    assert batch.cursor.unrouted_samples == 2

    # every decoded teacher target is the routed teacher's entry for that row
    assign_ranks(batch, 1, 10_000)
    mb = decode_rows(
        cache,
        batch.shard_ids,
        batch.row_shard,
        batch.row_index,
        aggregation="token-mean",
        global_tokens=batch.response_tokens,
        global_seqs=batch.global_seqs,
    )
    expected_ids, expected_lp = [], []
    rollout, _ = read_shard(local_store, layout.rollout_path(sid))
    for row in sorted(batch.row_index.tolist()):
        part, _ = read_shard(local_store, layout.annotated_path(sid, batch.teachers[routed.index(row)]))
        j = part["sample_id"].to_pylist().index(f"{sid}-{row}")
        expected_ids.append(np.array(part["teacher_topk_ids"][j].as_py()).reshape(-1, K))
        expected_lp.append(np.array(part["teacher_topk_logprobs"][j].as_py()).reshape(-1, K))
    np.testing.assert_array_equal(mb.teacher_topk_ids.numpy(), np.concatenate(expected_ids))
    np.testing.assert_allclose(mb.teacher_topk_logprobs.numpy(), np.concatenate(expected_lp), rtol=1e-6)


def test_assign_ranks_balances_tokens_and_equalises_micro_batches():
    rng = np.random.default_rng(0)
    n = 37
    prompt, response = rng.integers(3, 20, n), rng.integers(0, 40, n)
    batch = GlobalBatch(
        step=1,
        version=0,
        shard_ids=["s"],
        row_shard=np.zeros(n, np.int32),
        row_index=np.arange(n),
        prompt_lengths=prompt,
        response_lengths=response,
        row_version=np.zeros(n, np.int32),
        sample_ids=[str(i) for i in range(n)],
        teachers=["t"] * n,
        cursor=StreamCursor(),
    )
    budget = 120
    assign_ranks(batch, 3, budget)
    lengths = prompt + response
    per_rank = [int(lengths[batch.rank_of_row == r].sum()) for r in range(3)]
    assert max(per_rank) - min(per_rank) <= lengths.max()
    assert sorted(np.bincount(batch.rank_of_row).tolist()) in ([12, 12, 13],)
    for r in range(3):
        for m in range(batch.num_micro):
            rows = np.nonzero((batch.rank_of_row == r) & (batch.micro_of_row == m))[0]
            if len(rows) > 1:
                assert len(rows) * lengths[rows].max() <= budget
    assert batch.num_micro == max(len(set(batch.micro_of_row[batch.rank_of_row == r])) for r in range(3))


def test_decode_builds_the_padded_layout_and_global_weights(local_store, run):
    sid = shard(local_store, run, 0, 0, rows=5, response_len=(0, 6))
    stream, cache = make_stream(local_store, run, batch_samples=5)
    batch = stream.next_batch(1, 0)
    rollout, _ = read_shard(local_store, layout.rollout_path(sid))
    part, _ = read_shard(local_store, layout.annotated_path(sid, "teacher"))
    rows = np.array([4, 1, 3])  # any subset, any order
    mb = decode_rows(
        cache,
        batch.shard_ids,
        np.zeros(3, np.int32),
        rows,
        aggregation="token-mean",
        global_tokens=batch.response_tokens,
        global_seqs=batch.global_seqs,
    )
    seqs = {r: rollout["prompt_ids"][r].as_py() + rollout["response_ids"][r].as_py() for r in rows}
    decoded = [mb.input_ids[i, : int(mb.attention_mask[i].sum())].tolist() for i in range(3)]
    assert sorted(map(tuple, decoded)) == sorted(map(tuple, seqs.values()))
    # the hidden state at each response position predicts the next token: the input there + 1 is the target
    flat = mb.input_ids.flatten()
    assert flat[mb.response_positions + 1].tolist() == mb.sampled_ids.tolist()
    n_tokens = sum(len(rollout["response_ids"][r].as_py()) for r in rows)
    assert mb.num_tokens == n_tokens
    assert np.allclose(mb.token_weights.numpy(), 1.0 / batch.response_tokens)
    all_lp = flat_values(part["teacher_token_logprob"])
    assert set(np.round(mb.teacher_token_logprobs.numpy(), 6)) <= set(np.round(all_lp, 6))


def test_follow_waits_for_new_shards_then_idle_timeout_ends(local_store, run):
    shard(local_store, run, 0, 0, rows=4)
    # a long idle timeout while the late shard is on its way: writing it may take seconds on a loaded machine
    # (a 0.5 s timeout once ended the wait 0.1 s after the writer started); a short one for the end
    stream, _ = make_stream(local_store, run, follow=True, batch_samples=4, idle_timeout=60)
    assert stream.next_batch(1, 0).num_rows == 4
    late = make_shard_id(0, "w00", 1)
    writer = threading.Timer(
        0.4, lambda: write_synthetic_shard(local_store, run, late, num_rows=4, vocab_size=V, top_k=K, seed=9)
    )
    writer.start()
    t0 = time.monotonic()
    batch = stream.next_batch(2, 0)
    writer.join()
    assert batch.sample_ids == [f"{late}-{i}" for i in range(4)]
    assert batch.wait_seconds >= 0.2 and time.monotonic() - t0 >= 0.4
    stream.idle_timeout = 0.5
    end = stream.next_batch(3, 0)
    assert isinstance(end, StreamEnd) and "idle" in end.reason and end.kind == "idle_timeout"


def test_loader_prefetches_the_planned_batches(local_store, run):
    for seq in range(3):
        shard(local_store, run, 0, seq, rows=5)
    stream, cache = make_stream(local_store, run, batch_samples=4)
    loader = BatchLoader(
        cache=cache,
        stream=stream,
        rank=0,
        world_size=1,
        first_step=1,
        max_steps=3,
        version_of_step=lambda s: 0,
        micro_batch_tokens=20,
        aggregation="token-mean",
    ).start()
    steps = [loader.get() for _ in range(3)]
    loader.close()
    assert [s.batch.step for s in steps] == [1, 2, 3]
    for s in steps:
        assert len(s.micro_batches) == s.batch.num_micro >= 1
        assert sum(mb.num_rows for mb in s.micro_batches) == 4
        assert abs(sum(float(mb.token_weights.sum()) for mb in s.micro_batches) - 1.0) < 1e-5


def test_group_advantages():
    adv = group_advantages(np.array([1.0, 0.0, 1.0, 1.0, 0.0]), np.array([7, 7, 8, 8, 9]))
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0, 0.0], atol=1e-5)


# ------------------------------------------------------------------ bad shards: one clear message each
def test_part_with_another_top_k_is_refused(local_store, run):
    sid = shard(local_store, run, 0, 0)
    table, _ = read_shard(local_store, layout.rollout_path(sid))
    lengths = np.array([len(r) for r in table["response_ids"].to_pylist()])
    total = int(lengths.sum())
    part = annotated_table(
        sample_ids=table["sample_id"].to_pylist(),
        lengths=lengths,
        topk_ids=np.tile(np.arange(8), (total, 1)),
        topk_logprobs=np.full((total, 8), -3.0),
        token_logprob=np.full(total, -1.0),
    )
    write_annotated_part(local_store, run, sid, "teacher", part, top_k=8)
    with pytest.raises(ShardError, match=r"teacher\.arrow: annotated with top_k=8 but run.json has top_k=4"):
        load_shard(local_store, run, sid, ["teacher"])


def test_part_from_another_tokenizer_is_refused(local_store, run):
    sid = shard(local_store, run, 0, 0)
    other = dict(run, tokenizer_fingerprint="fp-other")
    write_synthetic_shard(local_store, other, make_shard_id(0, "w00", 1), num_rows=3, vocab_size=V, top_k=K)
    with pytest.raises(ShardError, match="written with tokenizer 'fp-other', this run uses 'fp-test'"):
        load_shard(local_store, run, make_shard_id(0, "w00", 1), ["teacher"])
    load_shard(local_store, run, sid, ["teacher"])  # the good one still loads


def test_union_support_without_student_topk_is_refused(local_store, run):
    sid = shard(local_store, run, 0, 0)
    with pytest.raises(ShardError, match="support 'union' needs the column 'student_topk_ids'"):
        load_shard(local_store, run, sid, ["teacher"], need_support=True)


def test_union_support_decodes_student_topk_and_teacher_support(local_store):
    run = local_store.manifest.ensure(
        student="s", tokenizer_fingerprint="fp", vocab_size=V, top_k=K, student_topk=3, teachers={"teacher": "t"}
    )
    sid = make_shard_id(0, "w00", 0)
    write_synthetic_shard(local_store, run, sid, num_rows=4, vocab_size=V, top_k=K, student_topk=3, seed=2)
    cache = ShardCache(local_store, run, ["teacher"], need_support=True)
    data = cache.get(sid)
    mb = decode_rows(
        cache,
        [sid],
        np.zeros(4, np.int32),
        np.arange(4),
        aggregation="token-mean",
        global_tokens=int(data.response_lengths.sum()),
        global_seqs=4,
    )
    assert mb.support_ids.shape == (mb.num_tokens, 3) and mb.support_logprobs.shape == (mb.num_tokens, 3)
    np.testing.assert_array_equal(mb.support_ids.numpy(), data.student_topk_ids)
