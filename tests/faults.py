"""Fault injection for stored files: flipped bytes and truncation, and re-sealing a crafted file's checksum."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from opd_cache.storage import integrity


def damage_offsets(size: int, rng: np.random.Generator) -> dict[str, int]:
    """One seeded random offset in each region of a file: its header, its middle and its footer (last 64 bytes)."""
    head = max(1, min(64, size // 4))
    return {
        "header": int(rng.integers(0, head)),
        "middle": int(rng.integers(size // 4, max(size // 4 + 1, 3 * size // 4))),
        "footer": int(rng.integers(max(0, size - 64), size)),
    }


def flip_bytes(path: Path, offset: int, count: int = 1) -> None:
    """XOR `count` bytes from `offset` with 0xFF, in place (what a bad disk or transfer leaves)."""
    data = bytearray(Path(path).read_bytes())
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def truncate(path: Path, length: int) -> None:
    """Cut a file to its first `length` bytes (an interrupted copy)."""
    Path(path).write_bytes(Path(path).read_bytes()[:length])


def reseal_shard(path: Path) -> None:
    """Recompute a shard's checksum trailer after crafting its payload (an attacker with write access can)."""
    data = Path(path).read_bytes()
    if data.endswith(integrity.TRAILER_MAGIC):
        data = data[: -integrity.TRAILER_SIZE]
    Path(path).write_bytes(data + integrity.trailer(data))


def reseal_folder(folder: Path) -> None:
    """Rewrite a checkpoint folder's `_CHECKSUMS.json` for its current files."""
    folder = Path(folder)
    names = sorted(json.loads((folder / integrity.MANIFEST).read_text())["files"])
    names = sorted(set(names) | {p.name for p in folder.iterdir() if p.is_file()})
    (folder / integrity.MANIFEST).write_bytes(integrity.manifest_bytes(integrity.manifest_for(folder, names)))
