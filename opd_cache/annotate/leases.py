"""Work claiming for annotate workers: shard leases kept in the store (docs/scale-out.md).

A worker that wants to score a shard creates a lease object for it; while it scores, a thread renews the lease
(a new expiry written every `lease_seconds / 3`); when the part is published the lease is deleted. Another worker
that finds a live lease moves on to the next shard; one that finds an expired lease (its holder died, froze,
or was scaled away) takes the shard over. So any number of workers can join or leave a running job and no
shard stays unannotated longer than one lease expiry after its worker is gone.

    leases/<teacher>/<shard_id>.<generation>.json     {"worker", "token", "expires_at", "renewals"}

- **Generations fence takeovers.** The newest generation of a shard is the lease that counts. Taking a shard
  over means creating generation g+1 with `Store.create_if_absent`, so of two workers that both see lease g
  expired only one gets g+1 (local stores: `os.link`, atomic; object stores: see the caveat below). The holder
  of g learns it was superseded when it renews (g+1 exists) and before it publishes (`still_mine`).
- **Only the current holder publishes.** A worker that lost its lease (frozen past the expiry, then resumed)
  drops its result instead of writing it, and every worker re-checks that the part does not exist just before
  writing. The publish is atomic (rename / one PUT) and the output depends only on (shard, teacher), so even
  the remaining race (two holders passing both checks in the same instant) leaves one complete part under one
  name: the last write wins, a reader lists one part per (shard, teacher) and reads one whole object.
- **A restarted worker re-claims its own leases at once.** A lease held under this worker's id belongs to a
  previous incarnation of the same worker (a Ray actor restart, a re-run command): it is taken over without
  waiting for the expiry. Concurrent workers therefore need distinct ids (`annotate.worker_id`; `opd run`
  gives each its own).
- **Clocks.** Expiries are wall-clock times written by the holder, so the workers' clocks must agree to well
  within `lease_seconds` (NTP does); a skewed clock only makes a takeover early (a duplicate scoring) or late.
- **Object stores** have no conditional PUT in pyarrow: `create_if_absent` there is "HEAD, then PUT", and the
  creator reads the lease back to check its token. Two workers racing inside that window (milliseconds) can
  both believe they hold a new shard; the publish rules above make that a duplicate scoring, not a duplicate
  part.

Requests per shard without contention: one PUT (create), one PUT per renewal (none for a shard scored within a
third of the expiry), one HEAD before publishing, one DELETE; on object stores one GET more (the read-back).
One LIST of the lease folder per poll tells a worker which shards others hold, cached with their expiries.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass

from opd_cache.storage import layout
from opd_cache.storage.keepalive import KeepAlive
from opd_cache.storage.store import Store


@dataclass
class Lease:
    """A lease this worker holds on one shard; `lost` once another worker has taken the shard over."""

    book: LeaseBook
    shard_id: str
    generation: int
    token: str
    expires_at: float
    renewals: int = 0
    lost: bool = False
    _keep_alive: KeepAlive | None = None

    @property
    def path(self) -> str:
        return self.book.lease_path(self.shard_id, self.generation)

    def superseded(self) -> bool:
        """A newer generation exists: another worker took this shard over after our lease expired."""
        if not self.lost:
            self.book.requests["check"] += 1
            self.lost = self.book.store.exists(self.book.lease_path(self.shard_id, self.generation + 1))
        return self.lost

    def renew(self) -> bool:
        """Push the expiry forward; False (and `lost`) when the shard was taken over meanwhile."""
        if self.superseded():
            return False
        self.renewals += 1
        self.expires_at = time.time() + self.book.lease_seconds
        self.book.store.write_bytes(self.path, self.book.body(self.token, self.expires_at, self.renewals))
        self.book.requests["renew"] += 1
        return True

    def still_mine(self) -> bool:
        """Checked just before publishing: not taken over, and not past the expiry (a frozen holder)."""
        return time.time() < self.expires_at and not self.superseded()

    def __enter__(self) -> Lease:
        """Renew every lease_seconds / 3 while the worker scores (a thread: the scorer blocks)."""
        self._keep_alive = KeepAlive(self.renew, self.book.lease_seconds / 3, name=f"lease-{self.shard_id}")
        self._keep_alive.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._keep_alive is not None:
            self._keep_alive.stop()
        self.release()

    def release(self) -> None:
        """Delete the lease (the part is published, or the shard was quarantined or given up)."""
        self.book.store.delete(self.path)  # also when lost: the newest generation is another worker's
        self.book.requests["delete"] += 1
        self.book.held.pop(self.shard_id, None)


class LeaseBook:
    """The leases of one teacher's shards, seen by one worker (`worker` is its stable id)."""

    def __init__(self, store: Store, teacher: str, worker: str, lease_seconds: float):
        self.store, self.teacher, self.worker = store, teacher, worker
        self.lease_seconds = float(lease_seconds)
        self.holder = f"{worker}@{socket.gethostname()}:{os.getpid()}"
        self.held: dict[str, Lease] = {}
        # newest generation per shard as of the last poll, and what we know of it: (generation, expires_at, worker)
        self.known: dict[str, tuple[int, float | None, str | None]] = {}
        self.requests = {"list": 0, "create": 0, "read": 0, "renew": 0, "check": 0, "delete": 0}

    def lease_path(self, shard_id: str, generation: int) -> str:
        return layout.lease_path(self.teacher, shard_id, generation)

    def body(self, token: str, expires_at: float, renewals: int = 0) -> bytes:
        return json.dumps(
            {
                "worker": self.worker,
                "holder": self.holder,
                "token": token,
                "expires_at": expires_at,
                "renewals": renewals,
            }
        ).encode()

    def poll(self) -> None:
        """One LIST of the lease folder: which shards have a lease, at which generation."""
        newest: dict[str, int] = {}
        for info in self.store.list_files(layout.leases_dir(self.teacher)):
            lease = layout.parse_lease_name(info.base_name)
            if lease is not None:
                shard, gen = lease
                newest[shard] = max(gen, newest.get(shard, -1))
        self.requests["list"] += 1
        # keep the expiry we read for a generation that has not changed: no GET per poll for a held shard
        self.known = {
            shard: self.known[shard] if self.known.get(shard, (None,))[0] == gen else (gen, None, None)
            for shard, gen in newest.items()
        }

    def _read(self, shard_id: str, generation: int) -> tuple[float, str | None]:
        """(expires_at, worker) of a lease; a lease deleted meanwhile reads as expired."""
        self.requests["read"] += 1
        data = self.store.read_json(self.lease_path(shard_id, generation))
        if not isinstance(data, dict):
            return 0.0, None
        return float(data.get("expires_at", 0.0)), data.get("worker")

    def claim(self, shard_id: str) -> Lease | None:
        """A lease on `shard_id` for this worker, or None while another worker's lease on it is live."""
        generation, expires_at, worker = self.known.get(shard_id, (-1, None, None))
        if generation >= 0:
            if expires_at is None or time.time() >= expires_at:  # live as last read: no request needed
                expires_at, worker = self._read(shard_id, generation)  # re-read: it may have been renewed
                self.known[shard_id] = (generation, expires_at, worker)
            if time.time() < expires_at and worker != self.worker:
                return None  # held by a live worker
        token = secrets.token_hex(8)
        expires_at = time.time() + self.lease_seconds
        path = self.lease_path(shard_id, generation + 1)
        self.requests["create"] += 1
        if not self.store.create_if_absent(path, self.body(token, expires_at)):
            self.known[shard_id] = (generation + 1, None, None)
            return None  # another worker claimed it first
        if not self.store.atomic_create:  # HEAD + PUT (an object store): did our PUT win?
            self.requests["read"] += 1
            data = self.store.read_json(path)
            if not isinstance(data, dict) or data.get("token") != token:
                self.known[shard_id] = (generation + 1, None, None)
                return None
        if generation >= 0:  # the superseded lease: the newest generation is what counts, keep the folder small
            self.store.delete(self.lease_path(shard_id, generation))
        lease = Lease(self, shard_id, generation + 1, token, expires_at)
        self.known[shard_id] = (generation + 1, expires_at, self.worker)
        self.held[shard_id] = lease
        return lease
