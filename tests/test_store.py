"""The shared store: layout, atomic publish (also under SIGKILL), run manifest, LATEST, quarantine.

Every storage test runs twice: on a local directory and on an S3-compatible
server (moto) started on 127.0.0.1 by the fixture.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from opd_cache.storage import layout
from opd_cache.storage.store import Store, StoreError, make_shard_id, parse_shard_id, validate_name
from tests.conftest import write_random_rollout_shard


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store(tmp_path / "store")
    return request.getfixturevalue("s3_store")


def test_shard_ids_sort_by_version_and_parse_back():
    ids = [make_shard_id(3, "w02", 117), make_shard_id(1, "w10", 5), make_shard_id(3, "w02", 9)]
    assert sorted(ids) == ["v000001-w10-000005", "v000003-w02-000009", "v000003-w02-000117"]
    assert parse_shard_id("v000003-w02-000117") == (3, "w02", 117)


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", "x" * 65, ".hidden", "a..b"])
def test_names_that_could_escape_the_store_are_refused(bad):
    with pytest.raises(ValueError, match="invalid teacher name"):
        validate_name("teacher name", bad)


def test_bad_shard_id_message():
    with pytest.raises(ValueError, match=r"invalid shard id 'v1-w0-1': expected v<6 digits>-<worker>-<6 digits>"):
        parse_shard_id("v1-w0-1")
    with pytest.raises(ValueError, match="invalid worker id 'w-1'"):
        make_shard_id(0, "w-1", 0)


def test_small_files_round_trip_and_listing_ignores_tmp(store):
    store.write_json("train/progress.json", {"step": 3})
    assert store.read_progress() == {"step": 3}
    store.write_bytes("rollouts/v000000/v000000-w00-000000.arrow.tmp-abc", b"partial")
    write_random_rollout_shard(store, shard_id="v000001-w00-000000")
    write_random_rollout_shard(store, shard_id="v000000-w01-000003")
    shards = store.shards.rollouts()
    assert [s.shard_id for s in shards] == ["v000000-w01-000003", "v000001-w00-000000"]
    assert (shards[0].policy_version, shards[0].worker, shards[0].seq) == (0, "w01", 3)
    assert store.read_json("missing.json", default="d") == "d"


def test_run_manifest_created_once_then_checked(store):
    run = store.manifest.ensure(student="models/student", tokenizer_fingerprint="abc")
    again = store.manifest.ensure(student="models/student", tokenizer_fingerprint="abc", top_k=8)
    assert again["run_id"] == run["run_id"] and again["top_k"] == 8
    assert store.manifest.ensure()["top_k"] == 8  # later stages default to recorded values
    with pytest.raises(StoreError, match=r"top_k is 8 in this store but 32 was given"):
        store.manifest.ensure(top_k=32)
    with pytest.raises(StoreError, match=r"tokenizer_fingerprint is 'abc' in this store but 'zzz' was given"):
        store.manifest.ensure(tokenizer_fingerprint="zzz")


def test_require_run_on_empty_store(store):
    # a local path that does not exist is a typo until a rollout creates it; an object store has no folders
    message = (
        r"store .*store does not exist \(no such folder\): check the path; `opd rollout` creates a new store"
        if store.is_local
        else r"run.json does not exist: check the URI, or run `opd rollout` on this store first"
    )
    with pytest.raises(StoreError, match=message):
        store.manifest.require()
    if store.is_local:
        Path(store.root).mkdir(parents=True)
        with pytest.raises(StoreError, match=r"store holds no run \(run.json is missing\): not a store, or one whose"):
            store.manifest.require()


def test_latest_version_and_publish(store, tmp_path):
    assert store.latest_version() == 0
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\0" * 100)
    store.publish_policy(1, ckpt)
    store.publish_policy(2, ckpt)
    assert store.latest_version() == 2
    assert store.policy_versions() == [1, 2]
    assert store.exists("policy/v000002/model.safetensors")


@pytest.mark.parametrize(
    "latest, message",
    [
        (b"7\n", r"points at version 7 but .*policy/v000007 is missing or incomplete"),
        (b"seven", r"holds 'seven', expected a version number"),
    ],
)
def test_latest_pointing_at_missing_version_is_reported(store, latest, message):
    store.write_bytes("policy/LATEST", latest)
    with pytest.raises(StoreError, match=message):
        store.latest_version()


def test_quarantine_moves_file_with_reason(store):
    write_random_rollout_shard(store, shard_id="v000000-w00-000000")
    dest = store.quarantine("rollouts/v000000/v000000-w00-000000.arrow", "truncated")
    assert not store.exists("rollouts/v000000/v000000-w00-000000.arrow")
    assert store.exists(dest)
    assert store.list_quarantine() == {
        "rollouts__v000000__v000000-w00-000000.arrow": "rollouts/v000000/v000000-w00-000000.arrow: truncated"
    }
    assert store.shards.rollouts() == []
    assert dest == layout.quarantine_path("rollouts/v000000/v000000-w00-000000.arrow")


def test_quarantined_rollout_shards_are_found_in_either_layout(store):
    """Rollout resumes past its quarantined seqs, pacing leaves their rows out: both read them from one LIST."""
    for shard_id, rel in (
        ("v000002-w__1-000007", None),  # worker ids may hold "__", the separator of quarantined names
        ("v000000-w00-000003", "rollouts/v000000-w00-000003.arrow"),  # the flat layout of earlier versions
    ):
        rel = rel or layout.rollout_path(shard_id)
        store.write_bytes(rel, b"damaged")
        store.quarantine(rel, "corrupt")
    store.write_bytes(layout.annotated_path("v000001-w00-000000", "teacher"), b"x")
    store.quarantine(layout.annotated_path("v000001-w00-000000", "teacher"), "corrupt")  # a part: not a shard
    found = store.quarantined_rollouts()
    assert [(s.shard_id, s.worker, s.seq) for s in found] == [
        ("v000000-w00-000003", "w00", 3),
        ("v000002-w__1-000007", "w__1", 7),
    ]
    assert all(store.exists(s.path) for s in found)


def test_done_marker(store):
    assert not store.is_done()
    store.mark_done()
    assert store.is_done()
    store.clear_done()
    assert not store.is_done()


def test_the_trainer_and_metrics_paths_come_from_the_store(store):
    assert layout.skipped_path("v000001-w00-000002") == "train/skipped/v000001-w00-000002.jsonl"
    with pytest.raises(ValueError, match="invalid shard id"):
        layout.skipped_path("../x")
    assert layout.metrics_path("train-0") == "metrics/train-0.jsonl"
    assert layout.metrics_path("train-0", "00000001.jsonl") == "metrics/train-0/00000001.jsonl"
    assert layout.flat_rollout_path("v000001-w00-000002") == "rollouts/v000001-w00-000002.arrow"
    assert layout.flat_annotated_path("v000001-w00-000002", "t") == "annotated/v000001-w00-000002/t.arrow"
    assert not store.manifest.exists()
    store.manifest.ensure(student="s")
    assert store.manifest.exists()


def test_read_only_store_is_reported(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions; the read-only case is covered where tests run as a user")
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    with pytest.raises(StoreError, match="is not writable"):
        Store(root).write_json("train/progress.json", {})


def test_unreachable_s3_store_is_reported(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    store = Store("s3://bucket/run", s3_endpoint="http://127.0.0.1:9")  # nothing listens on port 9
    with pytest.raises(StoreError, match=r"cannot read bucket/run/run.json: .*(Could not connect|NETWORK_CONNECTION)"):
        store.manifest.read()


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from opd_cache.storage.store import Store
    store = Store(sys.argv[1], s3_endpoint=sys.argv[2] or None)  # the endpoint as store.s3_endpoint passes it
    chunk = np.random.default_rng(0).bytes(1 << 20)
    def write(out):
        print("writing", flush=True)
        for _ in range(100000):  # far more than the parent lets it finish
            out.write(chunk)
    store.write_atomic("rollouts/v000000/v000000-w00-000000.arrow", write)
    """
)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sigkill_mid_write_leaves_no_visible_file(backend, tmp_path, request):
    if backend == "local":
        uri, endpoint, env = str(tmp_path / "store"), "", dict(os.environ)
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        store = request.getfixturevalue("s3_store")
        uri = store.uri
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    proc = subprocess.Popen([sys.executable, "-c", WRITER, uri, endpoint], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"writing"
    time.sleep(1.0)  # let it write many MB (local) / start a multipart upload (s3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    store = Store(uri, s3_endpoint=endpoint or None)
    assert not store.exists("rollouts/v000000/v000000-w00-000000.arrow")
    assert store.shards.rollouts() == []
    # a later write of the same name succeeds and is complete
    write_random_rollout_shard(store, shard_id="v000000-w00-000000")
    assert [s.shard_id for s in store.shards.rollouts()] == ["v000000-w00-000000"]


def test_create_if_absent_keeps_first_writer(tmp_path):
    store = Store(tmp_path)
    assert store.create_if_absent("run.json", b'{"run_id": "a"}')
    assert not store.create_if_absent("run.json", b'{"run_id": "b"}')
    assert json.loads(store.read_bytes("run.json"))["run_id"] == "a"


def test_stale_tmp_files_of_killed_writers_are_swept_fresh_ones_kept(tmp_path):
    store = Store(tmp_path / "store")
    write_random_rollout_shard(store, shard_id="v000000-w00-000000")
    root = tmp_path / "store"
    # what killed writers leave: a shard file, an annotated part, a policy folder, a resume-state folder
    old = [
        root / "rollouts/v000000/v000000-w00-000001.arrow.tmp-0a1b2c",
        root / "annotated/v000000/v000000-w00-000000/t.arrow.tmp-3d4e",
        root / "policy/v000002.tmp-5f6a",
        root / "train/state/step-000010.tmp-save",
    ]
    fresh = root / "rollouts/v000000/v000000-w00-000002.arrow.tmp-7b8c"  # a writer still at work
    for path in old[:2] + [fresh]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    for folder in old[2:]:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    for path in old:
        os.utime(path, (two_hours_ago, two_hours_ago))

    removed = store.remove_stale_tmp(older_than_s=3600)

    assert sorted(removed) == sorted(str(p.relative_to(root)) for p in old)
    assert not any(p.exists() for p in old)
    assert fresh.exists()
    assert [s.shard_id for s in store.shards.rollouts()] == ["v000000-w00-000000"]
    assert store.remove_stale_tmp(older_than_s=3600) == []


def test_sweeping_an_object_store_is_a_no_op(s3_store):
    assert s3_store.remove_stale_tmp(older_than_s=0) == []
