"""Listings of a store's shards: full ones (`ShardListing`, a store's `store.shards`) and what polling stages
see: `ShardWatch` (a staleness window of partitions per poll) and `ShardTally` (everything seen so far, for
displays), at a cost set by the window rather than the run's history."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from opd_cache.storage.filestore import FileStore
from opd_cache.storage.layout import (
    ANNOTATED,
    PARTITION_RE,
    ROLLOUTS,
    ShardInfo,
    StoreError,
    annotated_partition,
    parse_shard_id,
    partition_name,
    rollout_partition,
    rollout_path,
)


class ShardListing:
    """The full listings of one store's shards and parts (`store.shards`)."""

    def __init__(self, files: FileStore):
        self.files = files

    def rollouts(self, versions: Iterable[int] | None = None) -> list[ShardInfo]:
        """Rollout shards, sorted; of the given policy-version partitions only (one LIST each), else all of them.

        The full listing (one recursive LIST of `rollouts/`, cost ∝ the run's history) is for replay, export,
        inspect and verify, and for a stage's first poll; polling stages use `ShardWatch`. It also finds shards
        of the flat layout that preceded the partitions (`rollouts/<shard_id>.arrow`, see `opd migrate`).
        """
        files = self.files
        if versions is None:
            infos = files.list_files(ROLLOUTS, recursive=True)
        else:
            infos = [i for v in sorted(set(versions)) for i in files.list_files(rollout_partition(v))]
        prefix = files.path(ROLLOUTS) + "/"
        shards = []
        for info in infos:
            rel = info.path[len(prefix) :]
            folder, _, name = rel.rpartition("/")
            if not name.endswith(".arrow"):
                continue
            shard_id = name[: -len(".arrow")]
            try:
                version, worker, seq = parse_shard_id(shard_id)
            except ValueError:
                continue  # foreign file: ignored by listings, reported by `opd inspect`
            if folder not in ("", partition_name(version)):
                continue  # a shard filed under another version's partition (copied by hand): not ours to read
            shards.append(ShardInfo(version, worker, seq, shard_id, files.relative_path(info.path), info.size))
        return sorted(shards)

    def annotated_parts(self, versions: Iterable[int] | None = None) -> dict[str, set[str]]:
        """shard_id -> names of the teachers whose part exists; of the given partitions only, else all."""
        files = self.files
        if versions is None:
            infos = files.list_files(ANNOTATED, recursive=True)
        else:
            infos = [i for v in sorted(set(versions)) for i in files.list_files(annotated_partition(v), recursive=True)]
        parts: dict[str, set[str]] = {}
        prefix = files.path(ANNOTATED) + "/"
        for info in infos:
            rel = info.path[len(prefix) :]
            if not rel.endswith(".arrow"):
                continue
            names = rel[: -len(".arrow")].split("/")
            if len(names) == 3 and PARTITION_RE.fullmatch(names[0]):
                names = names[1:]
            elif len(names) != 2 or versions is not None:  # a flat-layout part counts in full listings only
                continue
            shard_id, teacher = names
            parts.setdefault(shard_id, set()).add(teacher)
        return parts

    def legacy_layout_hint(self, shards: list[ShardInfo]) -> str | None:
        """The one-line message for a store whose shards are still in the flat pre-partition layout, else None."""
        flat = [s.path for s in shards if s.path != rollout_path(s.shard_id)]
        if not flat:
            return None
        return (
            f"{self.files.path(flat[0])} and {len(flat) - 1} more shards are in the flat layout of earlier "
            f"opd_cache versions (rollouts/<shard>.arrow); run `opd migrate {self.files.uri}` once, "
            f"with no stage running"
        )

    def dataset(self) -> tuple[list[ShardInfo], dict[str, set[str]]]:
        """Every rollout shard and annotated part (full listings), for the readers of a whole store (export,
        inspect, replay); a store still in the flat layout is refused with the `opd migrate` hint."""
        shards = self.rollouts()
        hint = self.legacy_layout_hint(shards)
        if hint:
            raise StoreError(hint)
        return shards, self.annotated_parts()


class ListedStore(Protocol):
    """What the pollers below need of a store (a `Store`): its listings and its newest policy version."""

    shards: ShardListing

    def latest_version(self) -> int: ...


class ShardWatch:
    """What a polling stage sees of the rollout shards (and annotated parts), at a cost set by its window.

    Shards live in one partition per policy version (`rollouts/v000003/`, `annotated/v000003/`), and a stage
    can only use shards of the versions inside its staleness window [low, high]. So:

    * the first poll lists everything once (a restarted stage catches up: expired shards included);
    * every later poll lists the window's partitions, the partitions that left the window since the last
      poll (their last listing: what they hold expired), and one partition below the window in turn, the
      amortised sweep: a shard published late into an old version (its writer sampled with a version that
      has since left every window) is still found, within as many polls as there are old versions, and
      handled as before (expired, counted). A poll costs (versions in the window + 1) LISTs of `rollouts/`
      (and as many of `annotated/` with parts=True), plus one per version the window moved, whatever the
      run's history.

    `shards` and `parts` hold what the last poll listed (not everything seen: the caller remembers what it
    handled).
    """

    def __init__(self, store: ListedStore, *, parts: bool = False):
        self.store, self.with_parts = store, parts
        self.shards: list[ShardInfo] = []
        self.parts: dict[str, set[str]] = {}  # annotated parts of the partitions listed (with parts=True)
        self.listed_below: int | None = None  # partitions below it had their last listing (None: no poll yet)
        self._sweep = 0  # the next partition of the amortised sweep
        self.polls = 0

    def poll(self, low: int, high: int) -> list[ShardInfo]:
        """List what the window [low, high] of policy versions needs; returns the shards found, sorted."""
        low = max(low, 0)
        high = max(high, low)
        if self.listed_below is None:
            shards = self.store.shards.rollouts()
            hint = self.store.shards.legacy_layout_hint(shards)
            if hint:
                raise StoreError(hint)
            parts = self.store.shards.annotated_parts() if self.with_parts else {}
            self.listed_below = low
        else:
            start = min(self.listed_below, low)
            versions = list(range(start, high + 1))
            if start > 0:
                old = self._sweep % start
                self._sweep = old + 1
                versions.append(old)
            shards = self.store.shards.rollouts(versions)
            parts = self.store.shards.annotated_parts(versions) if self.with_parts else {}
            self.listed_below = max(self.listed_below, low)
        self.shards, self.parts = shards, parts
        self.polls += 1
        return shards


class ShardTally:
    """Every shard and part seen so far, for displays (`opd run`'s dashboard), at the cost of a ShardWatch poll.

    `poll()` returns what `store.shards.rollouts()` and `.annotated_parts()` would (sorted shards, parts
    by shard), but after the first call lists only the last `window` versions (and the watch's sweep) below
    LATEST. A file moved away later (quarantined) stays counted: this is a tally, not a listing.
    """

    def __init__(self, store: ListedStore, window: int = 4):
        self.store, self.window = store, window
        self.watch = ShardWatch(store, parts=True)
        self.shards: dict[str, ShardInfo] = {}
        self.parts: dict[str, set[str]] = {}

    def poll(self) -> tuple[list[ShardInfo], dict[str, set[str]]]:
        latest = self.store.latest_version()
        for shard in self.watch.poll(latest - self.window, latest):
            self.shards[shard.shard_id] = shard
        for shard_id, teachers in self.watch.parts.items():
            self.parts.setdefault(shard_id, set()).update(teachers)
        return sorted(self.shards.values()), self.parts
