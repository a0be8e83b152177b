"""Where a restarted rollout worker resumes: read from its own last intact shard's metadata.

Nothing else holds a worker's state, so there is no side file to get out of sync with the shards; a damaged
newest shard is quarantined and the worker resumes from the one before it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from opd_cache.storage.schema import ROLLOUT, CorruptShardError, ShardError, ShardMeta, read_shard
from opd_cache.storage.store import RunManifest, Store

# Keys this stage adds to a rollout shard's metadata (ShardMeta ignores keys it does not know).
META_CURSOR = "opd.rollout.cursor"  # stream position after the shard's last prompt
META_SAMPLES = "opd.rollout.samples"  # rows this worker has published, this shard included
META_SEED = "opd.rollout.seed"
META_NUM_PROMPTS = "opd.rollout.num_prompts"


@dataclass
class RolloutShardMeta(ShardMeta):
    """ShardMeta plus where the worker stands in its prompt stream."""

    cursor: int = 0
    samples: int = 0
    seed: int = 0
    num_prompts: int = 0

    def to_metadata(self) -> dict[bytes, bytes]:
        meta = super().to_metadata()
        for key, value in (
            (META_CURSOR, self.cursor),
            (META_SAMPLES, self.samples),
            (META_SEED, self.seed),
            (META_NUM_PROMPTS, self.num_prompts),
        ):
            meta[key.encode()] = str(value).encode()
        return meta


RESUME_VERSIONS = 8  # partitions a restarted worker looks at before it lists the whole history


@dataclass
class ResumePoint:
    """Where a restarted worker goes on: its next shard seq, prompt cursor and sample count."""

    next_seq: int = 0
    cursor: int = 0
    samples: int = 0
    last_shard: str | None = None
    quarantined: list[str] = field(default_factory=list)  # this worker's damaged newest shards, moved aside


def resume_point(store: Store, worker_id: str, run: RunManifest, seed: int, num_prompts: int) -> ResumePoint:
    """Where this worker stopped, read from its own last intact shard.

    A worker's shards never go back in version, so its last one lies in the newest partition holding any of
    its shards: look at the last RESUME_VERSIONS partitions first, list the whole history only when none does.

    A damaged newest shard (checksum, truncation) is quarantined and the worker resumes from the shard before
    it: the damaged shard's prompts are sampled again, under a new shard id (`next_seq` passes every seq this
    worker ever used, quarantined ones included, so no id is reused and no old annotated part pairs up with new
    rows). Its rows are not counted here: the trainer never trains them (gone from `rollouts/`) and counts as
    lost only the rows of it that it had started on (docs/reliability.md).
    """
    latest = store.latest_version()
    mine = []
    for version in range(latest, max(latest - RESUME_VERSIONS, -1), -1):
        mine = [s for s in store.shards.rollouts([version]) if s.worker == worker_id]
        if mine:
            break
    else:
        mine = [s for s in store.shards.rollouts() if s.worker == worker_id]
    moved = [s.seq for s in store.quarantined_rollouts() if s.worker == worker_id]  # one LIST of quarantine/
    used_seq = max([s.seq for s in mine] + moved, default=-1)
    quarantined = []
    while mine:
        last = max(mine, key=lambda s: s.seq)
        try:
            table, _ = read_shard(store, last.path, kind=ROLLOUT, run=run)
            break
        except CorruptShardError as e:
            _quarantine(store, e)
            quarantined.append(last.shard_id)
            if len(quarantined) == 1:  # the previous intact shard may lie in an older partition: list them all
                mine = [s for s in store.shards.rollouts() if s.worker == worker_id]
            mine = [s for s in mine if s.seq < last.seq]
    if not mine:
        return ResumePoint(next_seq=used_seq + 1, quarantined=quarantined)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    where = store.path(last.path)
    if META_CURSOR not in meta:
        raise ShardError(
            f"{where}: no '{META_CURSOR}' in its metadata, so worker {worker_id} cannot resume "
            f"from it; use another --worker-id"
        )
    recorded = (int(meta.get(META_SEED, seed)), int(meta.get(META_NUM_PROMPTS, num_prompts)))
    if recorded != (seed, num_prompts):
        raise ValueError(
            f"{where}: worker {worker_id} was sampling with seed {recorded[0]} over {recorded[1]} prompts, this "
            f"command has seed {seed} over {num_prompts}: restart with the same settings, or use a new --worker-id"
        )
    return ResumePoint(
        next_seq=used_seq + 1,
        cursor=int(meta[META_CURSOR]),
        samples=int(meta[META_SAMPLES]),
        last_shard=last.shard_id,
        quarantined=quarantined,
    )


def _quarantine(store: Store, error: CorruptShardError) -> None:
    """Move a damaged shard of this worker aside with its reason (one line: what failed, and that it moved)."""
    try:
        store.quarantine(error.rel, str(error))
    except FileNotFoundError:
        pass  # the trainer or annotate quarantined it first
    print(f"{error}: quarantined", file=sys.stderr)
