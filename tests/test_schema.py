"""Shard schemas: round trips, readers outside this package, and validation of bad files."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest

from opd_cache.storage import layout
from opd_cache.storage.schema import (
    ANNOTATED,
    ROLLOUT,
    ShardError,
    ShardMeta,
    annotated_table,
    check_annotation_matches,
    flat_values,
    list_lengths,
    read_shard,
    rollout_table,
    write_shard,
)
from opd_cache.storage.store import Store
from opd_cache.testing import write_annotated_part
from tests.conftest import write_random_rollout_shard

SHARD = "v000002-w00-000001"


def annotated_part(rollout: pa.Table, k: int = 4, dtype: str = "float32", support_k: int = 0, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = list_lengths(rollout["response_ids"])
    total = int(lengths.sum())
    logprobs = np.sort(np.log(rng.dirichlet(np.ones(k + 2), size=total))[:, :k], axis=1)[:, ::-1]
    return annotated_table(
        sample_ids=rollout["sample_id"].to_pylist(),
        lengths=lengths,
        topk_ids=rng.integers(0, 32, size=(total, k)),
        topk_logprobs=logprobs,
        token_logprob=-rng.random(total),
        logprob_dtype=dtype,
        support_logprobs=-rng.random((total, support_k)) if support_k else None,
    )


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "store")


def test_rollout_round_trip_with_empty_responses_and_student_topk(store):
    written = write_random_rollout_shard(store, shard_id=SHARD, num_rows=16, max_response=3, student_topk=3)
    assert (list_lengths(written["response_ids"]) == 0).any(), "the seed should produce an empty response"
    table, meta = read_shard(store, layout.rollout_path(SHARD), kind=ROLLOUT, run=store.manifest.read())
    assert table.equals(written)
    assert (meta.kind, meta.policy_version, meta.shard_id, meta.student_topk) == (ROLLOUT, 2, SHARD, 3)
    assert flat_values(table["student_topk_ids"]).shape == (int(list_lengths(table["response_ids"]).sum()), 3)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_annotated_round_trip(store, dtype):
    rollout = write_random_rollout_shard(store, shard_id=SHARD, num_rows=8)
    part = annotated_part(rollout, dtype=dtype, support_k=2)
    run = store.manifest.read()
    write_annotated_part(store, run, SHARD, "teacher", part, top_k=4)
    table, meta = read_shard(store, layout.annotated_path(SHARD, "teacher"), kind=ANNOTATED, run=run)
    assert table.equals(part)
    assert meta.top_k == 4 and meta.teacher == "teacher"
    expected_np = np.float16 if dtype == "float16" else np.float32
    assert flat_values(table["teacher_topk_logprobs"]).dtype == expected_np
    check_annotation_matches(rollout, table, "x")


def test_datasets_and_pyarrow_read_shards_without_this_package(store):
    import datasets

    rollout = write_random_rollout_shard(store, shard_id=SHARD, num_rows=5)
    write_annotated_part(
        store, store.manifest.read(), SHARD, "teacher", annotated_part(rollout, dtype="float16"), top_k=4
    )
    ds = datasets.Dataset.from_file(str(store.local_path(layout.rollout_path(SHARD))))
    assert ds["sample_id"] == rollout["sample_id"].to_pylist()
    assert ds[0]["response_ids"] == rollout["response_ids"][0].as_py()
    ann = datasets.Dataset.from_file(str(store.local_path(layout.annotated_path(SHARD, "teacher"))))
    assert len(ann) == 5
    with pa.memory_map(str(store.local_path(layout.rollout_path(SHARD)))) as f:
        assert pa.ipc.open_stream(f).read_all().num_rows == 5


def test_truncated_file_is_rejected(store):
    write_random_rollout_shard(store, shard_id=SHARD, num_rows=50)
    path = store.local_path(layout.rollout_path(SHARD))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ShardError, match=r"v000002-w00-000001.arrow: truncated or not an Arrow IPC stream"):
        read_shard(store, layout.rollout_path(SHARD))


def test_foreign_file_is_rejected(store):
    table = pa.table({"x": [1, 2, 3]})
    store.write_atomic(layout.rollout_path(SHARD), lambda out: pa.ipc.new_stream(out, table.schema).write_table(table))
    with pytest.raises(ShardError, match=r"not an opd_cache shard \(no 'opd.kind' in the Arrow schema metadata\)"):
        read_shard(store, layout.rollout_path(SHARD))


def test_wrong_schema_version_and_other_run_are_rejected(store):
    rollout = write_random_rollout_shard(store, shard_id=SHARD)
    meta = ShardMeta(
        kind=ROLLOUT,
        run_id="other",
        tokenizer_fingerprint="fp-test",
        shard_id=SHARD,
        policy_version=2,
        schema_version=99,
    )
    write = lambda out: pa.ipc.new_stream(out, rollout.schema.with_metadata(meta.to_metadata())).write_table(
        rollout.replace_schema_metadata(meta.to_metadata())
    )
    store.write_atomic("rollouts/v000009-w00-000000.arrow", write)
    with pytest.raises(ShardError, match=r"schema version 99, this opd_cache reads version 1"):
        read_shard(store, "rollouts/v000009-w00-000000.arrow")
    meta.schema_version = 1
    store.write_atomic("rollouts/v000009-w00-000000.arrow", write)
    with pytest.raises(ShardError, match=r"belongs to run 'other', this store is run '[0-9a-f]+'"):
        read_shard(store, "rollouts/v000009-w00-000000.arrow", run=store.manifest.read())
    with pytest.raises(ShardError, match=r"is a 'rollout' shard, expected 'annotated'"):
        read_shard(store, "rollouts/v000009-w00-000000.arrow", kind=ANNOTATED)


def test_inconsistent_per_token_lengths_are_rejected(store):
    run = store.manifest.ensure(student="s", tokenizer_fingerprint="fp")
    table = rollout_table(
        sample_ids=["a", "b"],
        prompt_index=[0, 1],
        sample_index=[0, 0],
        prompt_ids=[[1], [2]],
        response_ids=[[3, 4], [5]],
        behavior_logprobs=[[-1.0, -1.0], [-1.0, -2.0]],
        policy_version=0,
        finish_reason=["stop", "stop"],
    )
    meta = ShardMeta(kind=ROLLOUT, run_id=run["run_id"], tokenizer_fingerprint="fp", shard_id=SHARD, policy_version=0)
    with pytest.raises(
        ShardError, match=r"row 1 \(sample 'b'\) has 2 entries in 'behavior_logprobs' but 1 in 'response_ids'"
    ):
        write_shard(store, layout.rollout_path(SHARD), table, meta)
    assert not store.exists(layout.rollout_path(SHARD)), "nothing may be written for an invalid table"


def test_empty_prompt_and_wrong_column_type_are_rejected(store):
    run = store.manifest.ensure(student="s", tokenizer_fingerprint="fp")
    meta = ShardMeta(kind=ROLLOUT, run_id=run["run_id"], tokenizer_fingerprint="fp", shard_id=SHARD, policy_version=0)
    table = rollout_table(
        sample_ids=["a"],
        prompt_index=[0],
        sample_index=[0],
        prompt_ids=[[]],
        response_ids=[[3]],
        behavior_logprobs=[[-1.0]],
        policy_version=0,
        finish_reason=["stop"],
    )
    with pytest.raises(ShardError, match=r"row 0 has an empty prompt"):
        write_shard(store, layout.rollout_path(SHARD), table, meta)
    bad = table.set_column(4, "response_ids", pa.array([[3]], pa.list_(pa.int64())))
    with pytest.raises(
        ShardError, match=r"column 'response_ids' has type list<item: int64>, expected list<item: int32>"
    ):
        write_shard(store, layout.rollout_path(SHARD), bad, meta)


def test_annotation_must_match_its_rollout(store):
    rollout = write_random_rollout_shard(store, shard_id=SHARD, num_rows=6, max_response=4, seed=3)
    part = annotated_part(rollout)
    other = write_random_rollout_shard(store, shard_id="v000002-w00-000002", num_rows=6, max_response=4, seed=4)
    with pytest.raises(ShardError, match="sample ids differ from its rollout shard"):
        check_annotation_matches(other, part, "part")
    shifted = rollout.set_column(4, "response_ids", other["response_ids"])
    with pytest.raises(ShardError, match=r"row \d+ has \d+ teacher positions but its response has \d+ tokens"):
        check_annotation_matches(shifted, part, "part")


def test_a_routed_part_covers_some_rows_in_rollout_order(store):
    """The trainer's join (shard_data.load_shard) and the whole-part check are one function."""
    rollout = write_random_rollout_shard(store, shard_id=SHARD, num_rows=6, max_response=4, seed=3)
    part = annotated_part(rollout.take([1, 3, 4]))
    assert check_annotation_matches(rollout, part, "part", every_row=False).tolist() == [1, 3, 4]
    assert check_annotation_matches(rollout, annotated_part(rollout), "part").tolist() == list(range(6))
    with pytest.raises(ShardError, match=r"part: sample ids differ from its rollout shard$"):
        check_annotation_matches(rollout, part, "part")  # a part of some rows where every row is expected
    with pytest.raises(ShardError, match=r"part: rows are not in rollout order \(or repeat a sample\)"):
        check_annotation_matches(rollout, annotated_part(rollout.take([3, 1])), "part", every_row=False)
    other = write_random_rollout_shard(store, shard_id="v000002-w00-000002", num_rows=2, max_response=4, seed=4)
    sample = other["sample_id"][0].as_py()
    with pytest.raises(ShardError, match=re.escape(f"sample ids differ from its rollout shard (sample {sample!r} is")):
        check_annotation_matches(rollout, annotated_part(other), "part", every_row=False)
