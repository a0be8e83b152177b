"""Polling lists the live window of policy versions, not the run's history (version partitions, ShardWatch).

Where only listing matters, shards are empty placeholder files (a listing never reads them); where a stage
reads them (the trainer expiring a shard, the backlog gauge counting rows), they are real.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from opd_cache.annotate import Annotator
from opd_cache.cli import app
from opd_cache.config import AnnotateConfig, Config
from opd_cache.rollout.pacing import BacklogGauge
from opd_cache.storage import layout
from opd_cache.storage.store import COMPLETE_MARKER, ShardTally, ShardWatch, Store, StoreError, make_shard_id
from opd_cache.testing import CountingFileSystem, write_synthetic_shard
from opd_cache.tokenizer import tokenizer_fingerprint
from opd_cache.train.shard_data import ShardCache
from opd_cache.train.stream import ShardStream, StreamEnd
from tests.test_train_stream import make_stream

WORKERS = ("w00", "w01", "w02", "w03")


def placeholder(store: Store, rel: str) -> None:
    path = store.local_path(rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def placeholder_store(root, versions: int, *, annotated_until: int | None = None) -> tuple[Store, list[str]]:
    """`versions` partitions of one shard per worker; parts for the shards of versions < annotated_until."""
    store = Store(root)
    ids = []
    for version in range(versions):
        for worker in WORKERS:
            shard_id = make_shard_id(version, worker, version)
            placeholder(store, layout.rollout_path(shard_id))
            if annotated_until is not None and version < annotated_until:
                placeholder(store, layout.annotated_path(shard_id, "teacher"))
            ids.append(shard_id)
    publish_placeholder_version(store, versions - 1)
    return store, ids


def publish_placeholder_version(store: Store, version: int) -> None:
    if version > 0:
        placeholder(store, f"{layout.policy_dir(version)}/{COMPLETE_MARKER}")
    store.write_bytes("policy/LATEST", f"{version}\n".encode())


def ids_of(shards) -> set[str]:
    return {s.shard_id for s in shards}


def in_versions(ids, versions) -> set[str]:
    return {i for i in ids if int(i[1:7]) in set(versions)}


# ---------------------------------------------------------------- layout and full listings
def test_paths_name_the_version_partition_and_full_listings_find_every_shard(tmp_path):
    store, ids = placeholder_store(tmp_path / "s", versions=30, annotated_until=30)
    assert layout.rollout_path("v000007-w02-000117") == "rollouts/v000007/v000007-w02-000117.arrow"
    assert layout.annotated_path("v000007-w02-000117", "t") == "annotated/v000007/v000007-w02-000117/t.arrow"
    assert [s.shard_id for s in store.shards.rollouts()] == sorted(ids)  # replay/export/inspect/verify
    assert store.shards.annotated_parts() == {i: {"teacher"} for i in ids}
    assert ids_of(store.shards.rollouts([3, 4])) == in_versions(ids, [3, 4])
    assert set(store.shards.annotated_parts(range(28, 31))) == in_versions(ids, [28, 29])
    # a shard filed under another version's partition is not that version's shard
    placeholder(store, "rollouts/v000001/v000002-w00-000099.arrow")
    assert "v000002-w00-000099" not in ids_of(store.shards.rollouts())


def test_flat_layout_of_earlier_versions_is_read_refused_by_stages_and_migrated(tmp_path):
    store = Store(tmp_path / "old")
    store.manifest.ensure(student="student", tokenizer_fingerprint="fp")
    flat = [make_shard_id(v, "w00", v) for v in range(3)]
    for shard_id in flat:  # what opd_cache wrote before version partitions
        store.write_bytes(f"rollouts/{shard_id}.arrow", shard_id.encode())
        store.write_bytes(f"annotated/{shard_id}/teacher.arrow", b"part " + shard_id.encode())
    assert [s.path for s in store.shards.rollouts()] == [f"rollouts/{i}.arrow" for i in flat]
    assert store.shards.annotated_parts() == {i: {"teacher"} for i in flat}
    with pytest.raises(StoreError) as refused:
        ShardWatch(store).poll(0, 2)
    assert str(refused.value) == (
        f"{store.path('rollouts/v000000-w00-000000.arrow')} and 2 more shards are in the flat layout of earlier "
        f"opd_cache versions (rollouts/<shard>.arrow); run `opd migrate {store.uri}` once, with no stage "
        f"running"
    )

    runner = CliRunner()
    dry = runner.invoke(app, ["migrate", "--store", store.uri, "--dry-run"])
    assert dry.exit_code == 0 and f"{store.uri}: 6 files to move into version partitions" in dry.output
    result = runner.invoke(app, ["migrate", "--store", store.uri])
    assert result.exit_code == 0, result.output
    assert f"{store.uri}: moved 6 files into version partitions" in result.output
    assert [s.path for s in store.shards.rollouts()] == [layout.rollout_path(i) for i in flat]
    assert all(store.read_bytes(layout.rollout_path(i)) == i.encode() for i in flat)
    assert all(store.read_bytes(layout.annotated_path(i, "teacher")) == b"part " + i.encode() for i in flat)
    assert sorted(os.listdir(store.local_path("annotated"))) == ["v000000", "v000001", "v000002"]
    assert ids_of(ShardWatch(store).poll(0, 2)) == set(flat)
    again = runner.invoke(app, ["migrate", "--store", store.uri])
    assert "0 files to move into version partitions (the store is already in the partitioned layout)" in again.output


# ---------------------------------------------------------------- what one poll lists
def test_watch_lists_the_window_the_partitions_leaving_it_and_one_old_partition(tmp_path):
    store, ids = placeholder_store(tmp_path / "s", versions=300, annotated_until=299)  # 1,200 shards
    watch = ShardWatch(store, parts=True)
    assert ids_of(watch.poll(297, 299)) == set(ids)  # the first poll catches up on everything
    assert set(watch.parts) == in_versions(ids, range(299))

    assert ids_of(watch.poll(297, 299)) == in_versions(ids, [0, 297, 298, 299])  # window + sweep of v0
    assert set(watch.parts) == in_versions(ids, [0, 297, 298])
    assert ids_of(watch.poll(297, 299)) == in_versions(ids, [1, 297, 298, 299])  # the sweep moves on

    new = [make_shard_id(300, w, 300) for w in WORKERS] + [make_shard_id(301, "w00", 301)]
    for shard_id in new:
        placeholder(store, layout.rollout_path(shard_id))
    # the window moved by two: 297 and 298 get their last listing, then only 299..301 (+ the sweep)
    assert ids_of(watch.poll(299, 301)) == in_versions(ids, [2, 297, 298, 299]) | set(new)
    assert ids_of(watch.poll(299, 301)) == in_versions(ids, [3, 299]) | set(new)
    sweeps = [min(int(s.shard_id[1:7]) for s in watch.poll(299, 301)) for _ in range(400)]
    assert set(sweeps) == set(range(299))  # every old partition comes round, oldest first, then again


def count_poll(store: Store, poll) -> Counter:
    counting = CountingFileSystem(store.fs)
    store.fs = counting
    try:
        poll()
    finally:
        store.fs = counting.fs
    return counting.requests


@pytest.mark.parametrize("stage", ["trainer", "annotate", "rollout"])
def test_a_polls_requests_do_not_grow_with_versions_outside_the_window(tmp_path, stage, tiny_model_factory, tokenizer):
    """The same window over 20 and over 500 versions of history costs the same LIST/HEAD/GET requests."""
    costs = {}
    for versions in (20, 500):
        store, _ = placeholder_store(tmp_path / f"s{versions}", versions, annotated_until=versions - 1)
        store.manifest.ensure(
            student="student",
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            vocab_size=len(tokenizer),
            top_k=4,
        )
        latest = versions - 1
        if stage == "trainer":
            stream = ShardStream(
                store,
                store.manifest.read(),
                ShardCache(store, store.manifest.read(), ["teacher"]),
                max_staleness=2,
                batch_samples=4,
                batch_tokens=None,
            )
            poll = lambda: stream.refresh(latest)  # noqa: E731
        elif stage == "annotate":
            annotator = Annotator(
                Config(max_staleness=2, annotate=AnnotateConfig(teacher=str(tiny_model_factory("teacher")), top_k=4)),
                store,
                scorer=object(),
            )
            poll = annotator.selection.pending
        else:
            gauge = BacklogGauge(store, window=2)
            poll = gauge.backlog
        first = count_poll(store, poll)
        assert first["LIST"] >= 1
        polls = [count_poll(store, poll) for _ in range(5)]
        assert all(p == polls[0] for p in polls), polls
        costs[versions] = polls[0]
    assert costs[500] == costs[20], costs
    per_prefix = 3 + 1 if stage == "rollout" else 2 * (3 + 1)  # window of 3 + 1 sweep; with parts, twice
    if stage == "annotate":
        per_prefix += 1  # the teacher's lease folder (annotate/leases.py): one LIST, whatever the history
    assert costs[500]["LIST"] == per_prefix, costs


# ---------------------------------------------------------------- each stage finds exactly what it should
def test_trainer_trains_the_window_expires_the_rest_and_counts_a_shard_published_late(local_store):
    run = local_store.manifest.ensure(
        student="student", tokenizer_fingerprint="fp-test", vocab_size=32, top_k=4, teachers={"teacher": "t"}
    )

    def shard(version, seq, worker="w00"):
        shard_id = make_shard_id(version, worker, seq)
        write_synthetic_shard(local_store, run, shard_id, num_rows=4, vocab_size=32, top_k=4, seed=seq)
        return shard_id

    history = [shard(v, v) for v in range(12)]
    publish = lambda v: local_store.write_bytes("policy/LATEST", f"{v}\n".encode())  # noqa: E731
    for v in range(1, 12):
        local_store.write_bytes(f"policy/v{v:06d}/{COMPLETE_MARKER}", b"")
    publish(11)
    stream, _ = make_stream(local_store, run, max_staleness=1, follow=True, poll_seconds=0.001, idle_timeout=0.3)
    trained = []
    for step in (1, 2):
        batch = stream.next_batch(step, 11)
        trained += batch.shard_ids
    assert trained == history[10:]  # versions 10 and 11; 0..9 expired on the first (full) poll
    assert stream.cursor.expired_samples == 40

    late_old = shard(3, 100, worker="w07")  # sampled with version 3, published now: expired, counted
    late_live = shard(10, 101, worker="w07")  # sampled with version 10, published now: still trains
    batch = stream.next_batch(3, 11)
    assert batch.shard_ids == [late_live]
    end = stream.next_batch(4, 11)
    assert isinstance(end, StreamEnd) and end.reason == "no admissible data for 0.3 s (idle timeout)"
    assert stream.cursor.expired_samples == 44 and late_old in stream.cursor.finished
    skipped = [
        json.loads(line) for line in local_store.read_bytes(f"train/skipped/{late_old}.jsonl").decode().splitlines()
    ]
    assert skipped == [{"sample_id": f"{late_old}-{row}", "reason": "expired"} for row in range(4)]


def test_annotate_finds_the_unannotated_shards_of_its_window_and_of_the_sweep(tmp_path, tiny_model_factory, tokenizer):
    store, ids = placeholder_store(tmp_path / "s", versions=60, annotated_until=58)  # 58, 59 unannotated
    store.manifest.ensure(
        student="student", tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=len(tokenizer)
    )
    annotator = Annotator(
        Config(max_staleness=2, annotate=AnnotateConfig(teacher=str(tiny_model_factory("teacher")), top_k=4)),
        store,
        scorer=object(),
    )
    assert ids_of(annotator.selection.pending()) == in_versions(ids, [58, 59])  # first poll: everything listed
    late = make_shard_id(5, "w09", 1)  # published late into version 5, never annotated
    placeholder(store, layout.rollout_path(late))
    for shard_id in in_versions(ids, [58]):
        placeholder(store, layout.annotated_path(shard_id, "teacher"))
    found_at = None
    for poll in range(1, 60):
        pending = ids_of(annotator.selection.pending())
        assert pending - {late} == in_versions(ids, [59]), poll
        if late in pending:
            found_at = poll
    assert found_at == 6  # the sweep lists v0, v1, ... one per poll: the late shard is offered (as stale)


def write_rows(store: Store, rel: str, rows: int) -> None:
    """An Arrow IPC stream with `rows` rows: all the backlog gauge reads of a shard."""
    table = pa.table({"x": list(range(rows))})
    store.write_atomic(rel, lambda out: pa.ipc.new_stream(out, table.schema).write_table(table))


def test_backlog_gauge_counts_new_shards_and_late_ones_without_listing_the_history(tmp_path):
    store = Store(tmp_path / "s")
    for version in range(40):
        write_rows(store, layout.rollout_path(make_shard_id(version, "w00", version)), 3)
    publish_placeholder_version(store, 39)
    store.write_progress({"consumed_samples": 100, "expired_samples": 5})
    gauge = BacklogGauge(store, window=2)
    assert gauge.backlog() == 40 * 3 - 105
    write_rows(store, layout.rollout_path(make_shard_id(39, "w01", 0)), 7)  # in the window: counted at once
    assert gauge.backlog() == 40 * 3 + 7 - 105
    write_rows(store, layout.rollout_path(make_shard_id(20, "w02", 0)), 11)  # late: counted once the sweep gets there
    polls = 0
    while True:
        polls += 1
        if gauge.backlog() == 40 * 3 + 7 + 11 - 105:
            break
        assert polls < 40, "the late shard was never counted"
    assert polls == 20  # the sweep lists v1, v2, ... one per poll (v0 on the poll before)


def test_tally_for_the_dashboard_counts_everything_at_the_cost_of_a_window_poll(tmp_path):
    store, ids = placeholder_store(tmp_path / "s", versions=200, annotated_until=199)
    tally = ShardTally(store, window=2)
    shards, parts = tally.poll()
    assert shards == store.shards.rollouts() and parts == store.shards.annotated_parts()
    new = make_shard_id(199, "w09", 0)
    placeholder(store, layout.rollout_path(new))
    for shard_id in in_versions(ids, [199]):
        placeholder(store, layout.annotated_path(shard_id, "teacher"))
    requests = count_poll(store, tally.poll)
    shards, parts = tally.shards, tally.parts
    assert sorted(shards) == sorted([*ids, new]) and parts == store.shards.annotated_parts()
    assert requests["LIST"] == 2 * (3 + 1) and requests["keys"] < 60, requests  # 4 partitions, not 200
