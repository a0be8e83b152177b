"""Atomic file I/O over `pyarrow.fs`: the part of the store that knows files, not what they hold.

Everything goes through `pyarrow.fs`, so a local directory, `file://…` and
`s3://bucket/prefix` (or any other URI pyarrow understands) share one code path.
Atomicity. A reader must never see a partial file, even if the writer is
SIGKILLed mid-write. On a local filesystem we write `<name>.tmp-<random>` and
rename it over the final name (rename is atomic on POSIX). On object stores a
single PUT or a completed multipart upload is atomic and an interrupted upload
is never visible, so we write the final key directly. Every listing ignores
`*.tmp-*` names. Checkpoint directories cannot be renamed atomically on object
stores, so a version counts as published only once its `_COMPLETE` marker
exists (written last), and LATEST is replaced only after that.

Local directory or object store: only this package asks (`is_local`). The rest of the project asks what it
needs: `appends_in_place` (the metrics log), `atomic_create` (the annotate leases), `on_this_machine` (can
other machines see it), `local_dir(rel)` (a folder to read in place, e.g. a checkpoint; `replace_dir` moves a
folder staged there into place), and uses methods that work on both: `move_file`, `open_atomic_output`.
The S3 endpoint is the `s3_endpoint` argument (the configuration's `store.s3_endpoint`), never read from the
environment here.

Wake-ups (opd_cache/storage/bells.py): on a local store each of those publishing writes also rings the bell of
its top folder, so that a stage waiting on it wakes at once instead of at its next poll.

Integrity (opd_cache/storage/integrity.py): shards end with an xxh3-64 trailer, checkpoint folders hold
`_CHECKSUMS.json` (written before `_COMPLETE`); `read_buffer` hands readers a whole file in one read so
they can verify it before use, and `verify_folder` checks a folder against its manifest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from opd_cache.storage.bells import Bell, ring
from opd_cache.storage.integrity import (
    MANIFEST,
    ChecksumError,
    FileProblem,
    check_file,
    parse_manifest,
    verify_local_folder,
)
from opd_cache.storage.layout import StoreError, is_tmp, tmp_name


def _os_reason(e: OSError) -> str:
    """'No space left on device', 'Read-only file system', ... rather than a library's whole report."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        return str(e.args[0][0][-1])  # copytree: [(src, dst, why), ...]
    return os.strerror(e.errno) if e.errno else str(e)


class FileStore:
    """Files under a root (a path or URI); all methods take paths relative to it. `Store` adds the run's layout."""

    def __init__(self, uri: str | os.PathLike, *, s3_endpoint: str | None = None):
        self.uri = str(uri)
        self.fs, self.root = _filesystem_for(self.uri, s3_endpoint)
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        self.root = self.root.rstrip("/")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def bell(self, *topics: str) -> Bell:
        """What a waiting stage waits on: a write under one of these top folders, or its poll (storage/bells.py)."""
        return Bell(self, topics)

    # ------------------------------------------------------------------ paths
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def relative_path(self, full: str) -> str:
        """The store-relative path of a full path from a listing (`info.path` of `list_files`)."""
        return full[len(self.root) + 1 :]

    def local_path(self, rel: str) -> Path:
        """The OS path of a store file; only for local stores (e.g. to hand a checkpoint to from_pretrained)."""
        if not self.is_local:
            raise StoreError(f"{self.uri} is not a local store; download {rel} first")
        return Path(self.path(rel))

    def local_dir(self, rel: str) -> Path | None:
        """The OS path of `rel` when the store is a local directory, None on an object store.

        What a caller uses to read a folder in place (a checkpoint for `from_pretrained`, without a download)
        or to have a library write into the store (TensorBoard); on an object store it downloads, or writes
        elsewhere.
        """
        return Path(self.path(rel)) if self.is_local else None

    # ---------------------------------------------------- what the backend can do
    @property
    def appends_in_place(self) -> bool:
        """Whether a file can grow by `append_bytes` (a local directory); an object store replaces whole objects."""
        return self.is_local

    @property
    def atomic_create(self) -> bool:
        """Whether `create_if_absent` is atomic (local: `os.link`).

        On an object store it is HEAD, then PUT: two writers racing inside that window both get True, and a
        writer that must know whether its file is the one that stayed reads it back.
        """
        return self.is_local

    @property
    def on_this_machine(self) -> bool:
        """Whether the store is a directory of this machine: other machines see it only through a shared mount.

        An object store is reachable from every machine that has its address and credentials.
        """
        return self.is_local

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
        with self.writing("write", final):
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
            tmp = tmp_name(final)
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
                ring(self.root, rel)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise

    @contextlib.contextmanager
    def writing(self, action: str, full: str):
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
        tmp = tmp_name(final)
        with self.writing("write", final):
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, final)
                ring(self.root, rel)
                return True
            except FileExistsError:
                return False
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def append_bytes(self, rel: str, data: bytes) -> None:
        """Append `data` to `rel` (created if absent) in one write; only where `appends_in_place`.

        One `write` call with O_APPEND: a concurrent reader sees all of `data` or none of it. A short write
        (disk full) is finished by further writes, so a reader may then see a cut line at the end.
        """
        if not self.appends_in_place:
            raise StoreError(f"{self.uri} is an object store: {rel} cannot be appended to, write a new object")
        path = self.path(rel)
        with self.writing("append to", path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, data)
                if written != len(data):
                    view = memoryview(data)[written:]
                    while view:
                        view = view[os.write(fd, view) :]
            finally:
                os.close(fd)

    def open_atomic_output(self, rel: str) -> AtomicOutput:
        """A stream for a file too large to build in memory, published whole by `commit()` (see AtomicOutput).

        The folder must exist (`make_dir`).
        """
        on_commit = (lambda: ring(self.root, rel)) if self.is_local else None
        return AtomicOutput(self.fs, self.path(rel), aside=self.is_local, on_commit=on_commit)

    def move_file(self, old: str, new: str) -> None:
        """Move a file to `new` (replacing a file there).

        Local stores: one atomic rename. Object stores: copy, then delete; a move cut short in between leaves
        both files, and moving again finishes it. FileNotFoundError when `old` is gone (moved by another process).
        """
        self._makedirs(self.path(new).rsplit("/", 1)[0])
        if self.is_local:
            os.replace(self.path(old), self.path(new))
            ring(self.root, new)
        else:
            self.fs.copy_file(self.path(old), self.path(new))
            self.fs.delete_file(self.path(old))

    def replace_dir(self, staged: str | os.PathLike, rel: str) -> None:
        """Move a finished folder built at `staged` into place as `rel`; only for a local store.

        `staged` lies on the store's filesystem (beside `rel`: `local_dir(tmp_name(rel))`), so the move is one
        rename; a folder left at `rel` by a killed writer (no `_COMPLETE` marker) is removed first.
        """
        final = self.local_path(rel)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)
        ring(self.root, rel)

    def make_dir(self, rel: str) -> None:
        """Create the folder `rel` and its parents; nothing to do on an object store, which has no folders."""
        self._makedirs(self.path(rel))

    def delete(self, rel: str) -> None:
        with self.writing("delete", self.path(rel)), contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path(rel))

    def delete_dir(self, rel: str) -> None:
        with self.writing("delete", self.path(rel)), contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(self.path(rel))

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
                if not is_tmp(name):
                    continue
                path = Path(folder) / name
                try:
                    if path.lstat().st_mtime > cutoff:
                        continue
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                except FileNotFoundError:  # another process swept it first
                    continue
                removed.append(str(path.relative_to(root)))
            dirs[:] = [d for d in dirs if not is_tmp(d)]  # removed, or too young: nothing to look at inside
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
        return [i for i in infos if i.type == pafs.FileType.File and not is_tmp(i.path)]

    def modified_times(self, rel: str) -> dict[str, int]:
        """Base name -> modification time (ns) of the complete files directly under `rel`, from one LIST.

        The time is the store's: the server's clock on an object store (S3, GCS: LastModified, to the second),
        this machine's on a local directory. So times written by different machines compare without trusting
        their clocks (the rollout claims' order, rollout/pacing.py). Equal times are possible (a coarse clock).
        """
        return {info.base_name: info.mtime_ns for info in self.list_files(rel) if info.mtime_ns is not None}

    def list_dirs(self, rel: str) -> list[str]:
        sel = pafs.FileSelector(self.path(rel), allow_not_found=True)
        return sorted(
            i.base_name
            for i in self.fs.get_file_info(sel)
            if i.type == pafs.FileType.Directory and not is_tmp(i.base_name)
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
            target.write_bytes(self.read_bytes(self.relative_path(info.path)))
        return local_dir

    def _makedirs(self, full_dir: str) -> None:
        if self.is_local:
            try:
                os.makedirs(full_dir, exist_ok=True)
            except PermissionError as e:
                raise StoreError(f"store {self.uri} is not writable: cannot create {full_dir} ({e.strerror})") from e
        # object stores have no directories to create

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


class AtomicOutput:
    """A file written as a stream and published whole: readers never see it until `commit()`.

    Local stores: the stream writes a temporary name beside the file (every listing skips it), `commit`
    renames it into place and `abort` removes it. Object stores: the stream is the upload of the final key,
    invisible until it completes; `commit` and `abort` both close the stream (pyarrow offers no way to
    cancel an upload).
    """

    def __init__(self, fs: pafs.FileSystem, final: str, *, aside: bool, on_commit=None):
        self.fs, self.final, self.aside, self.on_commit = fs, final, aside, on_commit
        self.path = tmp_name(final) if aside else final
        self.stream = fs.open_output_stream(self.path)

    def commit(self) -> None:
        self.stream.close()
        if self.aside:
            self.fs.move(self.path, self.final)
        if self.on_commit is not None:
            self.on_commit()

    def abort(self) -> None:
        try:
            self.stream.close()
        finally:
            if self.aside:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.delete_file(self.path)


def _filesystem_for(uri: str, s3_endpoint: str | None) -> tuple[pafs.FileSystem, str]:
    """Resolve a path or URI to (filesystem, root path inside it).

    `s3_endpoint` is the configuration's `store.s3_endpoint` (config.py resolves it, environment included);
    nothing here reads the endpoint from anywhere else. Without it pyarrow opens the URI as it would anywhere.
    """
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    if uri.startswith("s3://") and s3_endpoint:
        # S3-compatible servers (MinIO, moto, Ceph): pyarrow needs the endpoint and scheme split apart.
        scheme, _, host = s3_endpoint.partition("://")
        if not host:
            scheme, host = "https", s3_endpoint
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
