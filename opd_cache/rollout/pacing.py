"""How far rollout may run ahead of the trainer: the unconsumed backlog and the trainer's remaining demand."""

from __future__ import annotations

import pyarrow as pa

from opd_cache.storage.schema import count_rows
from opd_cache.storage.store import ShardWatch, Store


class _RowCounts(dict):
    """shard id -> rows, with their running total (shards are immutable: each is counted once)."""

    total = 0

    def __setitem__(self, shard_id: str, rows: int) -> None:
        self.total += rows - self.get(shard_id, 0)
        super().__setitem__(shard_id, rows)


class BacklogGauge:
    """Rows published by all rollout workers that the trainer has not consumed (nor expired) yet.

    The first call counts every shard; later calls list only the last `window` versions' partitions (plus the
    `ShardWatch` sweep, which finds a shard published late into an older version), so a poll's cost does not
    grow with the run's history.
    """

    def __init__(self, store: Store, window: int = 4):
        self.store, self.window = store, window
        self.rows = _RowCounts()
        self._watch = ShardWatch(store)
        self.demand: int | None = None  # samples the trainer's remaining steps still lack (None: unknown)
        # a trainer has written train/progress.json and is not DONE: someone consumes the backlog
        self.trainer_running = False

    def backlog(self) -> int:
        latest = self.store.latest_version()
        for shard in self._watch.poll(latest - self.window, latest):
            if shard.shard_id not in self.rows:
                try:
                    self.rows[shard.shard_id] = count_rows(self.store, shard.path)
                except (OSError, pa.ArrowInvalid):
                    self.rows[shard.shard_id] = 0  # unreadable: annotate will quarantine it
        progress = self.store.read_progress()
        self.trainer_running = bool(progress) and not self.store.is_done()
        backlog = self.rows.total - int(progress.get("consumed_samples", 0)) - int(progress.get("expired_samples", 0))
        # demand-aware pacing (issue #14): what the remaining steps train, less what the backlog covers.
        # Expired rows left the backlog above; rows expiring while the trainer waits, it publishes then.
        # Once the trainer is DONE its demand is met: rows sampled then are for a later run, paced as before.
        needed = progress.get("samples_needed_total")
        if needed is None or self.store.is_done():
            self.demand = None
        else:
            self.demand = int(needed) - int(progress.get("trained_samples", 0)) - (backlog - self._quarantined_rows())
        return backlog

    def _quarantined_rows(self) -> int:
        """Rows of counted shards moved to quarantine/ (damaged): never trained, so no coverage (one LIST)."""
        moved = {s.shard_id for s in self.store.quarantined_rollouts()}
        return sum(rows for shard_id, rows in self.rows.items() if shard_id in moved)
