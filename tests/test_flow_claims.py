"""Several rollout workers share one schedule's slots: each claims the rows it has admitted and not published
(rollout/pacing.py, `claims/<worker>.json`), and the others count them (issue #25).

Measured before the claims (docs/benchmarks.md, "~100M parameters"): two workers that reloaded each version
together both sampled its batch, and half of every version's rows expired. Each decision is checked on a known
store, with the schedule written by the test, so nothing waits on time.
"""

from __future__ import annotations

import json
import time

from opd_cache.flow.schedule import TrainSchedule
from opd_cache.rollout.pacing import BacklogGauge
from opd_cache.storage import layout
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


def claim_file(store, worker: str, version: int, rows: int, made_at: float) -> None:
    """A claim as another worker writes it, with the time it was made."""
    record = {"worker": worker, "policy_version": version, "rows": rows, "made_at": made_at}
    store.write_bytes(layout.claim_path(worker), json.dumps(record).encode())


def test_of_two_workers_deciding_in_the_same_poll_the_later_claim_gives_way(student_store, tmp_path):
    """Both polled before either claimed (6 prompts admitted to each): the first to claim keeps its 6, the
    second, reading the first's claim after writing its own, samples none."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    w00, w01 = BacklogGauge(store, worker="w00"), BacklogGauge(store, worker="w01")
    assert allowed(w00) == allowed(w01) == 6
    assert w00.admit_claimed(3, 0, 6, N, 1000) == 6
    assert w01.admit_claimed(3, 0, 6, N, 1000) == 0
    assert json.loads(store.read_bytes(layout.claim_path("w01")))["rows"] == 0  # cut to what it samples


def test_a_claim_made_later_does_not_hold_back_an_earlier_one(student_store, tmp_path):
    """The other order of the race: w01 claimed after w00 but w00 reads it (both wrote, then both read): w00
    keeps its slots, and w01, whose claim is the later one, gives way when it reads w00's."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    w00, w01 = BacklogGauge(store, worker="w00"), BacklogGauge(store, worker="w01")
    assert allowed(w00) == allowed(w01) == 6
    claim_file(store, "w01", 3, 6 * N, made_at=time.time() + 3600)  # w01's claim, made after w00's below
    assert w00.admit_claimed(3, 0, 6, N, 1000) == 6
    w01._claimed = (3, 6 * N, json.loads(store.read_bytes(layout.claim_path("w01")))["made_at"])
    assert w01.admit_claimed(3, 0, 6, N, 1000) == 0
    # an earlier claim of part of the slots leaves the rest: 2 prompts of 8 rows taken, 4 prompts left
    claim_file(store, "w01", 3, 2 * N, made_at=0.0)
    assert w00.admit_claimed(3, 0, 6, N, 1000) == 4


def test_rows_published_between_the_poll_and_the_claim_are_counted(student_store, tmp_path):
    """w01 publishes its 16 rows (its claim back to 0) after w00's poll: w00's second look lists them."""
    store = student_store
    mid_run(store, tmp_path / "policy")
    w00 = BacklogGauge(store, worker="w00")
    assert allowed(w00) == 6
    add_rows(store, 3, 4 * N, worker="w01")
    claim_file(store, "w01", 3, 0, made_at=0.0)
    assert w00.admit_claimed(3, 0, 6, N, 1000) == 2
