"""Retention (opd_cache/storage/retention.py): newest K versions + held ones + LATEST, newest N states, crash-safe deletion."""

from __future__ import annotations

import json
import time

import pytest

from opd_cache.rollout.policy import PolicyFiles
from opd_cache.storage import layout
from opd_cache.storage.integrity import MANIFEST
from opd_cache.storage.retention import (
    VersionHold,
    live_holds,
    prune_policy_versions,
    prune_states,
    retention_pass,
)
from opd_cache.storage.store import COMPLETE_MARKER, Store
from opd_cache.train.checkpoint import complete_states


def publish_fake_version(store: Store, version: int, tmp_path, *, point_latest: bool = True) -> None:
    """A policy folder with one weights-like file (retention looks only at folders and markers)."""
    folder = tmp_path / f"src-v{version}"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes([version % 256]) * 1000)
    (folder / "config.json").write_text("{}")
    store.publish_policy(version, folder, point_latest=point_latest)


def fake_state(store: Store, step: int, *, complete: bool = True) -> None:
    rel = f"train/state/step-{step:06d}"
    store.write_bytes(f"{rel}/__0_0.distcp", b"x" * 100)
    store.write_bytes(f"{rel}/trainer.json", json.dumps({"step": step}).encode())
    if complete:
        store.write_bytes(f"{rel}/{COMPLETE_MARKER}", f"{step}\n".encode())


def folders(store: Store, root: str) -> list[str]:
    return store.list_dirs(root)


def test_keeps_the_newest_k_versions_and_latest(local_store, tmp_path):
    for v in range(1, 7):
        publish_fake_version(local_store, v, tmp_path)
    assert prune_policy_versions(local_store, keep=3) == [1, 2, 3]
    assert local_store.policy_versions() == [4, 5, 6]
    assert folders(local_store, "policy") == ["v000004", "v000005", "v000006"]  # files gone too
    assert local_store.latest_version() == 6
    assert prune_policy_versions(local_store, keep=3) == []  # nothing left to do
    assert prune_policy_versions(local_store, keep=1) == [4, 5]
    assert local_store.policy_versions() == [6]


def test_a_version_above_latest_is_a_publication_in_progress_and_stays(local_store, tmp_path):
    for v in range(1, 5):
        publish_fake_version(local_store, v, tmp_path)
    publish_fake_version(local_store, 5, tmp_path, point_latest=False)  # complete, LATEST not yet moved
    assert local_store.latest_version() == 4
    assert prune_policy_versions(local_store, keep=1) == [1, 2, 3]
    assert local_store.policy_versions() == [4, 5]


def test_live_holds_pin_versions_and_expired_ones_do_not(local_store, tmp_path):
    for v in range(1, 9):
        publish_fake_version(local_store, v, tmp_path)
    rollout = VersionHold(local_store, "rollout-w01", ttl_s=60)
    rollout.hold(2)
    evaluator = VersionHold(local_store, "eval-0", ttl_s=60)
    evaluator.hold(3, every=2)  # version 3 and every even version from 3 on
    # a worker that died long ago: its hold expired
    local_store.write_json(
        layout.holder_path("rollout-dead"), {"versions": [1], "every": None, "expires": time.time() - 1}
    )
    assert sorted(h["versions"] for h in live_holds(local_store)) == [[2], [3]]  # rollout-w01, eval-0
    assert prune_policy_versions(local_store, keep=2) == [1, 5]
    assert local_store.policy_versions() == [2, 3, 4, 6, 7, 8]

    rollout.hold(8)  # the worker reloaded: version 2 is free
    rollout_record = local_store.read_json(layout.holder_path("rollout-w01"))
    assert rollout_record["versions"] == [8] and rollout_record["expires"] > time.time() + 50
    evaluator.release()  # the evaluator finished
    assert not local_store.exists(layout.holder_path("eval-0"))
    assert prune_policy_versions(local_store, keep=2) == [2, 3, 4, 6]
    assert local_store.policy_versions() == [7, 8]


def test_hold_is_rewritten_only_when_it_changes_or_its_renewal_is_due(local_store, monkeypatch):
    hold = VersionHold(local_store, "rollout-w01", ttl_s=30)
    hold.hold(4)
    first = local_store.read_json(layout.holder_path("rollout-w01"))["time"]
    time.sleep(0.01)
    hold.hold(4)
    hold.renew()
    assert local_store.read_json(layout.holder_path("rollout-w01"))["time"] == first  # not due: no write
    hold.written -= 11  # a third of the 30 s lifetime has passed
    hold.renew()
    assert local_store.read_json(layout.holder_path("rollout-w01"))["time"] > first


def test_a_started_hold_is_renewed_by_its_thread_while_its_owner_is_blocked(local_store):
    """A rollout worker inside one generate() call longer than the hold's lifetime: the thread rewrites the record
    (its expiry moves on), with the versions last held; release stops the thread and frees them."""
    hold = VersionHold(local_store, "rollout-w01", ttl_s=0.3).start()  # renewed every 0.1 s
    try:
        hold.hold(5)
        first = local_store.read_json(layout.holder_path("rollout-w01"))
        assert hold.keepalive.wait_renewals(3, timeout=600), "the thread renewed nothing"
        renewed = local_store.read_json(layout.holder_path("rollout-w01"))
        assert renewed["versions"] == [5] and renewed["expires"] > first["expires"]
        hold.hold(6)  # the owner moved on: the thread's next rewrite carries 6, never the older 5 again
        count = hold.keepalive.renewals
        assert hold.keepalive.wait_renewals(count + 2, timeout=600)
        assert local_store.read_json(layout.holder_path("rollout-w01"))["versions"] == [6]
    finally:
        hold.release()
    count = hold.keepalive.renewals
    assert not local_store.exists(layout.holder_path("rollout-w01"))
    assert not hold.keepalive.running and hold.keepalive.renewals == count  # stopped: no rewrite after release


def test_a_deletion_cut_short_leaves_a_consistent_store_and_the_next_pass_finishes_it(
    local_store, tmp_path, monkeypatch
):
    for v in range(1, 6):
        publish_fake_version(local_store, v, tmp_path)
    real_delete_dir = Store.delete_dir
    calls = []

    def crash_on_second_folder(self, rel):
        calls.append(rel)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-deletion")  # like a SIGKILL: nothing after it runs
        real_delete_dir(self, rel)

    monkeypatch.setattr(Store, "delete_dir", crash_on_second_folder)
    with pytest.raises(KeyboardInterrupt):
        prune_policy_versions(local_store, keep=2)
    monkeypatch.setattr(Store, "delete_dir", real_delete_dir)

    # v1 is gone, v2 lost its marker and files but not yet its manifest, v3 is untouched: no reader takes v2
    assert folders(local_store, "policy") == ["v000002", "v000003", "v000004", "v000005"]
    assert [i.base_name for i in local_store.list_files("policy/v000002")] == [MANIFEST]
    problems = local_store.verify_folder("policy/v000002")  # a reader that saw the marker before it went
    assert [(p.name, p.status) for p in problems] == [("config.json", "missing"), ("model.safetensors", "missing")]
    assert local_store.policy_versions() == [3, 4, 5]
    assert local_store.policy_versions(after=1) == [3, 4, 5]
    assert local_store.latest_version() == 5
    policies = PolicyFiles(local_store, "the-student")
    assert policies.newest_intact(2) == (0, "the-student")  # rollout falls back past it to the student

    assert prune_policy_versions(local_store, keep=2) == [2, 3]
    assert folders(local_store, "policy") == ["v000004", "v000005"]


def test_keeps_the_newest_n_resume_states_and_finishes_a_cut_short_deletion(local_store, monkeypatch):
    for step in (10, 20, 30, 40):
        fake_state(local_store, step)
    fake_state(local_store, 50, complete=False)  # an upload in progress (object store): newer, so it stays
    real_delete_dir = Store.delete_dir

    def crash(self, rel):
        raise KeyboardInterrupt("killed mid-deletion")

    monkeypatch.setattr(Store, "delete_dir", crash)
    with pytest.raises(KeyboardInterrupt):
        prune_states(local_store, keep=2)
    monkeypatch.setattr(Store, "delete_dir", real_delete_dir)
    assert complete_states(local_store) == [20, 30, 40]  # step 10 lost its marker first: never loaded
    assert folders(local_store, "train/state") == [f"step-0000{s}" for s in (10, 20, 30, 40, 50)]

    assert prune_states(local_store, keep=2) == [10, 20]
    assert complete_states(local_store) == [30, 40]
    assert folders(local_store, "train/state") == ["step-000030", "step-000040", "step-000050"]


def test_retention_pass_with_keep_versions_none_keeps_every_version(local_store, tmp_path):
    for v in range(1, 5):
        publish_fake_version(local_store, v, tmp_path)
    fake_state(local_store, 1)
    fake_state(local_store, 2)
    fake_state(local_store, 3)
    assert retention_pass(local_store, None, 2) == {"versions": [], "states": [1]}
    assert local_store.policy_versions() == [1, 2, 3, 4]


def test_retention_on_s3(s3_store, tmp_path):
    for v in range(1, 5):
        publish_fake_version(s3_store, v, tmp_path)
    VersionHold(s3_store, "rollout-w01", ttl_s=60).hold(1)
    assert prune_policy_versions(s3_store, keep=2) == [2]
    assert s3_store.policy_versions() == [1, 3, 4]
    assert s3_store.list_files("policy/v000002") == []
