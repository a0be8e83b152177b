"""Which rollout shards an annotate worker scores next, and when it may rest (demand-aware pacing).

- `shard_owner`: with `num_workers` n > 1, worker i takes the shards whose crc32(shard id) % n is i (crc32 is
  stable across processes and machines; Python's `hash` is salted). With one worker every shard is a candidate,
  and leases (leases.py) decide who scores it.
- `ShardSelection.pending()`: this worker's shards without this teacher's part, oldest first, stale ones included
  (the caller skips and counts those), from one poll of the staleness window below LATEST (`ShardWatch`: older
  shards published late come in through its sweep, one old version per poll).
- Deadline order (issue #25): with the trainer's schedule in its progress (`ShardSelection.read_schedule`), the
  pending shards go smallest deadline first (`by_deadline`: the last step that can train a shard's version,
  s_max(v) capped by max_steps), and a shard whose deadline has passed is skipped unscored (`expired`: the
  worker records it as skipped-expired, with its rows). The worker looks again after every shard.
- `ShardSelection.demand_covered()`: without a schedule only (a trainer older than #25), the shards with this
  teacher's part cover what the trainer's remaining steps still need (issue #14). With one it is redundant
  (rollout makes no row the schedule cannot train) and harmful (a late shard of a dead version counted as
  coverage would rest annotate while the trainer waits).
"""

from __future__ import annotations

import zlib

import pyarrow as pa

from opd_cache.annotate.leases import LeaseBook
from opd_cache.flow.schedule import TrainSchedule, read_schedule
from opd_cache.flow.staleness import is_too_stale, staleness_window
from opd_cache.storage.schema import count_rows
from opd_cache.storage.store import ShardInfo, ShardWatch, Store


def shard_owner(shard_id: str, num_workers: int) -> int:
    """Which worker annotates `shard_id`: the same answer in every process, on every machine."""
    return zlib.crc32(shard_id.encode()) % num_workers


class ShardSelection:
    """The shards pending for one teacher's worker, and the rows its teacher has scored (for pacing)."""

    store: Store
    teacher: str
    worker_index: int  # this worker's i of the static split (0 with one worker)
    num_workers: int
    max_staleness: int  # the configuration's one bound (flow/staleness.py)
    leases: LeaseBook | None  # polled with every listing (one LIST): the claims of the other workers
    watch: ShardWatch  # lists the versions still worth annotating, not the run's history
    scored_rows: dict[str, int]  # rollout rows of the shards with this teacher's part (any worker)

    def __init__(
        self,
        store: Store,
        teacher: str,
        *,
        max_staleness: int,
        worker_index: int = 0,
        num_workers: int = 1,
        leases: LeaseBook | None = None,
    ):
        self.store, self.teacher = store, teacher
        self.worker_index, self.num_workers = worker_index, num_workers
        self.max_staleness = max_staleness
        self.leases = leases
        self.watch = ShardWatch(store, parts=True)
        self.scored_rows = {}
        self._scored_since_poll: set[str] = set()  # parts this worker wrote that the last poll could not list

    def pending(self) -> list[ShardInfo]:
        """This worker's rollout shards without this teacher's part, oldest first (stale ones included)."""
        shards = self.watch.poll(*staleness_window(self.store.latest_version(), self.max_staleness))
        self._scored_since_poll = set()
        if self.leases is not None:
            self.leases.poll()
        parts = self.watch.parts
        return [
            s
            for s in shards
            if self.teacher not in parts.get(s.shard_id, ())
            and shard_owner(s.shard_id, self.num_workers) == self.worker_index
        ]

    def read_schedule(self) -> TrainSchedule | None:
        """The trainer's schedule (None: none published, or the trainer is DONE)."""
        return None if self.store.is_done() else read_schedule(self.store)

    @staticmethod
    def by_deadline(shards: list[ShardInfo], schedule: TrainSchedule | None) -> list[ShardInfo]:
        """The shards, the one that must be trained first, first (ties: oldest first); as given without one."""
        if schedule is None:
            return shards
        return sorted(shards, key=lambda s: (schedule.deadline_step(s.policy_version), s))

    @staticmethod
    def expired(info: ShardInfo, schedule: TrainSchedule | None) -> bool:
        """No step the trainer has yet to assemble can train this shard's rows."""
        return schedule is not None and schedule.deadline_passed(info.policy_version)

    def too_stale(self, info: ShardInfo, latest_version: int) -> bool:
        """The trainer (at version >= latest) can no longer use rows from this shard's policy version."""
        return is_too_stale(info.policy_version, latest_version, self.max_staleness)

    def scored(self, shard_id: str, rows: int) -> None:
        """This worker wrote the part of `shard_id` (`rows` rollout rows): coverage before a listing shows it."""
        self.scored_rows[shard_id] = rows
        self._scored_since_poll.add(shard_id)

    def demand_covered(self) -> bool:
        """Demand-aware pacing (issue #14): shards with this teacher's part cover the trainer's remaining steps.

        Coverage is their rows less those the trainer is done with (consumed, expired, lost); it must reach what the
        remaining steps train, `samples_needed_total` less trained. No demand known (no trainer progress, a
        token budget per step) or the trainer DONE: False, annotate works as before.
        """
        progress = self.store.read_progress()
        needed = progress.get("samples_needed_total")
        if needed is None or self.store.is_done():
            return False
        for shard in self.watch.shards:  # the last poll's: the first one listed the whole history
            if self.teacher not in self.watch.parts.get(shard.shard_id, ()):
                if shard.shard_id not in self._scored_since_poll:
                    self.scored_rows.pop(shard.shard_id, None)  # its part was quarantined: to be scored again
            elif shard.shard_id not in self.scored_rows:
                try:
                    self.scored_rows[shard.shard_id] = count_rows(self.store, shard.path)
                except (OSError, pa.ArrowInvalid):
                    self.scored_rows[shard.shard_id] = 0  # unreadable: quarantined, never trained
        # done with: consumed, expired, or lost (a damaged rollout shard the trainer quarantined)
        used = sum(int(progress.get(key, 0)) for key in ("consumed_samples", "expired_samples", "lost_samples"))
        return sum(self.scored_rows.values()) - used >= int(needed) - int(progress.get("trained_samples", 0))
