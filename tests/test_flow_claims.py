"""Several rollout workers share one schedule's slots: each claims the rows it has admitted and not published
(rollout/pacing.py, `claims/<worker>.json`), and the others count them (issue #25).

Measured before the claims (docs/benchmarks.md, "~100M parameters"): two workers that reloaded each version
together both sampled its batch, and half of every version's rows expired. Each decision is checked on a known
store, with the schedule written by the test, so nothing waits on time: claims are ordered by the store's
times of writing (`after_a_store_tick` makes two writes' times differ), and a claim's liveness is timed on the
reader's clock, which the tests advance by hand (rollout/claims.py).
"""

from __future__ import annotations

import json
import time

import pytest

from opd_cache.flow.schedule import TrainSchedule
from opd_cache.rollout.pacing import BacklogGauge
from opd_cache.storage import layout
from opd_cache.testing import CountingFileSystem
from tests.test_flow_stages import add_rows, publish_fake_policy, set_schedule

N = 4  # samples per prompt


def mid_run(store, folder) -> None:
    """A version per step, max_staleness 2, 8 rows per step; 3 steps assembled and trained (24 rows), version 3
    published: the next step, 4, trains at version 3, and rows of version 3 train until step s_max(3) = 6:
    48 − 24 = 24 open slots."""
    publish_fake_policy(store, 3, folder)
    set_schedule(
        store,
        TrainSchedule(
            max_steps=16, publish_every=1, max_staleness=2, batch_samples=8, assembled_steps=3, trained_samples=24
        ),
    )


def allowed(gauge: BacklogGauge, version: int = 3, own_rows: int = 0) -> int:
    gauge.backlog()  # one poll: the listing, the schedule and the other workers' claims
    return gauge.prompts_allowed(version, own_rows, n=N, max_buffer_samples=1000)


def test_a_second_worker_is_not_admitted_to_the_slots_the_first_one_claimed(student_store, tmp_path):
    store = student_store
    mid_run(store, tmp_path / "policy")
    w00, w01 = BacklogGauge(store, worker="w00"), BacklogGauge(store, worker="w01")
    assert allowed(w00) == allowed(w01) == 6  # 24 open slots, nobody sampling yet
    w00.claim(3, 6 * N)  # w00 takes all six prompts
    assert allowed(w01) == 0
    # published, then no longer claimed: the rows count once, as published rows
    add_rows(store, 3, 6 * N, worker="w00")
    w00.claim(3, 0)
    assert allowed(w01) == 0
    assert w01.others == {3: 0}


def test_a_worker_counts_its_own_rows_once_and_a_claim_of_a_dead_version_not_at_all(student_store, tmp_path):
    store = student_store
    mid_run(store, tmp_path / "policy")
    w00, w01 = BacklogGauge(store, worker="w00"), BacklogGauge(store, worker="w01")
    w00.claim(3, 8)  # two prompts in w00's buffer: passed as its own rows, its own claim is not added again
    assert allowed(w00, own_rows=8) == 4
    assert allowed(w01) == 4  # w01 sees them as w00's claim
    # version 0: the next step (4, at version 3) can no longer train it: its rows take no slot
    w00.claim(0, 8)
    assert allowed(w01) == 6
    assert store.exists(layout.claim_path("w00")) and not store.exists(layout.claim_path("w01"))


def test_a_worker_without_an_id_claims_nothing_and_an_unreadable_claim_counts_as_none(student_store, tmp_path):
    store = student_store
    mid_run(store, tmp_path / "policy")
    anonymous = BacklogGauge(store)
    anonymous.claim(3, 8)
    assert store.list_files(layout.CLAIMS) == []
    store.write_bytes(layout.claim_path("w02"), b"{not json")
    assert allowed(BacklogGauge(store, worker="w00")) == 6


def after_a_store_tick(store, worker: str) -> None:
    """Return once the store's clock has passed the time of `worker`'s claim file: the next write is later in
    the order (a local directory's clock can be coarse: two writes in one tick have equal times)."""
    written = store.modified_times(layout.CLAIMS)[f"{worker}.json"]
    for _ in range(100_000):  # a hang guard: a tick is milliseconds
        store.write_bytes("probe/tick", b"")
        if store.modified_times("probe")["tick"] > written:
            return
    raise AssertionError("the store's clock did not move past the claim's time")


def test_of_two_workers_deciding_in_the_same_poll_the_later_claim_gives_way(student_store, tmp_path):
    """Both polled before either claimed (6 prompts admitted to each): the first to claim keeps its 6, the
    second, reading the first's claim after writing its own, samples none."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    w00, w01 = BacklogGauge(store, worker="w00"), BacklogGauge(store, worker="w01")
    assert allowed(w00) == allowed(w01) == 6
    assert w00.admit_claimed(3, 0, 6, N, 1000) == 6
    after_a_store_tick(store, "w00")
    assert w01.admit_claimed(3, 0, 6, N, 1000) == 0
    assert json.loads(store.read_bytes(layout.claim_path("w01")))["rows"] == 0  # cut to what it samples


def test_a_claim_made_later_does_not_hold_back_an_earlier_one(student_store, tmp_path):
    """The other order of the race: both wrote, then both read: w00, whose claim the store wrote first, keeps
    its slots although w01's claim is there when it reads, and w01 gives way when it reads w00's."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    w00, w01 = BacklogGauge(store, worker="w00"), BacklogGauge(store, worker="w01")
    assert allowed(w00) == allowed(w01) == 6
    w00.claim(3, 6 * N)
    after_a_store_tick(store, "w00")
    w01.claim(3, 6 * N)
    assert w00.admit_claimed(3, 0, 6, N, 1000) == 6  # its claim unchanged: not rewritten, still the earlier
    assert w01.admit_claimed(3, 0, 6, N, 1000) == 0
    # an earlier claim of part of the slots leaves the rest: 2 prompts of 8 rows taken, 4 prompts left
    w02 = BacklogGauge(store, worker="w02")
    assert allowed(w02) == 0
    w00.claim(3, 2 * N)
    after_a_store_tick(store, "w00")
    assert w02.admit_claimed(3, 0, 6, N, 1000) == 4


@pytest.mark.parametrize("skew", [-3600.0, 3600.0])
def test_workers_with_skewed_clocks_give_way_in_the_stores_order(student_store, tmp_path, skew):
    """w00's clock is an hour off (behind: its claims would look an hour earlier than they are; ahead: later).
    w01 claims first in the store's time, then w00: w00 gives way and w01 keeps its slots, whatever the clocks
    and although w00's id sorts first."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    w01 = BacklogGauge(store, worker="w01")
    w00 = BacklogGauge(store, worker="w00", wall_clock=lambda: time.time() + skew)
    assert allowed(w00) == allowed(w01) == 6
    assert w01.admit_claimed(3, 0, 6, N, 1000) == 6
    after_a_store_tick(store, "w01")
    assert w00.admit_claimed(3, 0, 6, N, 1000) == 0
    assert w01.admit_claimed(3, 0, 6, N, 1000) == 6  # reading again: w00's later claim (now 0) holds nothing back
    made_at = {w: json.loads(store.read_bytes(layout.claim_path(w)))["made_at"] for w in ("w00", "w01")}
    assert (made_at["w00"] < made_at["w01"]) == (skew < 0)  # the writers' own stamps, never compared


class Clock:
    """A reader's monotonic clock that the test advances."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_dead_workers_claim_stops_counting_after_its_expiry_and_the_stalled_run_resumes(student_store, tmp_path):
    """w00 claims all 24 open slots, then dies (its heartbeat never comes): the trainer needs exactly those rows,
    so w01 is admitted nothing, until w00's claim has gone unrefreshed for claim_seconds on w01's clock."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    clock = Clock()
    w00 = BacklogGauge(store, worker="w00", claim_seconds=60)
    w01 = BacklogGauge(store, worker="w01", clock=clock)
    assert allowed(w00) == 6 and w00.admit_claimed(3, 0, 6, N, 1000) == 6
    assert allowed(w01) == 0  # stalled on w00's claim
    clock.advance(59.0)
    assert allowed(w01) == 0 and w01.claims.expired == set()
    clock.advance(1.0)  # 60 s without a refresh: w00 is dead
    assert allowed(w01) == 6 and w01.claims.expired == {"w00"}
    counting = CountingFileSystem(store.fs)
    store.fs = counting
    try:
        assert w01.claims.others() == {}
    finally:
        store.fs = counting.fs
    assert (counting.requests["LIST"], counting.requests["GET"]) == (1, 0)  # a dead claim is not even read
    assert w01.admit_claimed(3, 0, 6, N, 1000) == 6  # the run resumes: w01 takes the slots
    # w00 restarted under the same id: its first claim is a live one again, and it came after w01's
    after_a_store_tick(store, "w01")
    w00_again = BacklogGauge(store, worker="w00", claim_seconds=60)
    assert allowed(w00_again) == 0
    assert w00_again.admit_claimed(3, 0, 6, N, 1000) == 0


def test_a_live_worker_keeps_its_claim_through_a_long_generate_call(student_store, tmp_path):
    """w00 claims, then blocks (a generate() call of minutes): its keep-alive thread rewrites the heartbeat, so
    however long w01's clock runs, the claim counts; stopped (the worker died), the claim expires; closed (a
    clean exit), it is gone."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    clock = Clock()
    w00 = BacklogGauge(store, worker="w00", claim_seconds=0.3)  # a heartbeat every 0.1 s of real time
    w01 = BacklogGauge(store, worker="w01", clock=clock)
    assert allowed(w00) == 6 and w00.admit_claimed(3, 0, 6, N, 1000) == 6
    w00.claims.start()  # from here w00's main thread writes nothing: it is "inside generate()"
    for _ in range(3):
        assert allowed(w01) == 0
        # two heartbeats after that read: the second was surely written after it (the first may have raced it)
        assert w00.claims.keep_alive.wait_renewals(w00.claims.keep_alive.renewals + 2, timeout=600), "no heartbeat"
        clock.advance(1000.0)  # far past w00's 0.3 s: only the heartbeats keep its claim
    assert allowed(w01) == 0
    w00.claims.keep_alive.stop()  # dead: the claim and its heartbeat stay, unrefreshed
    assert allowed(w01) == 0  # the last heartbeat seen now
    clock.advance(0.3)
    assert allowed(w01) == 6
    w00.claims.close()
    assert not store.exists(layout.claim_path("w00")) and not store.exists(layout.claim_alive_path("w00"))


def test_rows_published_between_the_poll_and_the_claim_are_counted(student_store, tmp_path):
    """w01 publishes its 16 rows (its claim back to 0) after w00's poll: w00's second look lists them."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    w00 = BacklogGauge(store, worker="w00")
    assert allowed(w00) == 6
    add_rows(store, 3, 4 * N, worker="w01")
    BacklogGauge(store, worker="w01").claim(3, 0)
    assert w00.admit_claimed(3, 0, 6, N, 1000) == 2
