"""Shared dataset storage: the only thing the three stages have in common.

`Store` is a `FileStore` (filestore.py: atomic writes and create-if-absent over `pyarrow.fs`, local and object
stores alike; its docstring says how files are made atomic and verified) that knows the run's layout (layout.py
names every path): shards and their listings (`store.shards`, listing.py), the run manifest (`store.manifest`,
manifest.py), policy versions, the trainer's status files and quarantine. Callers name files with layout.py's
functions and never ask whether the store is a local directory: FileStore's methods say what they need
(`local_dir`, `appends_in_place`, `atomic_create`, ...). Checkpoint folders get their `_CHECKSUMS.json`
(integrity.py) here, before `_COMPLETE`.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from opd_cache.storage.filestore import FileStore
from opd_cache.storage.integrity import (
    MANIFEST,
    manifest_bytes,
    manifest_for,
)
from opd_cache.storage.layout import (
    COMPLETE_MARKER,
    LATEST,
    PARTITION_RE,
    POLICY,
    QUARANTINE,
    REASON_SUFFIX,
    ROLLOUTS,
    RUN_JSON,
    SHARD_ID_RE,
    TMP_MARKER,
    TRAIN_DONE,
    TRAIN_PROGRESS,
    ShardInfo,
    StoreError,
    complete_marker,
    make_shard_id,
    parse_shard_id,
    partition_name,
    policy_dir,
    policy_version_of,
    quarantine_file,
    quarantine_name,
    quarantine_path,
    tmp_name,
    validate_name,
    validate_worker_id,
)
from opd_cache.storage.listing import ShardListing, ShardTally, ShardWatch
from opd_cache.storage.manifest import ManifestFiles, RunManifest, TeacherRecord

__all__ = [  # the names other modules import from here (they live in layout.py, manifest.py, listing.py)
    "COMPLETE_MARKER",
    "RUN_JSON",
    "SHARD_ID_RE",
    "TMP_MARKER",
    "RunManifest",
    "ShardInfo",
    "ShardTally",
    "ShardWatch",
    "Store",
    "StoreError",
    "TeacherRecord",
    "iter_jsonl",
    "make_shard_id",
    "parse_shard_id",
    "partition_name",
    "validate_name",
    "validate_worker_id",
]


class Store(FileStore):
    """A run's shared storage. Construct with a path or URI; all methods take store-relative paths (layout.py).

    Beside the file operations it inherits, a store has two parts of its own: `manifest` (run.json and the
    teacher records, manifest.py) and `shards` (the listings of shards and parts, listing.py); its own methods
    below cover policy versions, the trainer's status files and quarantine.
    """

    manifest: ManifestFiles
    shards: ShardListing

    def __init__(self, uri: str | os.PathLike, *, s3_endpoint: str | None = None):
        super().__init__(uri, s3_endpoint=s3_endpoint)
        self.manifest = ManifestFiles(self)
        self.shards = ShardListing(self)

    # -------------------------------------------------------------- policy
    def latest_version(self) -> int:
        """Newest published policy version; 0 (the configured student) when nothing was published."""
        try:
            text = self.read_bytes(LATEST).decode().strip()
        except FileNotFoundError:
            return 0
        if not text.isdigit():
            raise StoreError(f"{self.path(LATEST)} holds {text!r}, expected a version number")
        version = int(text)
        if version > 0 and not self.is_published(version):
            raise StoreError(
                f"{self.path(LATEST)} points at version {version} but "
                f"{self.path(policy_dir(version))} is missing or incomplete"
            )
        return version

    def is_published(self, version: int) -> bool:
        """Whether `policy/v<version>` is complete (its `_COMPLETE` marker exists): one HEAD."""
        return self.exists(complete_marker(policy_dir(version)))

    def policy_draft(self, version: int) -> Path | None:
        """A new folder to build `policy/v<version>` in, on a local store's own filesystem (beside the version,
        under a temporary name listings skip), so that `publish_policy(..., draft=True)` moves it into place
        without copying the weights; None for an object store (build in a local temp folder, then upload)."""
        if not self.is_local:
            return None
        folder = self.local_path(tmp_name(policy_dir(version)))
        with self.writing("write", str(folder)):
            folder.mkdir(parents=True)
        return folder

    def publish_policy(
        self, version: int, local_dir: str | os.PathLike, *, point_latest: bool = True, draft: bool = False
    ) -> None:
        """Publish a local HF checkpoint directory as `policy/v<version>` and point LATEST at it.

        The folder gets `_CHECKSUMS.json` (every file's size and xxh3-64) before its `_COMPLETE` marker.
        `point_latest=False` re-publishes an older version whose files were damaged, leaving LATEST alone.
        `draft`: `local_dir` came from `policy_draft(version)` and becomes the version itself (moved, not copied).
        """
        rel = policy_dir(version)
        if self.is_local:
            if not self.is_published(version):
                tmp = Path(local_dir) if draft else self.local_path(tmp_name(rel))
                with self.writing("write", self.path(rel)):
                    try:
                        if not draft:
                            shutil.copytree(local_dir, tmp)
                        (tmp / MANIFEST).write_bytes(manifest_bytes(manifest_for(tmp)))  # before the marker
                        (tmp / COMPLETE_MARKER).write_text(f"{version}\n")
                        self.replace_dir(tmp, rel)  # over a half-made folder of a killed publish
                    except BaseException:
                        shutil.rmtree(tmp, ignore_errors=True)  # e.g. disk full: leave no half copy behind
                        raise
        else:
            self.upload_dir(local_dir, rel)
            self.write_bytes(f"{rel}/{MANIFEST}", manifest_bytes(manifest_for(Path(local_dir))))
            self.write_bytes(complete_marker(rel), f"{version}\n".encode())
        if point_latest:
            self.write_bytes(LATEST, f"{version}\n".encode())

    def policy_versions(self, after: int | None = None) -> list[int]:
        """Published (complete) versions, oldest first; with `after`, only the newer ones, without a listing.

        The full form lists `policy/` and checks every marker (cost ∝ the versions published). A poller that
        remembers the newest version it has seen passes it as `after`: versions are published in order and
        LATEST moves only once a version is complete, so the new ones are (after, LATEST], one GET for LATEST
        and one marker check per new version.
        """
        if after is not None:
            latest = self.latest_version()
            return [v for v in range(max(after, 0) + 1, latest + 1) if v == latest or self.is_published(v)]
        folders = (policy_version_of(name) for name in self.list_dirs(POLICY))
        return sorted(v for v in folders if v is not None and self.is_published(v))

    # ------------------------------------------------------ trainer status
    def read_progress(self) -> dict:
        """train/progress.json, or {} while it is not written yet, or when it cannot be parsed.

        A torn read is retried by `read_json`; a file still unparseable (damaged) counts as not yet written,
        with a warning, since the trainer rewrites it on its next step.
        """
        try:
            progress = self.read_json(TRAIN_PROGRESS, default={})
            problem = (
                None
                if isinstance(progress, dict)
                else f"{self.path(TRAIN_PROGRESS)} holds a {type(progress).__name__}, not an object"
            )
        except StoreError as e:
            problem = str(e)
        if problem is None:
            return progress
        print(
            f"warning: {problem}; treating it as not yet written (the trainer rewrites it every step)", file=sys.stderr
        )
        return {}

    def write_progress(self, progress: dict) -> None:
        self.write_json(TRAIN_PROGRESS, progress)

    def is_done(self) -> bool:
        return self.exists(TRAIN_DONE)

    def mark_done(self, reason: str = "finished") -> None:
        self.write_bytes(TRAIN_DONE, f"{reason}\n".encode())

    def clear_done(self) -> None:
        """Training continues (a larger --max-steps than the finished run's): the stages stop waiting for DONE."""
        self.delete(TRAIN_DONE)

    # ----------------------------------------------------------- quarantine
    def quarantine(self, rel: str, reason: str) -> str:
        """Move a file that failed validation aside, with the reason beside it; returns the new path."""
        dest = quarantine_path(rel)
        self.write_bytes(f"{dest}{REASON_SUFFIX}", f"{rel}: {reason}\n".encode())
        self.move_file(rel, dest)
        return dest

    def list_quarantine(self) -> dict[str, str]:
        out = {}
        for info in self.list_files(QUARANTINE):
            if info.base_name.endswith(REASON_SUFFIX):
                out[info.base_name[: -len(REASON_SUFFIX)]] = (
                    self.read_bytes(self.relative_path(info.path)).decode().strip()
                )
        return out

    def quarantined_names(self) -> set[str]:
        """The names of the files in quarantine/ (one LIST, no reason file read); see `quarantine_path`."""
        return {info.base_name for info in self.list_files(QUARANTINE) if not info.base_name.endswith(REASON_SUFFIX)}

    def quarantined_rollouts(self) -> list[ShardInfo]:
        """The rollout shards in quarantine/ (either layout), from one LIST."""
        shards = []
        prefix = quarantine_name(f"{ROLLOUTS}/")
        for name in self.quarantined_names():
            if not (name.startswith(prefix) and name.endswith(".arrow")):
                continue
            shard_id = name[len(prefix) : -len(".arrow")]
            folder, sep, rest = shard_id.partition(quarantine_name("/"))  # a shard id may hold the separator
            if sep and PARTITION_RE.fullmatch(folder):
                shard_id = rest
            try:
                version, worker, seq = parse_shard_id(shard_id)
            except ValueError:
                continue
            shards.append(ShardInfo(version, worker, seq, shard_id, quarantine_file(name)))
        return sorted(shards)


def iter_jsonl(data: bytes) -> Iterator[dict]:
    for line in io.BytesIO(data):
        line = line.strip()
        if line:
            yield json.loads(line)
