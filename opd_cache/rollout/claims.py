"""Rollout workers' claims: the rows each one has admitted and not yet published (issue #25, pacing.py).

    claims/<worker>.json     {"worker", "policy_version", "rows", "made_at", "alive_seconds"}: written when it changes
    claims/<worker>.alive    empty; rewritten every alive_seconds / 3 while the worker runs (a thread)

- **Order by the store's clock.** Two workers that decide in the same poll both claim, then the later claim
  gives way (`BacklogGauge.admit_claimed`). "Later" is the claim file's modification time as the store
  reports it in the LIST that reads the claims anyway (`FileStore.modified_times`: the server's clock on S3 and
  GCS, the one machine's on a local directory), then the worker id: every reader sees the same times, so every
  reader orders two claims the same way, whatever the workers' own clocks say. `made_at` (the writer's clock)
  is kept for people reading the file, never compared.
- **A dead worker's claim stops counting.** A claim counts while its worker is alive: while its claim or its
  `.alive` file changes (the LIST shows their times; no request more). A reader that has seen neither change
  for the writer's `alive_seconds` (`rollout.claim_seconds`), timed on the reader's own monotonic clock, counts
  the claim as none: a worker killed and not restarted holds back the others for at most that long after the
  reader first saw its last write. The heartbeat is a file of its own so that rewriting it does not move the
  claim's place in the order. A live worker inside a long generate() call keeps its claim: the heartbeat is
  written by a thread (storage/keepalive.py, the pattern of annotate's leases).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from opd_cache.config import RolloutConfig
from opd_cache.storage import layout
from opd_cache.storage.keepalive import KeepAlive
from opd_cache.storage.store import Store

DEFAULT_ALIVE_SECONDS: float = RolloutConfig.model_fields["claim_seconds"].default


@dataclass
class _Sighting:
    """What one reader knows of another worker's liveness: its files' times, since when unchanged (the reader's
    clock), and the expiry its claim declares."""

    token: tuple[int, int | None]  # (claim's mtime, heartbeat's mtime or None)
    since: float
    alive_seconds: float

    def expired(self, now: float) -> bool:
        return now - self.since >= self.alive_seconds


class ClaimBoard:
    """The `claims/` folder as one rollout worker sees it: its own claim (written, kept alive) and the others'.

    `worker` None: claims nothing (the others' claims are still read). `clock` times the others' silence (the
    reader's monotonic clock); `wall_clock` stamps `made_at`. Both injectable: tests advance a clock instead of
    sleeping, and skew one.
    """

    def __init__(
        self,
        store: Store,
        worker: str | None,
        alive_seconds: float = DEFAULT_ALIVE_SECONDS,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.store, self.worker, self.alive_seconds = store, worker, float(alive_seconds)
        self.clock, self.wall_clock = clock, wall_clock
        self.written: tuple[int, int] | None = None  # (version, rows) of the last claim this worker wrote
        self.keep_alive = KeepAlive(self.beat, self.alive_seconds / 3, name=f"claim-{worker}")
        self._seen: dict[str, _Sighting] = {}
        self.expired: set[str] = set()  # the workers whose claims the last read counted as dead

    # ------------------------------------------------------------ this worker's claim
    def write(self, version: int, rows: int) -> None:
        """Say that this worker has `rows` rows of `version` admitted and not yet published (0: none); written
        only when it changes (a rewrite would move the claim later in the order)."""
        if self.worker is None or self.written == (version, rows):
            return
        record = {
            "worker": self.worker,
            "policy_version": version,
            "rows": rows,
            "made_at": self.wall_clock(),
            "alive_seconds": self.alive_seconds,
        }
        self.store.write_bytes(layout.claim_path(self.worker), json.dumps(record).encode())
        self.written = (version, rows)

    def beat(self) -> bool:
        """Rewrite the heartbeat (the keep-alive thread, every alive_seconds / 3); nothing before a claim."""
        if self.worker is not None and self.written is not None:
            self.store.write_bytes(layout.claim_alive_path(self.worker), b"")
        return True

    def start(self) -> None:
        """Keep this worker's claim alive from now on (a thread), until `close()`."""
        if self.worker is not None:
            self.keep_alive.start()

    def close(self) -> None:
        """The worker stops: no more heartbeats, and its claim is gone (what it published counts as rows)."""
        self.keep_alive.stop()
        if self.worker is not None and self.written is not None:
            self.store.delete(layout.claim_path(self.worker))
            self.store.delete(layout.claim_alive_path(self.worker))
            self.written = None

    # ------------------------------------------------------------ the others' claims
    def others(self, give_way_only: bool = False) -> dict[int, int]:
        """version -> rows the other live workers claim (one LIST of `claims/`, a read per live claim).

        `give_way_only`: only the claims ordered before this worker's own, by (the store's time of the claim
        file, worker id); all of them when this worker's claim is not listed. A claim being rewritten or
        unreadable counts as none."""
        files: dict[str, dict[str, int]] = {}
        for name, mtime in self.store.modified_times(layout.CLAIMS).items():
            parsed = layout.parse_claim_name(name)
            if parsed is not None:
                files.setdefault(parsed[0], {})[parsed[1]] = mtime
        mine = files.get(self.worker or "", {}).get("json")
        claims: dict[int, int] = {}
        expired: set[str] = set()
        for worker, times in sorted(files.items()):
            if worker == self.worker or "json" not in times:
                continue
            if give_way_only and mine is not None and (times["json"], worker) > (mine, self.worker):
                continue  # made after this worker's claim: that worker gives way, not this one
            seen = self._sighting(worker, (times["json"], times.get("alive")))
            if seen.expired(self.clock()):
                expired.add(worker)  # not even read: a dead worker's claim costs no request
                continue
            try:
                record = json.loads(self.store.read_bytes(layout.claim_path(worker)))
                version, rows = int(record["policy_version"]), int(record["rows"])
                seen.alive_seconds = float(record.get("alive_seconds", self.alive_seconds))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if seen.expired(self.clock()):  # its own expiry is shorter than this reader assumed
                expired.add(worker)
                continue
            claims[version] = claims.get(version, 0) + max(0, rows)
        for worker in expired - self.expired:
            print(
                f"warning: {layout.claim_path(worker)}: its worker has not refreshed it for "
                f"{self._seen[worker].alive_seconds:g} s (dead?): its rows no longer count",
                file=sys.stderr,
            )
        self.expired = expired
        return claims

    def _sighting(self, worker: str, token: tuple[int, int | None]) -> _Sighting:
        """This reader's record of `worker`'s files: restarted whenever their times change."""
        seen = self._seen.get(worker)
        if seen is None or seen.token != token:
            alive_seconds = seen.alive_seconds if seen is not None else self.alive_seconds
            seen = self._seen[worker] = _Sighting(token, self.clock(), alive_seconds)
        return seen
