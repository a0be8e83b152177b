"""A store written by the release before the layout refactor and schema version 2 still reads.

tests/data/release_1d611de/ was written by commit 1d611de (tests/data/make_release_store.py): schema version 1,
no loss_mask, turn_index or target_flags columns, the flat module layout's writers. Today's readers must list it,
validate it, and hand the trainer the same rows it held.
"""

from __future__ import annotations

import shutil

import numpy as np

from opd_cache.storage import layout
from opd_cache.storage.schema import ANNOTATED, READABLE_SCHEMA_VERSIONS, ROLLOUT, SCHEMA_VERSION, read_shard
from opd_cache.storage.store import Store
from opd_cache.train.shard_data import load_shard
from tests.conftest import REPO

FIXTURE = REPO / "tests/data/release_1d611de"
SHARDS = ["v000000-w00-000000", "v000000-w00-000001"]


def open_copy(tmp_path) -> Store:
    """The fixture in a scratch folder: nothing a reader does may change the committed files."""
    shutil.copytree(FIXTURE, tmp_path / "store")
    return Store(tmp_path / "store")


def test_a_store_of_the_previous_release_lists_and_validates(tmp_path):
    store = open_copy(tmp_path)
    run = store.manifest.read()
    assert (run.tokenizer_fingerprint, run.vocab_size, run.top_k) == ("fp-release", 64, 4)
    shards, parts = store.shards.dataset()
    assert [s.shard_id for s in shards] == SHARDS
    assert all(parts[s] == {"teacher"} for s in SHARDS)
    for shard_id in SHARDS:
        rollout, meta = read_shard(store, layout.rollout_path(shard_id), kind=ROLLOUT, run=run)
        assert meta.schema_version == 1 != SCHEMA_VERSION and 1 in READABLE_SCHEMA_VERSIONS
        assert "loss_mask" not in rollout.schema.names  # written before multi-turn rows existed
        part, _ = read_shard(store, layout.annotated_path(shard_id, "teacher"), kind=ANNOTATED, run=run)
        assert "target_flags" not in part.schema.names  # and before cross-tokenizer targets


def test_a_store_of_the_previous_release_gets_its_bells_from_the_first_waiter(tmp_path):
    """The layout's one addition since (storage/bells.py): an older store has no bells/; a stage that waits on
    it makes the folder, and today's writes to the store then wake it."""
    assert not (FIXTURE / layout.BELLS).exists()
    store = open_copy(tmp_path)
    bell = store.bell(layout.ROLLOUTS)
    assert (tmp_path / "store" / layout.BELLS).is_dir()
    shard = layout.rollout_path(SHARDS[0])
    store.write_bytes(layout.rollout_path("v000001-w00-000000"), store.read_bytes(shard))
    assert bell.changed()


def test_the_trainer_reads_every_row_and_token_of_the_previous_release(tmp_path):
    store = open_copy(tmp_path)
    run = store.manifest.read()
    for shard_id in SHARDS:
        rollout, _ = read_shard(store, layout.rollout_path(shard_id), kind=ROLLOUT, run=run)
        part, _ = read_shard(store, layout.annotated_path(shard_id, "teacher"), kind=ANNOTATED, run=run)
        data = load_shard(store, run, shard_id, ["teacher"], need_support=shard_id.endswith("1"))
        responses = rollout["response_ids"].combine_chunks()
        assert data.trained is None and data.target_flags is None  # every token trained, same-tokenizer targets
        np.testing.assert_array_equal(data.response_lengths, np.diff(responses.offsets.to_numpy()))
        token_lp = part["teacher_token_logprob"].combine_chunks().values.to_numpy()
        np.testing.assert_array_equal(data.token_logprob, token_lp)
        assert len(data.token_logprob) == len(responses.values)
