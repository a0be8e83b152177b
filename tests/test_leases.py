"""Shard leases (opd_cache/annotate/leases.py): claiming, renewal, takeover, and annotate workers that use them.

The lease rules are checked on local and S3 (moto) stores; the workers run the real tiny teacher, and the
frozen-holder test freezes a real `opd annotate` process with SIGSTOP.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from opd_cache.annotate import Annotator
from opd_cache.annotate.leases import LeaseBook
from opd_cache.launch.ray_actor import prepare_stage_process
from opd_cache.observe.metrics import read_metrics
from opd_cache.storage import layout
from opd_cache.storage.schema import ANNOTATED, read_shard
from tests.conftest import REPO
from tests.test_annotate import config, write_shards

SHARD = "v000000-w00-000000"


@pytest.fixture(params=["local", "s3"])
def any_store(request):
    return request.getfixturevalue("local_store" if request.param == "local" else "s3_store")


@pytest.fixture
def store(student_store):
    return student_store  # a local store whose run.json has the shipped tokenizer and a tiny student (conftest.py)


@pytest.fixture
def teacher_path(tiny_model_factory):
    return tiny_model_factory("teacher", seed=1)


def lease_files(store, teacher="teacher"):
    return sorted(info.base_name for info in store.list_files(layout.leases_dir(teacher)))


# ---------------------------------------------------------------- the lease rules
def test_a_live_lease_excludes_others_and_an_expired_one_is_taken_over(any_store):
    a, b = LeaseBook(any_store, "teacher", "a", 0.6), LeaseBook(any_store, "teacher", "b", 0.6)
    lease_a = a.claim(SHARD)
    assert lease_a is not None and lease_a.generation == 0
    b.poll()
    assert b.claim(SHARD) is None  # a's lease is live
    assert lease_a.still_mine()
    time.sleep(0.8)  # a froze: no renewal, the lease expires
    assert not lease_a.still_mine()  # past its expiry a holder must not publish, even before a takeover
    b.poll()
    lease_b = b.claim(SHARD)
    assert lease_b is not None and lease_b.generation == 1
    assert lease_files(any_store) == [f"{SHARD}.000001.json"]  # the superseded generation is deleted
    assert lease_a.superseded() and not lease_a.renew()  # a resumes: it learns it lost the shard
    assert lease_b.still_mine()
    lease_b.release()
    assert lease_files(any_store) == []


def test_two_workers_claiming_at_once_get_the_shard_once(local_store):
    books = [LeaseBook(local_store, "teacher", f"w{i}", 30) for i in range(8)]
    barrier, won = threading.Barrier(len(books)), []

    def claim(book):
        barrier.wait()
        if book.claim(SHARD) is not None:
            won.append(book.worker)

    threads = [threading.Thread(target=claim, args=(book,)) for book in books]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1  # os.link: an atomic create-if-absent


def test_renewal_keeps_a_lease_alive_past_its_expiry(any_store):
    a, b = LeaseBook(any_store, "teacher", "a", 0.6), LeaseBook(any_store, "teacher", "b", 0.6)
    with a.claim(SHARD) as lease:  # renewed every 0.2 s by its thread
        for _ in range(4):
            time.sleep(0.4)
            b.poll()
            assert b.claim(SHARD) is None
        assert lease.renewals >= 4 and lease.still_mine()
    assert lease_files(any_store) == []  # released on exit
    b.poll()
    assert b.claim(SHARD) is not None


def test_a_restarted_worker_reclaims_its_own_lease_at_once(local_store):
    first = LeaseBook(local_store, "teacher", "a", 60).claim(SHARD)  # then the process died
    again = LeaseBook(local_store, "teacher", "a", 60)
    again.poll()
    lease = again.claim(SHARD)
    assert lease is not None and lease.generation == first.generation + 1
    other = LeaseBook(local_store, "teacher", "b", 60)
    other.poll()
    assert other.claim(SHARD) is None


# ---------------------------------------------------------------- annotate workers on leases
def test_three_lease_workers_annotate_every_shard_exactly_once(store, teacher_path):
    shard_ids = write_shards(store, 12, num_rows=4)
    workers = [
        Annotator(config(teacher_path, top_k=4, worker_id=f"a{i}", lease_seconds=10), store, progress=False)
        for i in range(3)
    ]
    threads = [threading.Thread(target=w.run) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    annotated = [s for w in workers for s in w.stats.annotated]
    assert sorted(annotated) == shard_ids  # each shard by exactly one worker
    assert sum(1 for w in workers if w.stats.annotated) >= 2  # the work was shared
    assert store.shards.annotated_parts() == {s: {"teacher"} for s in shard_ids}
    assert lease_files(store) == []


def test_static_split_still_takes_no_leases(store, teacher_path):
    write_shards(store, 4, num_rows=2)
    stats = [
        Annotator(config(teacher_path, top_k=4, worker_index=i, num_workers=2), store, progress=False).run()
        for i in (0, 1)
    ]
    assert len(stats[0].annotated) + len(stats[1].annotated) == 4
    assert not store.exists(layout.LEASES)


FROZEN_WORKER = """
import sys, time
from opd_cache.annotate import Annotator
from opd_cache.config import AnnotateConfig, Config
from opd_cache.storage.store import Store

cfg = Config(annotate=AnnotateConfig(teacher=sys.argv[2], top_k=4, worker_id="frozen", lease_seconds=float(sys.argv[3])))
store = Store(sys.argv[1])
annotator = Annotator(cfg, store, progress=False)
score = annotator.scorer.score
def slow_score(*args):  # a slow teacher: the test freezes this process while it scores
    time.sleep(1.0)
    return score(*args)
annotator.scorer.score = slow_score
stats = annotator.run()
print("annotated", len(stats.annotated))
"""


def start_slow_holder(store, teacher_path, lease_seconds: float) -> subprocess.Popen:
    """An annotate worker in its own process (FROZEN_WORKER: a teacher call takes 1 s), to stop or interrupt."""
    return subprocess.Popen(
        [sys.executable, "-c", FROZEN_WORKER, store.uri, str(teacher_path), str(lease_seconds)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # a stage process's start (Ctrl-C works whatever signals the test process blocks or ignores)
        preexec_fn=prepare_stage_process,
    )


def wait_for_its_first_lease(proc: subprocess.Popen, store) -> None:
    deadline = time.time() + 120
    while not lease_files(store) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)


def test_a_frozen_lease_holder_is_taken_over_and_its_late_result_is_dropped(store, teacher_path):
    shard_ids = write_shards(store, 3, num_rows=4)
    lease_seconds = 1.5
    proc = start_slow_holder(store, teacher_path, lease_seconds)
    try:
        wait_for_its_first_lease(proc, store)
        os.kill(proc.pid, signal.SIGSTOP)  # frozen while it scores its first shard
        assert lease_files(store) == [f"{shard_ids[0]}.000000.json"], proc.stdout.read().decode()[-2000:]
        time.sleep(lease_seconds + 0.5)  # its lease expires: no renewal from a stopped process

        taker = Annotator(config(teacher_path, top_k=4, worker_id="taker", lease_seconds=lease_seconds), store)
        assert sorted(taker.run().annotated) == shard_ids  # the frozen one's shard included
        digests = {
            s: hashlib.sha256(store.read_bytes(layout.annotated_path(s, "teacher"))).hexdigest() for s in shard_ids
        }
        os.kill(proc.pid, signal.SIGCONT)  # it finishes scoring, finds its lease taken over, writes nothing
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()[-2000:]
    assert "lease lost: " + shard_ids[0] in out.decode() and "annotated 0" in out.decode()
    frozen = read_metrics(store)["annotate-frozen"]
    assert [r["event"] for r in frozen] == ["lease_lost"]
    # one part per shard, each the taker's bytes, complete and valid
    assert store.shards.annotated_parts() == {s: {"teacher"} for s in shard_ids}
    for s in shard_ids:
        rel = layout.annotated_path(s, "teacher")
        assert hashlib.sha256(store.read_bytes(rel)).hexdigest() == digests[s]
        read_shard(store, rel, kind=ANNOTATED, run=store.manifest.require())
    assert lease_files(store) == []


def test_an_interrupted_holder_releases_its_lease_at_once(store, teacher_path):
    """Scale-down under Ray sends SIGINT (ray_actor.StageWorker.interrupt): the holder deletes its lease on the
    way out, so another worker takes the shard at once instead of after the expiry (60 s here)."""
    shard_ids = write_shards(store, 3, num_rows=4)
    proc = start_slow_holder(store, teacher_path, 60)
    try:
        wait_for_its_first_lease(proc, store)
        assert lease_files(store) == [f"{shard_ids[0]}.000000.json"], proc.stdout.read().decode()[-2000:]
        time.sleep(0.3)  # inside its first shard's 1 s teacher call, past the lease's creation
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in out.decode()
    assert lease_files(store) == []  # released, not left to expire
    assert not store.shards.annotated_parts()  # its shard was dropped, not half-published
    started = time.monotonic()
    taker = Annotator(config(teacher_path, top_k=4, worker_id="taker", lease_seconds=60), store)
    assert sorted(taker.run().annotated) == shard_ids  # the interrupted one's shard included, no waiting
    assert time.monotonic() - started < 30
