"""The store's layout: every name and path the stages share, in one place (callers use these functions).

<root>/run.json                                       run manifest (opd_cache/storage/manifest.py), created once
<root>/run/teachers/<teacher>.json                    one record per teacher, created once
<root>/rollouts/v000003/<shard_id>.arrow              written by `opd rollout`
<root>/annotated/v000003/<shard_id>/<teacher>.arrow   written by `opd annotate`
(v000003: the shard's policy version, so a poll lists only the versions it can use; see ShardWatch)
<root>/policy/v000003/                                HF checkpoint published by `opd train`
<root>/policy/LATEST                                  newest complete version number
<root>/train/progress.json, train/DONE                the trainer's status (Store.read_progress, Store.is_done)
<root>/train/state/step-000042/                       a resume state (opd_cache/train/checkpoint.py)
<root>/train/consumed/step-000042.jsonl               the rows trained at step 42 (the ledger)
<root>/train/skipped/<shard_id>.jsonl                 the rows of a shard never trained, and why
<root>/leases/<teacher>/<shard_id>.000001.json        an annotate worker's lease (opd_cache/annotate/leases.py)
<root>/holders/<name>.json                            a reader's hold on policy versions (storage/retention.py)
<root>/claims/<worker>.json                           a rollout worker's rows not yet published (rollout/pacing.py)
<root>/claims/<worker>.alive                          ...and its heartbeat: the claim counts while it changes
<root>/metrics/<stage>-<worker>.jsonl (or metrics/<stage>-<worker>/<segment>.jsonl on object stores)
<root>/quarantine/<name> + <name>.reason.txt          <name>: the moved file's path with '/' as '__'
<root>/launch/config.yaml                             the config `opd run` started the run with (launch/attach.py)
<root>/bells/<topic>.bell                             local stores: rung by each write under <topic>/ (storage/bells.py)

Every path above is a function below (`rollout_path(shard_id)`, `state_dir(step)`, ...): callers never join
these names themselves, so the layout can be read, and changed, here alone.
"""

from __future__ import annotations

import re
import secrets
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
TRAIN = "train"
TRAIN_PROGRESS = "train/progress.json"
TRAIN_DONE = "train/DONE"
TRAIN_STATE = "train/state"
TRAIN_CONSUMED = "train/consumed"
TRAIN_SKIPPED = "train/skipped"
LEASES = "leases"  # annotate workers' shard leases (opd_cache/annotate/leases.py)
HOLDERS = "holders"  # readers' holds on policy versions (opd_cache/storage/retention.py)
CLAIMS = "claims"  # rollout workers' unpublished rows, counted by the others' admission (rollout/pacing.py)
METRICS = "metrics"
QUARANTINE = "quarantine"
BELLS = "bells"  # local stores' wake-ups, one empty file per top folder (opd_cache/storage/bells.py)
LAUNCH_CONFIG = "launch/config.yaml"  # the resolved config of the `opd run` that started the run (launch/attach.py)
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
STATE_RE = re.compile(r"step-(\d{6,})")  # a folder of train/state/
CONSUMED_RE = re.compile(r"step-(\d+)\.jsonl")  # a file of train/consumed/
LEASE_RE = re.compile(r"^(?P<shard>.+)\.(?P<gen>\d{6})\.json$")  # a file of leases/<teacher>/


def partition_name(version: int) -> str:
    """`v000003`: the folder of `rollouts/` and `annotated/` that holds the shards of one policy version."""
    return f"v{version:06d}"


def is_tmp(name: str) -> bool:
    """A temporary file or folder of a writer (finished, killed or still running): every listing ignores it."""
    return TMP_MARKER in name


def tmp_name(path: str, tag: str | None = None) -> str:
    """A writer's temporary name beside `path` (`<path>.tmp-<tag>`, a random tag unless given): listings skip it."""
    return f"{path}{TMP_MARKER}{tag or secrets.token_hex(6)}"


def quarantine_name(rel: str) -> str:
    """The name of a moved file in quarantine/: its store path with '/' as '__' (unique, and says where it was)."""
    return rel.replace("/", "__")


# ------------------------------------------------------------------ paths (store-relative)
def rollout_path(shard_id: str) -> str:
    version, _, _ = parse_shard_id(shard_id)
    return f"{rollout_partition(version)}/{shard_id}.arrow"


def annotated_path(shard_id: str, teacher: str) -> str:
    version, _, _ = parse_shard_id(shard_id)
    validate_name("teacher name", teacher)
    return f"{annotated_partition(version)}/{shard_id}/{teacher}.arrow"


def rollout_partition(version: int) -> str:
    """`rollouts/v000003`: the rollout shards of one policy version (one LIST)."""
    return f"{ROLLOUTS}/{partition_name(version)}"


def annotated_partition(version: int) -> str:
    """`annotated/v000003`: the annotated parts of the shards of one policy version (one recursive LIST)."""
    return f"{ANNOTATED}/{partition_name(version)}"


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


def policy_version_of(name: str) -> int | None:
    """The version of a folder name of `policy/` (`v000003` -> 3), None for any other name."""
    return int(name[1:]) if PARTITION_RE.fullmatch(name) else None


def complete_marker(folder: str) -> str:
    """The `_COMPLETE` marker of a checkpoint folder (a policy version, a resume state): written last, read first."""
    return f"{folder}/{COMPLETE_MARKER}"


def state_dir(step: int) -> str:
    """The trainer's resume state of step `step`: `train/state/step-000042/`."""
    return f"{TRAIN_STATE}/step-{step:06d}"


def state_step(name: str) -> int | None:
    """The step of a folder name of `train/state/` (`step-000042` -> 42), None for a name `state_dir` never gives."""
    match = STATE_RE.fullmatch(name)
    return int(match[1]) if match and state_dir(int(match[1])) == f"{TRAIN_STATE}/{name}" else None


def consumed_path(step: int) -> str:
    """The trainer's ledger of the rows trained at `step`: `train/consumed/step-000042.jsonl`."""
    return f"{TRAIN_CONSUMED}/step-{step:06d}.jsonl"


def consumed_step(name: str) -> int | None:
    """The step of a file name of `train/consumed/` (`step-000042.jsonl` -> 42), None for any other name."""
    match = CONSUMED_RE.fullmatch(name)
    return int(match[1]) if match else None


def teacher_path(name: str) -> str:
    return f"{TEACHERS_DIR}/{validate_name('teacher name', name)}.json"


def skipped_path(shard_id: str) -> str:
    """The trainer's ledger of the rows of `shard_id` it will never train (unrouted, expired, lost)."""
    parse_shard_id(shard_id)
    return f"{TRAIN_SKIPPED}/{shard_id}.jsonl"


def skipped_shard(name: str) -> str:
    """The shard id a file name of `train/skipped/` is the ledger of (`<shard_id>.jsonl`)."""
    return name.removesuffix(".jsonl")


def leases_dir(teacher: str) -> str:
    """The leases of one teacher's shards (opd_cache/annotate/leases.py): one LIST tells which shards are held."""
    return f"{LEASES}/{teacher}"


def lease_path(teacher: str, shard_id: str, generation: int) -> str:
    """`leases/<teacher>/<shard_id>.<generation>.json`: generation g + 1 takes the shard over from g."""
    return f"{leases_dir(teacher)}/{shard_id}.{generation:06d}.json"


def parse_lease_name(name: str) -> tuple[str, int] | None:
    """(shard id, generation) of a file name of a teacher's lease folder, None for any other name."""
    match = LEASE_RE.match(name)
    return (match["shard"], int(match["gen"])) if match else None


def holder_path(name: str) -> str:
    """`holders/<name>.json`: the policy versions a reader (a rollout worker, the evaluator) holds."""
    return f"{HOLDERS}/{name}.json"


def claim_path(worker: str) -> str:
    """`claims/<worker>.json`: the rows a rollout worker has admitted and not yet published (issue #25)."""
    return f"{CLAIMS}/{validate_worker_id(worker)}.json"


def claim_alive_path(worker: str) -> str:
    """`claims/<worker>.alive`: rewritten every third of `rollout.claim_seconds` while the worker runs, so the
    others know its claim is not a dead worker's (rollout/pacing.py)."""
    return f"{CLAIMS}/{validate_worker_id(worker)}.alive"


def parse_claim_name(name: str) -> tuple[str, str] | None:
    """(worker, "json" or "alive") of a file name of `claims/`; None for a foreign file."""
    worker, dot, kind = name.rpartition(".")
    return (worker, kind) if dot and worker and kind in ("json", "alive") else None


def annotated_folder(name: str) -> str:
    """A folder directly under `annotated/`: a version partition, or a shard's parts in the flat layout."""
    return f"{ANNOTATED}/{name}"


def metrics_dir(stem: str | None = None) -> str:
    """`metrics/`, or the folder of one log's segments (object stores: see opd_cache/observe/metrics.py)."""
    return f"{METRICS}/{stem}" if stem else METRICS


def metrics_path(stem: str, segment: str | None = None) -> str:
    """`metrics/<stem>.jsonl` (appended on local stores), or a segment `metrics/<stem>/<segment>` of it."""
    return f"{metrics_dir(stem)}/{segment}" if segment else f"{METRICS}/{stem}.jsonl"


def quarantine_path(rel: str) -> str:
    """Where `Store.quarantine(rel)` moves a file (whether it is there tells a quarantined file from a missing one)."""
    return quarantine_file(quarantine_name(rel))


def quarantine_file(name: str) -> str:
    """`quarantine/<name>`: a file of quarantine/ by its name (as a listing of the folder gives it)."""
    return f"{QUARANTINE}/{name}"
