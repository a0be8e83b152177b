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
from dataclasses import dataclass
from pathlib import Path

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
def sleep_past(expires_at: float) -> None:
    """Until a lease's expiry (a wall-clock time, as the workers compare it) has passed."""
    time.sleep(max(0.0, expires_at - time.time()) + 0.1)


# Leases of LEASE_S seconds: the assertions that a lease is still live must hold however slowly a loaded machine
# runs the few requests between them (an S3 request to moto can take a second there); 0.6 s leases did not.
LEASE_S = 3.0


def test_a_live_lease_excludes_others_and_an_expired_one_is_taken_over(any_store):
    a, b = LeaseBook(any_store, "teacher", "a", LEASE_S), LeaseBook(any_store, "teacher", "b", LEASE_S)
    lease_a = a.claim(SHARD)
    assert lease_a is not None and lease_a.generation == 0
    b.poll()
    assert b.claim(SHARD) is None  # a's lease is live
    assert lease_a.still_mine()
    sleep_past(lease_a.expires_at)  # a froze: no renewal, the lease expires
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
    a, b = LeaseBook(any_store, "teacher", "a", LEASE_S), LeaseBook(any_store, "teacher", "b", LEASE_S)
    with a.claim(SHARD) as lease:  # renewed every LEASE_S / 3 by its thread
        first_expiry = lease.expires_at
        while time.time() < first_expiry + 1.0:  # past the expiry it had without renewal
            time.sleep(0.5)
            b.poll()
            assert b.claim(SHARD) is None
        assert lease.renewals >= 1 and lease.expires_at > first_expiry and lease.still_mine()
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
from pathlib import Path
from opd_cache.annotate import Annotator
from opd_cache.config import AnnotateConfig, Config
from opd_cache.storage.store import Store

store_uri, teacher, lease_seconds, scoring_marker, teacher_seconds = sys.argv[1:]
cfg = Config(annotate=AnnotateConfig(teacher=teacher, top_k=4, worker_id="frozen", lease_seconds=float(lease_seconds)))
annotator = Annotator(cfg, Store(store_uri), progress=False)
score = annotator.scorer.score
def slow_score(*args):  # a slow teacher: the test stops or interrupts this process while it scores
    Path(scoring_marker).touch()  # the event the test waits for: inside a teacher call, holding a lease
    time.sleep(float(teacher_seconds))
    return score(*args)
annotator.scorer.score = slow_score
stats = annotator.run()
print("annotated", len(stats.annotated))
"""


@dataclass
class SlowHolder:
    """An annotate worker in its own process (FROZEN_WORKER) whose teacher calls take `teacher_seconds`."""

    proc: subprocess.Popen
    scoring_marker: Path

    def wait_until_scoring(self, store) -> None:
        """Until it is inside its first teacher call, holding that shard's lease (an event, not a delay)."""
        deadline = time.monotonic() + 180  # its start-up imports torch and transformers: slow on a busy machine
        while not self.scoring_marker.exists() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.scoring_marker.exists(), self.output()
        assert len(lease_files(store)) == 1, self.output()

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stdout.read().decode()[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_slow_holder(store, teacher_path, tmp_path, lease_seconds: float, teacher_seconds: float) -> SlowHolder:
    marker = tmp_path / "scoring-started"
    proc = subprocess.Popen(
        [sys.executable, "-c", FROZEN_WORKER, store.uri, str(teacher_path), str(lease_seconds), str(marker)]
        + [str(teacher_seconds)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # a stage process's start (Ctrl-C works whatever signals the test process blocks or ignores)
        preexec_fn=prepare_stage_process,
    )
    return SlowHolder(proc, marker)


def test_a_frozen_lease_holder_is_taken_over_and_its_late_result_is_dropped(store, teacher_path, tmp_path):
    shard_ids = write_shards(store, 3, num_rows=4)
    lease_seconds = 1.5
    # a 5 s teacher call: the test stops the holder inside it (it would publish if it were not stopped in time)
    holder = start_slow_holder(store, teacher_path, tmp_path, lease_seconds, teacher_seconds=5)
    try:
        holder.wait_until_scoring(store)
        os.kill(holder.proc.pid, signal.SIGSTOP)  # frozen while it scores its first shard
        assert lease_files(store) == [f"{shard_ids[0]}.000000.json"]
        time.sleep(lease_seconds + 0.5)  # its lease expires: no renewal from a stopped process

        taker = Annotator(config(teacher_path, top_k=4, worker_id="taker", lease_seconds=lease_seconds), store)
        assert sorted(taker.run().annotated) == shard_ids  # the frozen one's shard included
        digests = {
            s: hashlib.sha256(store.read_bytes(layout.annotated_path(s, "teacher"))).hexdigest() for s in shard_ids
        }
        os.kill(holder.proc.pid, signal.SIGCONT)  # it finishes scoring, finds its lease taken over, writes nothing
        out, _ = holder.proc.communicate(timeout=120)
    finally:
        holder.stop()
    assert holder.proc.returncode == 0, out.decode()[-2000:]
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


def test_an_interrupted_holder_releases_its_lease_at_once(store, teacher_path, tmp_path):
    """Scale-down under Ray sends SIGINT (ray_actor.StageWorker.interrupt): the holder deletes its lease on the
    way out, so another worker takes the shard at once instead of after the expiry (60 s here).

    The teacher call lasts until the interrupt (120 s), so a lost SIGINT fails the test instead of letting the
    holder finish. (It was lost when it landed in pyarrow's first to_numpy, which imported pandas and dropped the
    KeyboardInterrupt: opd_cache/storage/columns.py now imports pandas up front.)"""
    shard_ids = write_shards(store, 3, num_rows=4)
    holder = start_slow_holder(store, teacher_path, tmp_path, 60, teacher_seconds=120)
    try:
        holder.wait_until_scoring(store)
        assert lease_files(store) == [f"{shard_ids[0]}.000000.json"]
        os.kill(holder.proc.pid, signal.SIGINT)
        out, _ = holder.proc.communicate(timeout=60)
    finally:
        holder.stop()
    assert "KeyboardInterrupt" in out.decode(), out.decode()[-2000:]
    assert lease_files(store) == []  # released, not left to expire
    assert not store.shards.annotated_parts()  # its shard was dropped, not half-published
    started = time.monotonic()
    taker = Annotator(config(teacher_path, top_k=4, worker_id="taker", lease_seconds=60), store)
    assert sorted(taker.run().annotated) == shard_ids  # the interrupted one's shard included, no waiting
    assert time.monotonic() - started < 30


INTERRUPTED_WHILE_PANDAS_LOADS = """
import os, signal, sys

class InterruptWhenPandasLoads:  # a Ctrl-C that lands while pandas loads (a second or more on a busy machine)
    def find_spec(self, name, path=None, target=None):
        if name == "pandas":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptWhenPandasLoads())
import numpy as np
import pyarrow as pa
import opd_cache.storage.schema  # what every stage imports before it reads a shard
array = pa.Array.from_buffers(pa.int64(), 3, [None, pa.py_buffer(np.arange(3).tobytes())])
array.to_numpy()  # a stage's first conversion: pyarrow's C++ side imports pandas here unless it is loaded
print("still running after the Ctrl-C")
"""


def test_a_ctrl_c_while_pandas_loads_stops_the_process():
    """The cause of the lost SIGINT above, on its own: pyarrow's first to_numpy imports pandas from C++ and drops
    the KeyboardInterrupt raised meanwhile, so the process went on. opd_cache's storage imports pandas itself, where
    a Ctrl-C propagates."""
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WHILE_PANDAS_LOADS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        # as a stage starts: a suite run as a background job (`cmd &`) has SIGINT ignored, and its children with it
        preexec_fn=prepare_stage_process,
    )
    assert "still running" not in out.stdout
    assert out.returncode != 0 and "KeyboardInterrupt" in out.stderr, out.stderr[-2000:]
