"""The store's layout: every name and path the stages share, in one place (callers use these functions).

<root>/run.json                                       run manifest (opd_cache/storage/manifest.py), created once
<root>/run/teachers/<teacher>.json                    one record per teacher, created once
<root>/rollouts/v000003/<shard_id>.arrow              written by `opd rollout`
<root>/annotated/v000003/<shard_id>/<teacher>.arrow   written by `opd annotate`
(v000003: the shard's policy version, so a poll lists only the versions it can use; see ShardWatch)
<root>/policy/v000003/                                HF checkpoint published by `opd train`
<root>/policy/LATEST                                  newest complete version number
<root>/train/progress.json, train/DONE, train/state/, train/consumed/, train/skipped/<shard_id>.jsonl
<root>/metrics/<stage>-<worker>.jsonl (or metrics/<stage>-<worker>/<segment>.jsonl on object stores)
<root>/quarantine/<name> + <name>.reason.txt          <name>: the moved file's path with '/' as '__'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The shard format writers stamp, in every shard's metadata and in run.json; readers accept versions 1 and 2
# (storage/schema.py, READABLE_SCHEMA_VERSIONS). Version 2: multi-turn rows (loss_mask, turn_index).
SCHEMA_VERSION = 2
RUN_JSON = "run.json"
TEACHERS_DIR = "run/teachers"
ROLLOUTS = "rollouts"
ANNOTATED = "annotated"
POLICY = "policy"
LATEST = "policy/LATEST"
TRAIN_PROGRESS = "train/progress.json"
TRAIN_DONE = "train/DONE"
TRAIN_STATE = "train/state"
TRAIN_CONSUMED = "train/consumed"
TRAIN_SKIPPED = "train/skipped"
LEASES = "leases"  # annotate workers' shard leases, leases/<teacher>/<shard>.<generation>.json (annotate/leases.py)
HOLDERS = "holders"  # readers' holds on policy versions (opd_cache/storage/retention.py)
METRICS = "metrics"
QUARANTINE = "quarantine"
REASON_SUFFIX = ".reason.txt"


class StoreError(RuntimeError):
    """A problem with the shared store that the user must fix (message names the path)."""


SHARD_ID_RE = re.compile(r"^v(?P<version>\d{6})-(?P<worker>[A-Za-z0-9_]{1,32})-(?P<seq>\d{6})$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
TMP_MARKER = ".tmp-"
COMPLETE_MARKER = "_COMPLETE"


def validate_name(kind: str, name: str) -> str:
    """Teacher names, worker ids etc. become path components: refuse anything that could escape the store."""
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise ValueError(
            f"invalid {kind} {name!r}: use 1-64 characters from letters, digits, '_', '-', '.' "
            f"(starting with a letter or digit, no '..')"
        )
    return name


def validate_worker_id(worker: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_]{1,32}", worker or ""):
        raise ValueError(
            f"invalid worker id {worker!r}: use 1-32 letters, digits or '_' (it becomes part of shard names)"
        )
    return worker


def make_shard_id(policy_version: int, worker: str, seq: int) -> str:
    """`v000003-w02-000117`: sorts by policy version, names its origin, and is unique per worker."""
    validate_worker_id(worker)
    if policy_version < 0 or seq < 0:
        raise ValueError(f"policy_version and seq must be >= 0, got {policy_version}, {seq}")
    return f"v{policy_version:06d}-{worker}-{seq:06d}"


@dataclass(frozen=True, order=True)
class ShardInfo:
    """A rollout shard as seen in a listing; ordering is (policy_version, worker, seq)."""

    policy_version: int
    worker: str
    seq: int
    shard_id: str
    path: str
    size: int = -1


def parse_shard_id(shard_id: str) -> tuple[int, str, int]:
    m = SHARD_ID_RE.match(shard_id)
    if not m:
        raise ValueError(
            f"invalid shard id {shard_id!r}: expected v<6 digits>-<worker>-<6 digits>, e.g. v000003-w02-000117"
        )
    return int(m["version"]), m["worker"], int(m["seq"])


PARTITION_RE = re.compile(r"v\d{6}")


def partition_name(version: int) -> str:
    """`v000003`: the folder of `rollouts/` and `annotated/` that holds the shards of one policy version."""
    return f"v{version:06d}"


def is_tmp(name: str) -> bool:
    """A temporary file or folder of a writer (finished, killed or still running): every listing ignores it."""
    return TMP_MARKER in name


def quarantine_name(rel: str) -> str:
    """The name of a moved file in quarantine/: its store path with '/' as '__' (unique, and says where it was)."""
    return rel.replace("/", "__")


# ------------------------------------------------------------------ paths (store-relative)
def rollout_path(shard_id: str) -> str:
    version, _, _ = parse_shard_id(shard_id)
    return f"{ROLLOUTS}/{partition_name(version)}/{shard_id}.arrow"


def annotated_path(shard_id: str, teacher: str) -> str:
    version, _, _ = parse_shard_id(shard_id)
    validate_name("teacher name", teacher)
    return f"{ANNOTATED}/{partition_name(version)}/{shard_id}/{teacher}.arrow"


def flat_rollout_path(shard_id: str) -> str:
    """Where earlier versions kept a rollout shard (`rollouts/<shard_id>.arrow`, before the partitions)."""
    parse_shard_id(shard_id)
    return f"{ROLLOUTS}/{shard_id}.arrow"


def flat_annotated_path(shard_id: str, teacher: str) -> str:
    """Where earlier versions kept an annotated part (`annotated/<shard_id>/<teacher>.arrow`)."""
    parse_shard_id(shard_id)
    return f"{ANNOTATED}/{shard_id}/{validate_name('teacher name', teacher)}.arrow"


def policy_dir(version: int) -> str:
    return f"{POLICY}/{partition_name(version)}"


def teacher_path(name: str) -> str:
    return f"{TEACHERS_DIR}/{validate_name('teacher name', name)}.json"


def skipped_path(shard_id: str) -> str:
    """The trainer's ledger of the rows of `shard_id` it will never train (unrouted, expired, lost)."""
    parse_shard_id(shard_id)
    return f"{TRAIN_SKIPPED}/{shard_id}.jsonl"


def metrics_dir(stem: str | None = None) -> str:
    """`metrics/`, or the folder of one log's segments (object stores: see opd_cache/observe/metrics.py)."""
    return f"{METRICS}/{stem}" if stem else METRICS


def metrics_path(stem: str, segment: str | None = None) -> str:
    """`metrics/<stem>.jsonl` (appended on local stores), or a segment `metrics/<stem>/<segment>` of it."""
    return f"{metrics_dir(stem)}/{segment}" if segment else f"{METRICS}/{stem}.jsonl"


def quarantine_path(rel: str) -> str:
    """Where `Store.quarantine(rel)` moves a file (whether it is there tells a quarantined file from a missing one)."""
    return f"{QUARANTINE}/{quarantine_name(rel)}"
