"""Schema version 2 on the rollout side: multi-turn columns (loss_mask, turn_index), their validation, and
reading version-1 shards as before (docs/design.md §3, "Schema version 2")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from opd_cache.storage import layout
from opd_cache.storage.schema import (
    ROLLOUT,
    SCHEMA_VERSION,
    ShardError,
    ShardMeta,
    read_shard,
    rollout_schema,
    rollout_table,
    trained_mask,
    write_shard,
)
from opd_cache.storage.store import Store

REPO = Path(__file__).resolve().parents[1]
SHARD = "v000000-w00-000000"


def multi_turn_table(loss_mask=None, turn_index=None, logprobs=None) -> pa.Table:
    """Three rows: a multi-turn row, a single-turn row (null mask) and a second multi-turn row."""
    return rollout_table(
        sample_ids=[f"{SHARD}-{i}" for i in range(3)],
        prompt_index=[0, 1, 2],
        sample_index=[0, 0, 0],
        prompt_ids=[[1, 2], [3], [4, 5, 6]],
        response_ids=[[7, 8, 9, 10], [11, 12], [13]],
        behavior_logprobs=logprobs or [[-0.5, 0.0, 0.0, -1.5], [-0.25, -0.75], [-2.0]],
        policy_version=0,
        finish_reason=["stop", "length", "stop"],
        loss_mask=loss_mask or [[1, 0, 0, 1], None, [1]],
        turn_index=turn_index or [[1, 2, 2, 3], None, [1]],
    )


def meta(version: int = SCHEMA_VERSION) -> ShardMeta:
    return ShardMeta(
        kind=ROLLOUT,
        run_id="run0",
        tokenizer_fingerprint="fp",
        shard_id=SHARD,
        policy_version=0,
        schema_version=version,
    )


def test_schema_version_2_is_stamped_and_multi_turn_columns_round_trip(local_store):
    assert SCHEMA_VERSION == 2
    table = multi_turn_table()
    assert table.schema.names[6:8] == ["loss_mask", "turn_index"]
    assert table.schema == rollout_schema(0, multi_turn=True)
    write_shard(local_store, layout.rollout_path(SHARD), table, meta())
    read, read_meta = read_shard(local_store, layout.rollout_path(SHARD), kind=ROLLOUT)
    assert read_meta.schema_version == 2
    assert read["loss_mask"].to_pylist() == [[1, 0, 0, 1], None, [1]]
    assert read["turn_index"].to_pylist() == [[1, 2, 2, 3], None, [1]]
    # the single-turn row trains every position; the multi-turn rows only their mask-1 positions
    assert trained_mask(read).tolist() == [True, False, False, True, True, True, True]


def test_single_turn_tables_have_no_new_column_and_train_everywhere():
    table = rollout_table(
        sample_ids=["a"],
        prompt_index=[0],
        sample_index=[0],
        prompt_ids=[[1]],
        response_ids=[[2, 3]],
        behavior_logprobs=[[-1.0, -1.0]],
        policy_version=0,
        finish_reason=["stop"],
    )
    assert table.schema == rollout_schema(0) and "loss_mask" not in table.schema.names
    assert trained_mask(table).tolist() == [True, True]
    with pytest.raises(ValueError, match="loss_mask and turn_index go together"):
        rollout_table(
            sample_ids=["a"],
            prompt_index=[0],
            sample_index=[0],
            prompt_ids=[[1]],
            response_ids=[[2]],
            behavior_logprobs=[[-1.0]],
            policy_version=0,
            finish_reason=["stop"],
            loss_mask=[[1]],
        )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(loss_mask=[[1, 0, 1], None, [1]]), r"row 0 \(sample '.*-0'\) has 3 entries in 'loss_mask' but 4"),
        (dict(turn_index=[[1, 2, 2], None, [1]]), r"row 0 .* has 3 entries in 'turn_index' but 4"),
        (dict(loss_mask=[[1, 0, 0, 2], None, [1]]), r"row 0 .* has loss_mask value 2: the mask holds 0 or 1"),
        (dict(loss_mask=[[1, 0, 0, 1], None, [0]]), r"row 2 .* has no trained token \(its loss_mask is all 0\)"),
        (dict(turn_index=[[1, 2, 1, 3], None, [1]]), r"row 0 .* has a turn_index that is negative or goes back"),
        (dict(turn_index=[[1, 2, 2, 3], None, [-1]]), r"row 2 .* has a turn_index that is negative"),
        (
            dict(logprobs=[[-0.5, -0.1, 0.0, -1.5], [-0.25, -0.75], [-2.0]]),
            r"row 0 .* has a behavior log-prob other than 0.0 where loss_mask is 0",
        ),
        (dict(turn_index=[[1, 2, 2, 3], [0, 0], [1]]), r"row 1 .* has a 'turn_index' but no 'loss_mask'"),
    ],
)
def test_bad_multi_turn_rows_are_refused_on_write_naming_the_row(local_store, change, message):
    with pytest.raises(ShardError, match=message):
        write_shard(local_store, layout.rollout_path(SHARD), multi_turn_table(**change), meta())
    assert not local_store.exists(layout.rollout_path(SHARD))


def test_a_column_without_its_partner_is_refused(local_store):
    table = multi_turn_table().drop_columns(["turn_index"])
    with pytest.raises(ShardError, match=r"column 'loss_mask' without 'turn_index'"):
        write_shard(local_store, layout.rollout_path(SHARD), table, meta())


def _write_raw(store: Store, table: pa.Table, shard_meta: ShardMeta) -> str:
    """A shard written without write_shard's validation (what an older or foreign writer could leave)."""
    rel = layout.rollout_path(SHARD)
    table = table.replace_schema_metadata(shard_meta.to_metadata())
    store.write_atomic(rel, lambda out: pa.ipc.new_stream(out, table.schema).write_table(table))
    return rel


def test_version_1_shards_read_and_version_1_with_new_columns_is_refused(local_store):
    single = multi_turn_table().drop_columns(["loss_mask", "turn_index"])
    rel = _write_raw(local_store, single, meta(version=1))
    table, read_meta = read_shard(local_store, rel, kind=ROLLOUT)
    assert read_meta.schema_version == 1 and table.num_rows == 3
    _write_raw(local_store, multi_turn_table(), meta(version=1))
    with pytest.raises(ShardError, match=r"schema version 1 shard with column 'loss_mask', which only version 2"):
        read_shard(local_store, rel, kind=ROLLOUT)


def test_newer_and_unknown_schema_versions_are_refused_by_name(local_store):
    rel = _write_raw(local_store, multi_turn_table(), meta(version=3))
    with pytest.raises(
        ShardError, match=r"schema version 3, this opd_cache reads version 1 or 2 \(written by a newer opd_cache"
    ):
        read_shard(local_store, rel)
    _write_raw(local_store, multi_turn_table(), meta(version=0))
    with pytest.raises(ShardError, match=r"schema version 0, this opd_cache reads version 1 or 2$"):
        read_shard(local_store, rel)


@pytest.mark.parametrize("version", [1, 2])
def test_the_stored_version_1_shards_still_read(version):
    """tests/data/codec_v*: annotated parts written by schema version 1 (codec versions 1 and 2)."""
    store = Store(REPO / f"tests/data/codec_v{version}")
    for name in ("plain.arrow", "packed.arrow"):
        table, read_meta = read_shard(store, name)
        assert read_meta.schema_version == 1 and table.num_rows > 0


def test_exclusive_write_refuses_to_replace_a_shard(local_store):
    rel = layout.rollout_path(SHARD)
    write_shard(local_store, rel, multi_turn_table(), meta(), exclusive=True)
    before = local_store.read_bytes(rel)
    with pytest.raises(ShardError, match=r"already exists: another writer published a shard with this id"):
        write_shard(local_store, rel, multi_turn_table(), meta(), exclusive=True)
    assert local_store.read_bytes(rel) == before
    read_shard(local_store, rel)  # still intact, checksum included
    assert not [p for p in Path(local_store.path("rollouts")).rglob("*") if ".tmp-" in p.name]


def test_trained_mask_lines_up_across_chunks():
    """Masks of rows in several record batches (a table read from a multi-batch stream) still line up."""
    table = pa.concat_tables([multi_turn_table(), multi_turn_table()])
    assert table["loss_mask"].num_chunks == 2
    expected = [True, False, False, True, True, True, True]
    assert trained_mask(table).tolist() == expected * 2
    assert np.count_nonzero(trained_mask(table)) == 10
