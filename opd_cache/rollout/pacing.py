"""How far rollout may run ahead of the trainer.

With the trainer's schedule in `train/progress.json` (issue #25, opd_cache/flow/schedule.py), admission by
schedule: a generate() call at version v takes no more prompts than the rule admits,

    trained + pending(≤ v) + k ≤ B·min(s_max(v), max_steps),

pending counted from the rows this gauge lists (per version) plus the worker's own buffer, less the rows the
trainer is done with; and the rows of live versions stay within `max_buffer_samples` (the backlog is bounded in
versions by the rule, in samples by the buffer). Rows of versions no step can train any more count for nothing,
so a shard published late into an old version blocks no one.

Several workers: each one's rows count in the others' pending(≤ v) only once published, unless it says it is
making them. A worker with an id *claims* before each generate() call the rows it has admitted and not yet
published (`claims/<worker>.json`: version and rows; 0 after its flush), and every gauge adds the other workers'
claims to its in-flight rows (one LIST of `claims/` and a read per worker, with the listing it already makes).
Without claims two workers that reload the same version admit the same slots: with a version per step, each
version's batch was sampled twice and half of it expired (docs/benchmarks.md, "~100M parameters").

Two workers that decide within one poll of each other would still both be admitted (each decided before the
other's claim existed), so a claim is a two-step decision (`admit_claimed`): write the claim, then read the
other claims again and give way to every claim made earlier (ordered by the store's time of the claim file,
then worker id: the same order for every reader, whatever the workers' clocks): the later of two racing
workers cuts its call to what the earlier one left. Claims are read before the listing, so a shard published
in between is counted (as a claim, as rows, or both: never neither). A claim counts while its worker is alive:
a thread refreshes it, and a claim not refreshed for `rollout.claim_seconds` (a worker killed and not
restarted) stops counting (claims.py).

Without a schedule (a trainer older than #25, a token budget before its first batch, a finished trainer), the
count pacing of before: the unconsumed backlog against `max_buffer_samples`, and the trainer's remaining demand
in samples (issue #14).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa

from opd_cache.flow.schedule import TrainSchedule, schedule_in
from opd_cache.rollout.claims import DEFAULT_ALIVE_SECONDS, ClaimBoard
from opd_cache.storage.layout import parse_shard_id
from opd_cache.storage.schema import count_rows
from opd_cache.storage.store import ShardWatch, Store


class _RowCounts(dict):
    """shard id -> rows, with their running total and per-version totals (shards are immutable: each is counted
    once)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_version: dict[int, int] = {}

    def __setitem__(self, shard_id: str, rows: int) -> None:
        change = rows - self.get(shard_id, 0)
        self.total += change
        version = parse_shard_id(shard_id)[0]
        self.by_version[version] = self.by_version.get(version, 0) + change
        super().__setitem__(shard_id, rows)


class BacklogGauge:
    """Rows published by all rollout workers that the trainer has not consumed (nor expired) yet, and the
    trainer's schedule read in the same poll.

    The first call counts every shard; later calls list only the last `window` versions' partitions (plus the
    `ShardWatch` sweep, which finds a shard published late into an older version), so a poll's cost does not
    grow with the run's history.
    """

    def __init__(
        self,
        store: Store,
        window: int = 4,
        worker: str | None = None,
        *,
        claim_seconds: float = DEFAULT_ALIVE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.store, self.window = store, window
        self.worker = worker  # this worker's id: its claims are written under it (None: it claims nothing)
        # this worker's claim and the others' (claims.py); `clock`/`wall_clock`: injectable for tests
        self.claims = ClaimBoard(store, worker, claim_seconds, clock=clock, wall_clock=wall_clock)
        self.others: dict[int, int] = {}  # version -> rows the other live workers claim (admitted, not published)
        self.rows = _RowCounts()
        self._watch = ShardWatch(store)
        self.demand: int | None = None  # samples the trainer's remaining steps still lack (None: unknown)
        # a trainer has written train/progress.json and is not DONE: someone consumes the backlog
        self.trainer_running = False
        self.trainer_done = False  # train/DONE was there at the last poll
        self.schedule: TrainSchedule | None = None  # the trainer's (None: pace by count, as before #25)

    def backlog(self) -> int:
        progress = self.store.read_progress()  # before the listing: no row consumed that the listing misses
        done = self.store.is_done()
        self.trainer_running, self.trainer_done = bool(progress) and not done, done
        # once the trainer is DONE its schedule is over: rows sampled then are for a later run, paced as before
        self.schedule = None if done else schedule_in(progress, self.store)
        # the claims before the listing too: a shard published in between is counted (claimed, listed or both)
        self.others = self.claims.others() if self.schedule is not None else {}
        self._count_new_shards()
        backlog = self.rows.total - int(progress.get("consumed_samples", 0)) - int(progress.get("expired_samples", 0))
        # demand-aware pacing (issue #14): what the remaining steps train, less what the backlog covers.
        # Expired rows left the backlog above; rows expiring while the trainer waits, it publishes then.
        needed = progress.get("samples_needed_total")
        if needed is None or done or self.schedule is not None:  # the schedule's rule covers the demand
            self.demand = None
        else:
            self.demand = int(needed) - int(progress.get("trained_samples", 0)) - (backlog - self._quarantined_rows())
        return backlog

    def live_rows(self, in_flight: dict[int, int] | None = None) -> int:
        """Rows of versions the trainer can still train that it is not done with (schedule only)."""
        newest = max([*self.rows.by_version, *(in_flight or {})], default=0)
        return self.schedule.pending_at_or_below(newest, self.rows.by_version, in_flight)

    def prompts_allowed(self, version: int, in_flight_rows: int, n: int, max_buffer_samples: int) -> int | None:
        """Whole prompts a worker sampling at `version`, with `in_flight_rows` rows of its own not yet published,
        may sample now (None: no schedule, pace by count). Read after `backlog()`."""
        schedule = self.schedule
        if schedule is None:
            return None
        in_flight = dict(self.others)
        if in_flight_rows:
            in_flight[version] = in_flight.get(version, 0) + in_flight_rows
        pending = schedule.pending_at_or_below(version, self.rows.by_version, in_flight)
        allowed = schedule.prompts_allowed(version, pending, n)
        if allowed is None:
            return None
        room = (max_buffer_samples - self.live_rows(in_flight)) // n  # the backlog bounded in samples too
        return max(0, min(allowed, room))

    def admit_claimed(self, version: int, own_rows: int, count: int, n: int, max_buffer_samples: int) -> int:
        """Claim `count` more prompts at `version` (besides the worker's `own_rows` unpublished rows), then give
        way to the claims other workers made earlier: the prompts this worker may really sample (≤ `count`).

        Called just before generate(), after `prompts_allowed` decided `count` from the last poll."""
        if self.worker is None or self.schedule is None:
            return count
        self.claim(version, own_rows + count * n)
        self.others = self.claims.others(give_way_only=True)
        self._count_new_shards()  # after the claims: rows a worker published meanwhile (its claim now 0)
        allowed = self.prompts_allowed(version, own_rows, n, max_buffer_samples)
        if allowed is not None and allowed < count:
            count = allowed
            self.claim(version, own_rows + count * n)
        return count

    def claim(self, version: int, rows: int) -> None:
        """Say that this worker has `rows` rows of `version` admitted and not yet published (0: none); written
        only when it changes, and only by a worker with an id (claims.py)."""
        self.claims.write(version, rows)

    def _count_new_shards(self) -> None:
        latest = self.store.latest_version()
        for shard in self._watch.poll(latest - self.window, latest):
            if shard.shard_id not in self.rows:
                try:
                    self.rows[shard.shard_id] = count_rows(self.store, shard.path)
                except (OSError, pa.ArrowInvalid):
                    self.rows[shard.shard_id] = 0  # unreadable: annotate will quarantine it

    def _quarantined_rows(self) -> int:
        """Rows of counted shards moved to quarantine/ (damaged): never trained, so no coverage (one LIST)."""
        moved = {s.shard_id for s in self.store.quarantined_rollouts()}
        return sum(rows for shard_id, rows in self.rows.items() if shard_id in moved)
