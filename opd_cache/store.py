"""Shared dataset storage: the only thing the three stages have in common.

Everything goes through `pyarrow.fs`, so a local directory, `file://…` and
`s3://bucket/prefix` (or any other URI pyarrow understands) share one code path.

Layout (DESIGN.md §2):

    <root>/run.json                               run manifest, created once
    <root>/rollouts/v000003/<shard_id>.arrow              written by `opd rollout`
    <root>/annotated/v000003/<shard_id>/<teacher>.arrow   written by `opd annotate`
    (v000003: the shard's policy version, so a poll lists only the versions it can use; see ShardWatch)
    <root>/policy/v000003/                        HF checkpoint published by `opd train`
    <root>/policy/LATEST                          newest complete version number
    <root>/train/progress.json, train/DONE, train/state/, train/consumed/
    <root>/metrics/<stage>-<worker>.jsonl
    <root>/quarantine/<name> + <name>.reason.txt

Atomicity. A reader must never see a partial file, even if the writer is
SIGKILLed mid-write. On a local filesystem we write `<name>.tmp-<random>` and
rename it over the final name (rename is atomic on POSIX). On object stores a
single PUT or a completed multipart upload is atomic and an interrupted upload
is never visible, so we write the final key directly. Every listing ignores
`*.tmp-*` names. Checkpoint directories cannot be renamed atomically on object
stores, so a version counts as published only once its `_COMPLETE` marker
exists (written last), and LATEST is replaced only after that.

Integrity (opd_cache/integrity.py): shards end with an xxh3-64 trailer, checkpoint folders hold
`_CHECKSUMS.json` (written before `_COMPLETE`); `read_buffer` hands readers a whole file in one read so
they can verify it before use, and `verify_folder` checks a folder against its manifest.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from opd_cache.integrity import (
    MANIFEST,
    ChecksumError,
    FileProblem,
    check_file,
    manifest_bytes,
    manifest_for,
    parse_manifest,
    verify_local_folder,
)

SHARD_ID_RE = re.compile(r"^v(?P<version>\d{6})-(?P<worker>[A-Za-z0-9_]{1,32})-(?P<seq>\d{6})$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
TMP_MARKER = ".tmp-"
COMPLETE_MARKER = "_COMPLETE"


class StoreError(RuntimeError):
    """A problem with the shared store that the user must fix (message names the path)."""


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


def _is_tmp(name: str) -> bool:
    return TMP_MARKER in name


def _os_reason(e: OSError) -> str:
    """'No space left on device', 'Read-only file system', ... rather than a library's whole report."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        return str(e.args[0][0][-1])  # copytree: [(src, dst, why), ...]
    return os.strerror(e.errno) if e.errno else str(e)


class Store:
    """A run's shared storage. Construct with a path or URI; all methods take store-relative paths."""

    def __init__(self, uri: str | os.PathLike, *, s3_endpoint: str | None = None):
        self.uri = str(uri)
        self.fs, self.root = _filesystem_for(self.uri, s3_endpoint)
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        self.root = self.root.rstrip("/")

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    # ------------------------------------------------------------------ paths
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def rollout_path(self, shard_id: str) -> str:
        version, _, _ = parse_shard_id(shard_id)
        return f"rollouts/{partition_name(version)}/{shard_id}.arrow"

    def annotated_path(self, shard_id: str, teacher: str) -> str:
        version, _, _ = parse_shard_id(shard_id)
        validate_name("teacher name", teacher)
        return f"annotated/{partition_name(version)}/{shard_id}/{teacher}.arrow"

    def policy_dir(self, version: int) -> str:
        return f"policy/v{version:06d}"

    def local_path(self, rel: str) -> Path:
        """The OS path of a store file; only for local stores (e.g. to hand a checkpoint to from_pretrained)."""
        if not self.is_local:
            raise StoreError(f"{self.uri} is not a local store; download {rel} first")
        return Path(self.path(rel))

    # ------------------------------------------------------------ basic I/O
    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def read_bytes(self, rel: str) -> bytes:
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            if "not found" in str(e).lower() or "does not exist" in str(e).lower():
                raise FileNotFoundError(f"{self.path(rel)} does not exist") from e
            raise StoreError(f"cannot read {self.path(rel)}: {e}") from e

    def read_json(self, rel: str, default: Any = None, attempts: int = 3) -> Any:
        """A JSON file, or `default` when it does not exist.

        Small JSON files (run.json, progress.json) are overwritten in place. On object stores pyarrow reads a
        file with a HEAD (its size) then a ranged GET, so a read that races an overwrite can get a torn mix of
        two versions: the new content cut to the old size, or padded to it ("Extra data", a decode error).
        Such a read is transient, so one that does not parse is retried before it counts as damage.
        """
        for attempt in range(attempts):
            try:
                data = self.read_bytes(rel)
            except FileNotFoundError:
                return default
            try:
                return json.loads(data)
            except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError on undecodable bytes
                problem = e
            if attempt + 1 < attempts:
                time.sleep(0.05 * (attempt + 1))
        raise StoreError(f"{self.path(rel)} is not valid JSON: {problem}") from problem

    def read_buffer(self, rel: str) -> pa.Buffer:
        """The whole file as one buffer: a memory map on local stores (zero-copy), one GET on object stores."""
        if self.is_local:
            with pa.memory_map(self.path(rel), "r") as source:
                return source.read_buffer()
        return pa.py_buffer(self.read_bytes(rel))

    def open_input_file(self, rel: str) -> pa.NativeFile:
        """Random-access handle; memory-mapped on local stores so Arrow reads are zero-copy."""
        full = self.path(rel)
        if self.is_local:
            return pa.memory_map(full, "r")
        return self.fs.open_input_file(full)

    def write_atomic(self, rel: str, write_fn) -> None:
        """Publish `rel` atomically; `write_fn(stream)` writes the content to an output stream."""
        final = self.path(rel)
        parent = final.rsplit("/", 1)[0]
        with self._writing("write", final):
            self._makedirs(parent)
            if not self.is_local:
                # A single PUT / completed multipart upload is atomic; an aborted one is never visible. But
                # closing an S3 stream completes the upload with whatever was written, also when write_fn
                # raised (a second Ctrl-C, an error half-way): produce the content in memory first.
                sink = pa.BufferOutputStream()
                write_fn(sink)
                data = sink.getvalue()
                with self.fs.open_output_stream(final) as out:
                    out.write(data)
                return
            tmp = f"{final}{TMP_MARKER}{secrets.token_hex(6)}"
            try:
                with self.fs.open_output_stream(tmp) as out:
                    write_fn(out)
                # fsync the data before the rename so a power cut cannot expose an empty file
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, final)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise

    @contextlib.contextmanager
    def _writing(self, action: str, full: str):
        """A failed write (disk full, read-only store, no permission, unreachable) as one StoreError naming the file.

        The atomic writes above leave the previous version of the file untouched, so the message is all there is.
        """
        try:
            yield
        except StoreError:
            raise
        except OSError as e:
            raise StoreError(f"cannot {action} {full}: {_os_reason(e)} (store {self.uri})") from e

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.write_atomic(rel, lambda out: out.write(data))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def create_if_absent(self, rel: str, data: bytes) -> bool:
        """Write `rel` only if nobody has; returns True when this call created it.

        Local: `os.link` of a complete temporary file is an atomic create-if-absent.
        Object stores have no portable conditional PUT in pyarrow, so two writers
        racing in the same instant may both write; the caller re-reads the file
        and adopts what it finds (last writer wins, both then agree).
        """
        final = self.path(rel)
        self._makedirs(final.rsplit("/", 1)[0])
        if not self.is_local:
            if self.exists(rel):
                return False
            self.write_bytes(rel, data)
            return True
        tmp = f"{final}{TMP_MARKER}{secrets.token_hex(6)}"
        with self._writing("write", final):
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, final)
                return True
            except FileExistsError:
                return False
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def delete(self, rel: str) -> None:
        with self._writing("delete", self.path(rel)):
            try:
                self.fs.delete_file(self.path(rel))
            except FileNotFoundError:
                pass

    def delete_dir(self, rel: str) -> None:
        with self._writing("delete", self.path(rel)):
            try:
                self.fs.delete_dir(self.path(rel))
            except FileNotFoundError:
                pass

    def remove_stale_tmp(self, older_than_s: float = 3600.0) -> list[str]:
        """Delete the `*.tmp-*` files and folders that killed writers left, once older than `older_than_s`.

        Only local stores have them (an object store never shows an unfinished upload). Every listing
        ignores them already; this frees the space. The age threshold keeps the temporary files of writers
        that are still running: a write lasts seconds, the default waits an hour. Returns what was removed.
        """
        if not self.is_local:
            return []
        root, cutoff, removed = Path(self.root), time.time() - older_than_s, []
        for folder, dirs, files in os.walk(root):
            for name in [*dirs, *files]:
                if not _is_tmp(name):
                    continue
                path = Path(folder) / name
                try:
                    if path.lstat().st_mtime > cutoff:
                        continue
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                except FileNotFoundError:  # another process swept it first
                    continue
                removed.append(str(path.relative_to(root)))
            dirs[:] = [d for d in dirs if not _is_tmp(d)]  # removed, or too young: nothing to look at inside
        return removed

    def list_files(self, rel: str, recursive: bool = False) -> list[pafs.FileInfo]:
        """Complete files under `rel` (never `*.tmp-*`); empty when `rel` does not exist."""
        sel = pafs.FileSelector(self.path(rel), allow_not_found=True, recursive=recursive)
        for attempt in range(3):
            try:
                infos = self.fs.get_file_info(sel)
                break
            except FileNotFoundError:  # local: a `*.tmp-*` renamed or removed while a recursive listing read it
                if attempt == 2:
                    raise
        return [i for i in infos if i.type == pafs.FileType.File and not _is_tmp(i.path)]

    def list_dirs(self, rel: str) -> list[str]:
        sel = pafs.FileSelector(self.path(rel), allow_not_found=True)
        return sorted(
            i.base_name
            for i in self.fs.get_file_info(sel)
            if i.type == pafs.FileType.Directory and not _is_tmp(i.base_name)
        )

    def upload_dir(self, local_dir: str | os.PathLike, rel: str) -> None:
        """Copy a local directory's files into the store under `rel` (each file atomically)."""
        local_dir = Path(local_dir)
        for p in sorted(local_dir.rglob("*")):
            if p.is_file():
                data = p.read_bytes()
                self.write_bytes(f"{rel}/{p.relative_to(local_dir).as_posix()}", data)

    def download_dir(self, rel: str, local_dir: str | os.PathLike) -> Path:
        local_dir = Path(local_dir)
        prefix = self.path(rel) + "/"
        for info in self.list_files(rel, recursive=True):
            name = info.path[len(prefix) :]
            if any(part in ("", ".", "..") for part in name.split("/")):
                # an object key like "policy/v000003/../../x" must not write outside `local_dir`
                raise StoreError(f"{info.path}: refusing to download a file whose name leaves {self.path(rel)}")
            target = local_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.read_bytes(info.path[len(self.root) + 1 :]))
        return local_dir

    def _makedirs(self, full_dir: str) -> None:
        if self.is_local:
            try:
                os.makedirs(full_dir, exist_ok=True)
            except PermissionError as e:
                raise StoreError(f"store {self.uri} is not writable: cannot create {full_dir} ({e.strerror})") from e
        # object stores have no directories to create

    # ----------------------------------------------------------- run manifest
    def read_run(self) -> dict | None:
        return self.read_json("run.json")

    def ensure_run(self, **fields: Any) -> dict:
        """Create run.json on first touch, else check `fields` against it and fill the missing ones."""
        fields = {k: v for k, v in fields.items() if v is not None}
        run = self.read_run()
        if run is None:
            new = {
                "run_id": uuid.uuid4().hex[:12],
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "schema_version": _schema_version(),
                **fields,
            }
            self.create_if_absent("run.json", (json.dumps(new, indent=2, sort_keys=True) + "\n").encode())
            run = self.read_run()
        self.check_run(run, **fields)
        missing = {key: value for key, value in fields.items() if key not in run}
        if missing:
            run = {**run, **missing}
            self.write_json("run.json", run)
        return run

    def check_run(self, run: dict, **fields: Any) -> None:
        """A field recorded in `run` with a different value is a contradiction (the store belongs to another
        run / tokenizer / top-k): raise, naming both. Fields that are None or not recorded yet pass."""
        for key, value in fields.items():
            if value is not None and key in run and run[key] != value:
                raise StoreError(
                    f"{self.path('run.json')}: {key} is {run[key]!r} in this store but {value!r} was given; "
                    f"use a new store for a different {key}, or drop the option to use the store's value"
                )

    def require_run(self) -> dict:
        run = self.read_run()
        if run is None:
            raise StoreError(f"{self.path('run.json')} does not exist: run `opd rollout` on this store first")
        return run

    # ------------------------------------------------------------ rollouts
    def list_rollout_shards(self, versions: Iterable[int] | None = None) -> list[ShardInfo]:
        """Rollout shards, sorted; of the given policy-version partitions only (one LIST each), else all of them.

        The full listing (one recursive LIST of `rollouts/`, cost ∝ the run's history) is for replay, export,
        inspect and verify, and for a stage's first poll; polling stages use `ShardWatch`. It also finds shards
        of the flat layout that preceded the partitions (`rollouts/<shard_id>.arrow`, see `opd migrate`).
        """
        if versions is None:
            infos = self.list_files("rollouts", recursive=True)
        else:
            infos = [i for v in sorted(set(versions)) for i in self.list_files(f"rollouts/{partition_name(v)}")]
        prefix = self.path("rollouts") + "/"
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
            shards.append(ShardInfo(version, worker, seq, shard_id, f"rollouts/{rel}", info.size))
        return sorted(shards)

    def list_annotated_parts(self, versions: Iterable[int] | None = None) -> dict[str, set[str]]:
        """shard_id -> names of the teachers whose part exists; of the given partitions only, else all."""
        if versions is None:
            infos = self.list_files("annotated", recursive=True)
        else:
            infos = [
                i
                for v in sorted(set(versions))
                for i in self.list_files(f"annotated/{partition_name(v)}", recursive=True)
            ]
        parts: dict[str, set[str]] = {}
        prefix = self.path("annotated") + "/"
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
        flat = [s.path for s in shards if s.path != self.rollout_path(s.shard_id)]
        if not flat:
            return None
        return (
            f"{self.path(flat[0])} and {len(flat) - 1} more shards are in the flat layout of earlier opd_cache "
            f"versions (rollouts/<shard>.arrow); run `opd migrate --store {self.uri}` once, "
            f"with no stage running"
        )

    def list_dataset(self) -> tuple[list[ShardInfo], dict[str, set[str]]]:
        """Every rollout shard and annotated part (full listings), for the readers of a whole store (export,
        inspect, replay); a store still in the flat layout is refused with the `opd migrate` hint."""
        shards = self.list_rollout_shards()
        hint = self.legacy_layout_hint(shards)
        if hint:
            raise StoreError(hint)
        return shards, self.list_annotated_parts()

    # ------------------------------------------------ checkpoint folder checksums
    def verify_folder(self, rel: str) -> list[FileProblem] | None:
        """Check a checkpoint folder (policy version, resume state) against its `_CHECKSUMS.json`.

        Returns the damaged or missing files (empty: intact), or None for a folder written before manifests.
        """
        if self.is_local:
            return verify_local_folder(self.local_path(rel))
        try:
            manifest = self.read_bytes(f"{rel}/{MANIFEST}")
        except FileNotFoundError:
            return None
        try:
            files = parse_manifest(manifest, self.path(f"{rel}/{MANIFEST}"))
        except ChecksumError as e:
            return [FileProblem(MANIFEST, "corrupt", str(e))]
        problems = []
        for name, entry in sorted(files.items()):
            try:
                data = self.read_bytes(f"{rel}/{name}")
            except FileNotFoundError:
                data = None
            problem = check_file(name, data, entry, self.path(f"{rel}/{name}"))
            if problem:
                problems.append(problem)
        return problems

    # -------------------------------------------------------------- policy
    def latest_version(self) -> int:
        """Newest published policy version; 0 (the configured student) when nothing was published."""
        try:
            text = self.read_bytes("policy/LATEST").decode().strip()
        except FileNotFoundError:
            return 0
        if not text.isdigit():
            raise StoreError(f"{self.path('policy/LATEST')} holds {text!r}, expected a version number")
        version = int(text)
        if version > 0 and not self.exists(f"{self.policy_dir(version)}/{COMPLETE_MARKER}"):
            raise StoreError(
                f"{self.path('policy/LATEST')} points at version {version} but "
                f"{self.path(self.policy_dir(version))} is missing or incomplete"
            )
        return version

    def publish_policy(self, version: int, local_dir: str | os.PathLike, *, point_latest: bool = True) -> None:
        """Publish a local HF checkpoint directory as `policy/v<version>` and point LATEST at it.

        The folder gets `_CHECKSUMS.json` (every file's size and xxh3-64) before its `_COMPLETE` marker.
        `point_latest=False` re-publishes an older version whose files were damaged, leaving LATEST alone.
        """
        rel = self.policy_dir(version)
        if self.is_local:
            final = self.local_path(rel)
            if not (final / COMPLETE_MARKER).exists():
                tmp = Path(f"{final}{TMP_MARKER}{secrets.token_hex(6)}")
                with self._writing("write", str(final)):
                    try:
                        shutil.copytree(local_dir, tmp)
                        (tmp / MANIFEST).write_bytes(manifest_bytes(manifest_for(tmp)))  # before the marker
                        (tmp / COMPLETE_MARKER).write_text(f"{version}\n")
                        if final.exists():  # a half-made directory from a killed publish without marker
                            shutil.rmtree(final)
                        os.replace(tmp, final)
                    except BaseException:
                        shutil.rmtree(tmp, ignore_errors=True)  # e.g. disk full: leave no half copy behind
                        raise
        else:
            self.upload_dir(local_dir, rel)
            self.write_bytes(f"{rel}/{MANIFEST}", manifest_bytes(manifest_for(Path(local_dir))))
            self.write_bytes(f"{rel}/{COMPLETE_MARKER}", f"{version}\n".encode())
        if point_latest:
            self.write_bytes("policy/LATEST", f"{version}\n".encode())

    def policy_versions(self, after: int | None = None) -> list[int]:
        """Published (complete) versions, oldest first; with `after`, only the newer ones, without a listing.

        The full form lists `policy/` and checks every marker (cost ∝ the versions published). A poller that
        remembers the newest version it has seen passes it as `after`: versions are published in order and
        LATEST moves only once a version is complete, so the new ones are (after, LATEST], one GET for LATEST
        and one marker check per new version.
        """
        if after is not None:
            latest = self.latest_version()
            return [
                v
                for v in range(max(after, 0) + 1, latest + 1)
                if v == latest or self.exists(f"{self.policy_dir(v)}/{COMPLETE_MARKER}")
            ]
        versions = []
        for name in self.list_dirs("policy"):
            if PARTITION_RE.fullmatch(name) and self.exists(f"policy/{name}/{COMPLETE_MARKER}"):
                versions.append(int(name[1:]))
        return sorted(versions)

    # ------------------------------------------------------ trainer status
    def read_progress(self) -> dict:
        """train/progress.json, or {} while it is not written yet, or when it cannot be parsed.

        A torn read is retried by `read_json`; a file still unparseable (damaged) counts as not yet written,
        with a warning, since the trainer rewrites it on its next step.
        """
        try:
            progress = self.read_json("train/progress.json", default={})
            problem = (
                None
                if isinstance(progress, dict)
                else f"{self.path('train/progress.json')} holds a {type(progress).__name__}, not an object"
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
        self.write_json("train/progress.json", progress)

    def is_done(self) -> bool:
        return self.exists("train/DONE")

    def mark_done(self, reason: str = "finished") -> None:
        self.write_bytes("train/DONE", f"{reason}\n".encode())

    # ----------------------------------------------------------- quarantine
    def quarantine(self, rel: str, reason: str) -> str:
        """Move a file that failed validation aside, with the reason beside it; returns the new path."""
        name = rel.replace("/", "__")
        dest = f"quarantine/{name}"
        self._makedirs(self.path("quarantine"))
        self.write_bytes(f"{dest}.reason.txt", f"{rel}: {reason}\n".encode())
        if self.is_local:
            os.replace(self.path(rel), self.path(dest))
        else:
            self.fs.copy_file(self.path(rel), self.path(dest))
            self.fs.delete_file(self.path(rel))
        return dest

    def list_quarantine(self) -> dict[str, str]:
        out = {}
        for info in self.list_files("quarantine"):
            if info.base_name.endswith(".reason.txt"):
                out[info.base_name[: -len(".reason.txt")]] = (
                    self.read_bytes(f"quarantine/{info.base_name}").decode().strip()
                )
        return out


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

    def __init__(self, store: Store, *, parts: bool = False):
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
            shards = self.store.list_rollout_shards()
            hint = self.store.legacy_layout_hint(shards)
            if hint:
                raise StoreError(hint)
            parts = self.store.list_annotated_parts() if self.with_parts else {}
            self.listed_below = low
        else:
            start = min(self.listed_below, low)
            versions = list(range(start, high + 1))
            if start > 0:
                old = self._sweep % start
                self._sweep = old + 1
                versions.append(old)
            shards = self.store.list_rollout_shards(versions)
            parts = self.store.list_annotated_parts(versions) if self.with_parts else {}
            self.listed_below = max(self.listed_below, low)
        self.shards, self.parts = shards, parts
        self.polls += 1
        return shards


class ShardTally:
    """Every shard and part seen so far, for displays (`opd run`'s dashboard), at the cost of a ShardWatch poll.

    `poll()` returns what `list_rollout_shards()` and `list_annotated_parts()` would (sorted shards, parts
    by shard), but after the first call lists only the last `window` versions (and the watch's sweep) below
    LATEST. A file moved away later (quarantined) stays counted: this is a tally, not a listing.
    """

    def __init__(self, store: Store, window: int = 4):
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


def _schema_version() -> int:
    from opd_cache.schema import SCHEMA_VERSION

    return SCHEMA_VERSION


def _filesystem_for(uri: str, s3_endpoint: str | None) -> tuple[pafs.FileSystem, str]:
    """Resolve a path or URI to (filesystem, root path inside it)."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    endpoint = s3_endpoint or os.environ.get("OPD_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    if uri.startswith("s3://") and endpoint:
        # S3-compatible servers (MinIO, moto, Ceph): pyarrow needs the endpoint and scheme split apart.
        scheme, _, host = endpoint.partition("://")
        if not host:
            scheme, host = "https", endpoint
        fs = pafs.S3FileSystem(
            endpoint_override=host,
            scheme=scheme,
            region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
            allow_bucket_creation=True,
            connect_timeout=5,
            request_timeout=30,
        )
        return fs, uri[len("s3://") :]
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as e:
        raise StoreError(f"cannot open store {uri}: {e}") from e


def iter_jsonl(data: bytes) -> Iterator[dict]:
    for line in io.BytesIO(data):
        line = line.strip()
        if line:
            yield json.loads(line)
