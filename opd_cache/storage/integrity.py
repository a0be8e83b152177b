"""Content checksums of every stored file a stage reads back: computed at write, verified before use.

Arrow IPC carries no checksum and neither do safetensors or DCP files, so a flipped byte (a bad disk, a
truncated copy, a faulty transfer) would otherwise reach a loss as garbage. Two containers, both xxh3-64
(`xxhash`, GB/s per core, far below the cost of decoding):

* **Shards** (rollout shards, annotated parts) end with a 24-byte *trailer* after the Arrow stream's
  end-of-stream marker: `xxh3_64(payload) | len(payload) | b"OPDXXH3\\x01"`, little-endian. A reader gets
  file and checksum in one read (one GET on S3); Arrow readers stop at the end-of-stream marker, so
  `datasets`, `pyarrow`, `polars` and `duckdb` still read the file as before. The stream's schema metadata
  says `opd.checksum = xxh3_64-trailer`, so a file truncated by exactly its trailer is caught too.
* **Checkpoint folders** (policy versions, resume states) get `_CHECKSUMS.json` listing every file's size and
  xxh3-64, written *before* `_COMPLETE`: a folder counts as complete only with its manifest in place.

Files written before checksums existed (no trailer and no `opd.checksum` key; a folder without manifest) are
still read, with one warning per process (`legacy_warning`).
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import xxhash

from opd_cache.storage.layout import (
    ANNOTATED,
    COMPLETE_MARKER,
    POLICY,
    QUARANTINE,
    REASON_SUFFIX,
    ROLLOUTS,
    TRAIN_STATE,
)

ALGORITHM = "xxh3_64"
TRAILER_MAGIC = b"OPDXXH3\x01"
TRAILER = struct.Struct("<QQ8s")  # checksum, payload length, magic
TRAILER_SIZE = TRAILER.size  # 24
META_CHECKSUM = "opd.checksum"  # shard schema metadata key: how the file is checksummed
TRAILER_KIND = f"{ALGORITHM}-trailer"
MANIFEST = "_CHECKSUMS.json"


class ChecksumError(ValueError):
    """Stored bytes that differ from what was written: the message names the file, stored and computed values."""

    def __init__(self, where: str, detail: str, *, stored: str | None = None, computed: str | None = None):
        self.where, self.detail, self.stored, self.computed = where, detail, stored, computed
        super().__init__(f"{where} {detail}")


def checksum(data) -> str:
    """xxh3-64 of a bytes-like object (a pyarrow Buffer or memory map works without a copy), as 16 hex digits."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def failed(where: str, stored: str, computed: str) -> ChecksumError:
    return ChecksumError(
        where, f"failed its checksum (stored {stored}, computed {computed})", stored=stored, computed=computed
    )


# ---------------------------------------------------------------- shards: the trailer
def trailer(payload) -> bytes:
    return TRAILER.pack(xxhash.xxh3_64_intdigest(payload), len(payload), TRAILER_MAGIC)


class HashingWriter:
    """A write-only file object that checksums what passes through to `out` (wrap it in `pa.PythonFile`), so a
    shard is hashed while it is written, without building it in memory first."""

    def __init__(self, out):
        self.out, self.hasher, self.size, self.closed = out, xxhash.xxh3_64(), 0, False

    def write(self, data) -> int:
        self.hasher.update(data)
        self.size += len(data)
        self.out.write(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:  # the Arrow writer closing its sink must not close `out`: the trailer follows
        self.closed = True

    def trailer(self) -> bytes:
        return TRAILER.pack(self.hasher.intdigest(), self.size, TRAILER_MAGIC)


def split_trailer(data, where: str):
    """(payload, True) for a file with a valid trailer, (data, False) for one without; raises ChecksumError.

    `data` is a pyarrow Buffer (or bytes); the payload is a zero-copy slice of it.
    """
    size = len(data)
    if size < TRAILER_SIZE or bytes(data[size - len(TRAILER_MAGIC) :]) != TRAILER_MAGIC:
        return data, False
    stored, length, _ = TRAILER.unpack(bytes(data[size - TRAILER_SIZE :]))
    payload = data[: size - TRAILER_SIZE]
    computed = xxhash.xxh3_64_intdigest(payload)
    if length != len(payload):
        raise ChecksumError(
            where,
            f"failed its checksum (trailer records {length} bytes, file has {len(payload)}: truncated or spliced)",
            stored=f"{stored:016x}",
            computed=f"{computed:016x}",
        )
    if computed != stored:
        raise failed(where, f"{stored:016x}", f"{computed:016x}")
    return payload, True


def missing_trailer(where: str, size: int) -> ChecksumError:
    return ChecksumError(
        where,
        f"failed its checksum (its metadata says {TRAILER_KIND} but the {size}-byte file "
        f"has no valid trailer: truncated, or its last bytes are damaged)",
        stored="missing",
        computed="-",
    )


# ---------------------------------------------------------------- folders: the manifest
def manifest_for(folder: Path, names: list[str] | None = None) -> dict:
    """`{name: {"size", "xxh3_64"}}` of the files in `folder` (or of `names`), manifest and marker excluded."""
    folder = Path(folder)
    if names is None:
        names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    files = {}
    for name in names:
        if name in (MANIFEST, COMPLETE_MARKER):
            continue
        data = (folder / name).read_bytes()
        files[name] = {"size": len(data), ALGORITHM: checksum(data)}
    return files


def manifest_bytes(files: dict) -> bytes:
    return (json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1, sort_keys=True) + "\n").encode()


def parse_manifest(data: bytes, where: str) -> dict:
    """The `files` map of a manifest; a damaged manifest is a damaged folder (ChecksumError)."""
    try:
        manifest = json.loads(data)
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get(ALGORITHM), str)
            for v in files.values()
        ):
            raise ValueError("unexpected fields")
        return files
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ChecksumError(
            where, f"failed its checksum (its {MANIFEST} is damaged: {e})", stored="unreadable", computed="-"
        ) from None


@dataclass
class FileProblem:
    name: str  # relative to the folder
    status: str  # "corrupt" or "missing"
    reason: str


def check_file(name: str, data: bytes | None, entry: dict, where: str) -> FileProblem | None:
    """Compare one file's bytes (None: absent) with its manifest entry."""
    if data is None:
        return FileProblem(name, "missing", f"{where} is missing (listed in {MANIFEST})")
    computed = checksum(data)
    if len(data) != entry["size"] or computed != entry[ALGORITHM]:
        detail = "" if len(data) == entry["size"] else f", {len(data)} bytes instead of {entry['size']}"
        return FileProblem(
            name, "corrupt", f"{where} failed its checksum (stored {entry[ALGORITHM]}, computed {computed}{detail})"
        )
    return None


def verify_local_folder(folder: Path) -> list[FileProblem] | None:
    """Problems of a local checkpoint folder against its manifest; None when it has no manifest (legacy)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        files = parse_manifest(path.read_bytes(), str(path))
    except ChecksumError as e:
        return [FileProblem(MANIFEST, "corrupt", str(e))]
    problems = []
    for name, entry in sorted(files.items()):
        file = folder / name
        problem = check_file(name, file.read_bytes() if file.is_file() else None, entry, str(file))
        if problem:
            problems.append(problem)
    return problems


# ---------------------------------------------------------------- old stores
_warned: set[str] = set()


def legacy_warning(kind: str, where: str) -> None:
    """Once per process and kind: a file from before checksums is read unverified."""
    if kind in _warned:
        return
    _warned.add(kind)
    print(
        f"warning: {where} has no checksum (written before opd_cache recorded them); {kind} files like it are "
        f"read unverified (this warning is shown once per run)",
        file=sys.stderr,
    )


# ---------------------------------------------------------------- `opd verify`
@dataclass
class VerifyReport:
    ok: int = 0
    unchecked: int = 0  # written before checksums: readable, not verifiable
    problems: list[tuple[str, str, str]] = None  # (store-relative path, "corrupt" | "missing", reason)
    quarantined: dict[str, str] = None  # quarantine/ entry -> reason

    def __post_init__(self):
        self.problems = self.problems or []
        self.quarantined = self.quarantined or {}

    def count(self, status: str) -> int:
        return sum(1 for _, s, _ in self.problems if s == status)

    @property
    def damaged(self) -> bool:
        return bool(self.problems)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "corrupt": self.count("corrupt"),
            "missing": self.count("missing"),
            "unchecked": self.unchecked,
            "problems": [{"path": p, "status": s, "reason": r} for p, s, r in self.problems],
            "quarantined": self.quarantined,
        }


SHARD_FOLDERS = (f"{ROLLOUTS}/", f"{ANNOTATED}/")
CHECKPOINT_FOLDERS = (f"{POLICY}/", f"{TRAIN_STATE}/")


def verify_store(store, on_file=None) -> VerifyReport:
    """Check every checksummed file of a store (one recursive listing, then one read per file).

    Shards are checked against their trailer; policy versions and resume states (folders with `_COMPLETE`)
    against their manifest, every listed file. `on_file(rel)` is called per file or folder checked (progress).
    """
    import pyarrow as pa

    report = VerifyReport()
    files = sorted(store.relative_path(info.path) for info in store.list_files("", recursive=True))
    folders = sorted(
        {
            rel.rsplit("/", 1)[0]
            for rel in files
            if rel.endswith(f"/{COMPLETE_MARKER}") and rel.startswith(CHECKPOINT_FOLDERS)
        }
    )
    for rel in files:
        if rel.startswith(f"{QUARANTINE}/") and rel.endswith(REASON_SUFFIX):
            name = rel[len(QUARANTINE) + 1 : -len(REASON_SUFFIX)]
            report.quarantined[name] = store.read_bytes(rel).decode(errors="replace").strip()
        if not (rel.endswith(".arrow") and rel.startswith(SHARD_FOLDERS)):
            continue
        if on_file:
            on_file(rel)
        where = f"shard {store.path(rel)}"
        try:
            data = store.read_buffer(rel)
        except FileNotFoundError:
            continue  # moved (e.g. quarantined) since the listing
        try:
            payload, checked = split_trailer(data, where)
        except ChecksumError as e:
            report.problems.append((rel, "corrupt", str(e)))
            continue
        if checked:
            report.ok += 1
            continue
        try:  # no trailer: an old file (readable, unverified) or one whose trailer was cut off
            table = pa.ipc.open_stream(pa.BufferReader(payload)).read_all()
        except (pa.ArrowInvalid, OSError, EOFError) as e:
            report.problems.append((rel, "corrupt", f"{where}: truncated or not an Arrow IPC stream ({e})"))
            continue
        if (table.schema.metadata or {}).get(META_CHECKSUM.encode()):
            report.problems.append((rel, "corrupt", str(missing_trailer(where, len(data)))))
        else:
            report.unchecked += 1
    for folder in folders:
        if on_file:
            on_file(folder)
        problems = store.verify_folder(folder)
        if problems is None:
            report.unchecked += 1
            continue
        report.problems += [(f"{folder}/{p.name}", p.status, p.reason) for p in problems]
        report.ok += max(_listed_files(store, folder) - len(problems), 0)
    return report


def _listed_files(store, folder: str) -> int:
    """How many files a folder's manifest lists (0 when the manifest itself is damaged)."""
    try:
        return len(parse_manifest(store.read_bytes(f"{folder}/{MANIFEST}"), folder))
    except (ChecksumError, FileNotFoundError):
        return 0
