"""Wake-ups between stages on a local store (opd_cache/storage/bells.py): a publishing write rings its topic's
bell, and a stage waiting on that topic wakes at once instead of at its next poll."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from opd_cache.storage.bells import Bell
from opd_cache.storage.store import make_shard_id
from opd_cache.testing import write_synthetic_shard
from tests.test_train_stream import K, V, make_stream, shard

LONG_POLL_S = 60.0  # a wake-up that came from the poll would take this long


@pytest.fixture
def run(local_store):
    return local_store.manifest.ensure(
        student="student", tokenizer_fingerprint="fp-test", vocab_size=V, top_k=K, teachers={"teacher": "teacher-path"}
    )


def test_each_publishing_write_rings_its_topic_and_no_other(local_store, tmp_path):
    Path(local_store.root).mkdir(parents=True)  # a store: its first bell makes bells/
    rollouts, annotated = local_store.bell("rollouts"), local_store.bell("annotated")
    assert not rollouts.changed() and not annotated.changed()

    local_store.write_bytes("rollouts/v000000/a.arrow", b"x")  # write_atomic
    assert rollouts.changed() and not annotated.changed()
    assert not rollouts.changed()  # the look is taken

    assert local_store.create_if_absent("rollouts/v000000/b.arrow", b"x")
    assert rollouts.changed()
    local_store.move_file("rollouts/v000000/b.arrow", "annotated/v000000/b.arrow")
    assert annotated.changed() and not rollouts.changed()  # the bell of the destination
    out = local_store.open_atomic_output("annotated/v000000/c.arrow")
    out.stream.write(b"x")
    assert not annotated.changed()  # not visible yet: no ring
    out.commit()
    assert annotated.changed()
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "f").write_bytes(b"x")
    local_store.replace_dir(staged, "annotated/v000001")
    assert annotated.changed()


def test_a_waiting_trainer_stream_wakes_on_the_write_not_at_its_next_poll(local_store, run):
    shard(local_store, run, 0, 0, rows=4)
    waiting = threading.Event()
    stream, _ = make_stream(local_store, run, follow=True, poll_seconds=LONG_POLL_S, on_wait=waiting.set)
    assert stream.next_batch(1, 0).num_rows == 4
    late = make_shard_id(0, "w00", 1)

    def write_once_the_stream_waits():
        waiting.wait(30)
        write_synthetic_shard(local_store, run, late, num_rows=4, vocab_size=V, top_k=K, seed=9)

    writer = threading.Thread(target=write_once_the_stream_waits)
    writer.start()
    t0 = time.monotonic()
    batch = stream.next_batch(2, 0)
    elapsed = time.monotonic() - t0
    writer.join()
    assert batch.sample_ids == [f"{late}-{i}" for i in range(4)]
    assert waiting.is_set() and elapsed < LONG_POLL_S / 2, f"woken after {elapsed:.1f} s: by the poll, not the bell"


def test_a_write_from_another_process_wakes_a_waiting_bell(local_store):
    Path(local_store.root).mkdir(parents=True)
    bell = local_store.bell("rollouts")
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from opd_cache.storage.store import Store; "
            "Store(sys.argv[1]).write_bytes('rollouts/v000000/a.arrow', b'x')",
            local_store.root,
        ]
    )
    t0 = time.monotonic()
    stopped = bell.wait(LONG_POLL_S)
    elapsed = time.monotonic() - t0
    assert writer.wait(30) == 0
    assert not stopped and elapsed < LONG_POLL_S / 2, f"woken after {elapsed:.1f} s: by the poll, not the bell"
    assert local_store.exists("rollouts/v000000/a.arrow")


def test_a_folder_nobody_waits_on_gets_no_bells(local_store, tmp_path):
    """An `opd export` folder, a store only read: its writes ring nothing, and no bells/ appears."""
    local_store.write_bytes("rollouts/v000000/a.arrow", b"x")
    local_store.move_file("rollouts/v000000/a.arrow", "annotated/a.arrow")
    assert sorted(p.name for p in Path(local_store.root).iterdir()) == ["annotated", "rollouts"]


def test_a_bell_made_before_its_store_exists_rings_once_it_does(local_store):
    """`opd annotate --follow` may start before rollout has created the store: its first wait after that makes
    bells/, and the writes from then on wake it."""
    bell = local_store.bell("rollouts")
    assert not Path(local_store.root).exists()
    local_store.write_bytes("run.json", b"{}")  # the store now exists; no bells/ yet, so this rang nothing
    assert bell.wait(0.01) is False and (Path(local_store.root) / "bells").is_dir()
    local_store.write_bytes("rollouts/v000000/a.arrow", b"x")
    assert bell.changed()


def test_a_set_stop_ends_the_wait(local_store):
    stop = threading.Event()
    stop.set()
    assert Bell(local_store, ("rollouts",)).wait(LONG_POLL_S, stop) is True


def test_a_bell_that_cannot_ring_never_fails_the_write(local_store):
    Path(local_store.root).mkdir(parents=True)
    (Path(local_store.root) / "bells").write_bytes(b"not a folder")  # every ring now fails with an OSError
    local_store.write_bytes("rollouts/v000000/a.arrow", b"x")
    assert local_store.read_bytes("rollouts/v000000/a.arrow") == b"x"
    assert Bell(local_store, ("rollouts",)).wait(0.01) is False  # and a waiter falls back to its poll


def test_an_object_store_waits_its_poll(monkeypatch):
    object_store = SimpleNamespace(is_local=False, root="bucket/prefix")
    bell = Bell(object_store, ("rollouts",))
    assert bell.paths == [] and not bell.changed()
    stop = threading.Event()
    waited = []
    monkeypatch.setattr(stop, "wait", lambda timeout: waited.append(timeout) or False)
    assert bell.wait(2.5, stop) is False and waited == [2.5]  # one wait of the whole poll, no ticks


def test_no_bell_passes_for_a_data_file(local_store):
    """Checks that read every `*.json`, `*.jsonl` or `*.arrow` of a store (the chaos invariants, verify) must not
    find an empty bell: `bells/run.json` was read as JSON and failed a chaos run."""
    Path(local_store.root).mkdir(parents=True)
    local_store.bell("run.json")
    local_store.write_bytes("run.json", b"{}")
    local_store.write_bytes("rollouts/v000000/a.arrow", b"x")
    bells = sorted(p.name for p in (Path(local_store.root) / "bells").iterdir())
    assert bells == ["rollouts.bell", "run.json.bell"]
    assert not any(name.endswith((".json", ".jsonl", ".arrow")) for name in bells)
