"""Retention: how much of the trainer's output the store keeps, so a long run does not fill the disk (issue #14).

Policy versions. `prune_policy_versions` keeps the newest `train.keep_versions`
versions below and including `policy/LATEST`, every version above LATEST (a
publication in progress), LATEST itself, and every version a live reader holds.
Readers say what they hold in `holders/<name>.json` (`VersionHold`): a rollout
worker the version it samples with (and the one it is loading), the evaluator
the versions it has yet to evaluate. A hold is live until its `expires` time;
the holder renews it while it runs, so a holder that died stops pinning once
its hold expires.

Resume states. `prune_states` keeps the newest `train.keep_states` complete
states of `train/state/`.

Crash safety. A deletion removes the folder's `_COMPLETE` marker first, then
its files, its `_CHECKSUMS.json` last. Every reader takes a version or a state only when its marker
exists (`Store.policy_versions`, `Store.latest_version`,
`PolicyFiles.newest_intact`, `checkpoint.complete_states`), so a deletion cut
short by a kill leaves a folder no reader uses, never a damaged "complete" one;
the next pass (after each publication, and when the trainer starts) deletes
what is left of it.

Rollout and annotated shards are the dataset and are never deleted here.
"""

from __future__ import annotations

import socket
import threading
import time

from opd_cache.storage import layout
from opd_cache.storage.integrity import MANIFEST
from opd_cache.storage.keepalive import KeepAlive
from opd_cache.storage.layout import HOLDERS, POLICY, TRAIN_STATE
from opd_cache.storage.store import Store


class VersionHold:
    """A reader's claim on the policy versions it uses, renewed while it runs.

    `hold(versions)` records them at once (call it before loading a version: retention runs in another
    process); `renew()` rewrites the record when a third of its lifetime has passed. `every` (the
    evaluator) also claims each later version that is a multiple of it. `start()` renews it from a thread
    as well (storage/keepalive.py), so that one call longer than the lifetime (a generate() of minutes on a
    big model) does not let the hold lapse under the version in use; `release()` stops that thread.
    """

    def __init__(self, store: Store, name: str, ttl_s: float):
        self.store, self.name, self.ttl_s = store, name, ttl_s
        self.versions: list[int] = []
        self.every: int | None = None
        self.written = 0.0
        self._write_lock = threading.Lock()  # the thread's rewrite must not land after, and undo, a newer hold
        self.keepalive = KeepAlive(self._rewrite, every_s=ttl_s / 3, name=f"hold-{name}")

    def start(self) -> VersionHold:
        self.keepalive.start()
        return self

    def _rewrite(self) -> bool:
        self._write()
        return True

    def hold(self, *versions: int, every: int | None = None) -> None:
        claim = (sorted({v for v in versions if v > 0}), every)
        if claim == (self.versions, self.every) and self.written:
            self.renew()  # nothing new to say: written again only when due
            return
        self.versions, self.every = claim
        self._write()

    def renew(self) -> None:
        if time.monotonic() - self.written >= self.ttl_s / 3:
            self._write()

    def _write(self) -> None:
        with self._write_lock:
            now = time.time()
            record = {
                "versions": self.versions,
                "every": self.every,
                "time": round(now, 3),
                "expires": round(now + self.ttl_s, 3),
                "host": socket.gethostname(),
            }
            self.store.write_json(layout.holder_path(self.name), record)
            self.written = time.monotonic()

    def release(self) -> None:
        """The holder stops (a clean exit): its versions are free at once."""
        self.keepalive.stop()
        self.store.delete(layout.holder_path(self.name))


def live_holds(store: Store, now: float | None = None) -> list[dict]:
    """The hold records whose `expires` has not passed (an unreadable record counts as expired)."""
    now = time.time() if now is None else now
    holds = []
    for info in store.list_files(HOLDERS):
        if not info.base_name.endswith(".json"):
            continue
        record = store.read_json(store.relative_path(info.path), default=None)
        if isinstance(record, dict) and float(record.get("expires", 0)) > now:
            holds.append(record)
    return holds


def is_pinned(version: int, holds: list[dict]) -> bool:
    for hold in holds:
        if version in hold.get("versions", []):
            return True
        every, oldest = hold.get("every"), min(hold.get("versions") or [0])
        if every and oldest and version >= oldest and version % every == 0:
            return True
    return False


def _version_folders(store: Store) -> list[int]:
    """Every `policy/vNNNNNN` folder, complete or not, oldest first."""
    folders = (layout.policy_version_of(name) for name in store.list_dirs(POLICY))
    return sorted(v for v in folders if v is not None)


def outside_window(version: int, latest: int, keep: int) -> bool:
    """True for a version retention drops unless held: older than the newest `keep` up to LATEST."""
    return version <= latest - keep


def delete_folder(store: Store, rel: str) -> None:
    """Remove a checkpoint folder crash-safely: its `_COMPLETE` marker first, its `_CHECKSUMS.json` last.

    A reader that checked the marker just before it went verifies the files against the manifest: while the
    manifest exists a deleted file reads as missing (the version is refused), never as an unverified folder.
    """
    store.delete(layout.complete_marker(rel))
    for info in store.list_files(rel):
        if info.base_name != MANIFEST:
            store.delete(store.relative_path(info.path))
    store.delete_dir(rel)


def prune_policy_versions(store: Store, keep: int) -> list[int]:
    """Delete the policy versions outside the newest `keep` (module docstring); returns the deleted ones."""
    latest = store.latest_version()
    candidates = [v for v in _version_folders(store) if outside_window(v, latest, keep) and v != latest]
    if not candidates:
        return []
    holds = live_holds(store)
    deleted = []
    for version in candidates:
        if is_pinned(version, holds):
            continue
        delete_folder(store, layout.policy_dir(version))
        deleted.append(version)
    return deleted


def prune_states(store: Store, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete resume states, and what a cut-short deletion left of older ones."""
    complete, incomplete = [], []
    for step in (layout.state_step(name) for name in store.list_dirs(TRAIN_STATE)):
        if step is not None:
            (complete if store.exists(layout.complete_marker(layout.state_dir(step))) else incomplete).append(step)
    complete.sort()
    kept = complete[-keep:]
    # A folder without marker older than the oldest kept state is a deletion cut short; a newer one may be
    # an object-store upload in progress, so it stays (the next save of that step replaces it).
    doomed = complete[:-keep] + [s for s in incomplete if kept and s < kept[0]]
    for step in sorted(doomed):
        delete_folder(store, layout.state_dir(step))
    return sorted(doomed)


def retention_pass(store: Store, keep_versions: int | None, keep_states: int) -> dict[str, list[int]]:
    """Both prunings, as the trainer's rank 0 runs them when it starts (finishing a pass a kill cut short)."""
    versions = prune_policy_versions(store, keep_versions) if keep_versions else []
    return {"versions": versions, "states": prune_states(store, keep_states)}
