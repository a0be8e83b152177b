"""Token ids in few bytes, for the packed codec (opd_cache/storage/codec.py): b-bit packing and id bitmaps.

A packed part stores each position's k teacher ids one of two ways, whichever is smaller:

- packed: k ids at b = ceil(log2 V) bits each, id j at bit offset j*b of the row (little-endian), so a
  row is ceil(k*b/8) bytes (`pack_ids` / `unpack_ids`);
- bitmap: the set of ids as V bits, bit `id` set (`pack_id_bitmap` / `unpack_id_bitmap`), ceil(V/8) bytes
  a row, when the ids are distinct and V is small (V = 99, k = 64: 13 bytes instead of 56).

Both are vectorised over all positions (numpy), a chunk of TABLE_CHUNK positions at a time where the
intermediate arrays would otherwise leave the cache.
"""

from __future__ import annotations

import math

import numpy as np

from opd_cache.storage.columns import ShardError
from opd_cache.storage.quantize import TABLE_CHUNK


class CodecError(ShardError):
    """A packed column that cannot be decoded (wrong width, a codec version from the future)."""


def id_bits(vocab_size: int) -> int:
    """Bits per id: ceil(log2 V), at least 1."""
    return max(1, math.ceil(math.log2(max(int(vocab_size), 2))))


def packed_id_width(k: int, bits: int) -> int:
    return (k * bits + 7) // 8


# ---------------------------------------------------------------- ids
def pack_ids(ids: np.ndarray, bits: int) -> np.ndarray:
    """`[N, k]` ids in [0, 2**bits) -> `[N, ceil(k*bits/8)]` uint8, id j at bit offset j*bits (little-endian)."""
    ids = np.asarray(ids)
    n, k = ids.shape
    if n and (ids.min() < 0 or int(ids.max()) >= (1 << bits)):
        raise ValueError(f"pack_ids: ids must lie in [0, {1 << bits}) for {bits}-bit packing")
    width = packed_id_width(k, bits)
    span = (bits + 7 + 7) // 8  # bytes an id can touch once shifted by up to 7 bits
    # Work on the transposes so every step reads and writes one contiguous row of N values; the loop runs
    # over the k columns and their few bytes, each step vectorised over all N positions.
    values = np.ascontiguousarray(ids.T, dtype=np.uint64)
    out = np.zeros((width + span, n), dtype=np.uint8)  # spare rows so the last id's bytes fit
    for j in range(k):
        start, shift = divmod(j * bits, 8)
        v = values[j] << np.uint64(shift)
        for t in range(span):
            out[start + t] |= (v >> np.uint64(8 * t)).astype(np.uint8)  # astype keeps the low byte
    return np.ascontiguousarray(out[:width].T)


def unpack_ids(packed: np.ndarray, k: int, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of `pack_ids`: `[N, width]` uint8 -> `[N, k]` int32 (or into `out`, of any integer type)."""
    n, width = packed.shape
    out = np.empty((n, k), dtype=np.int32) if out is None else out
    if (k * bits) % 8 == 0 and out.flags.c_contiguous:  # rows end on a byte boundary: one bit stream
        _unpack_stream(packed, bits, out.reshape(-1))  # (a view: `out` is contiguous)
        return out
    row = width + 8  # 8 spare bytes per row so every id's 8-byte window stays inside it
    mask = np.uint64((1 << bits) - 1)
    padded = np.zeros((min(n, TABLE_CHUNK), row), dtype=np.uint8)
    # Ids i, i + 8, i + 16, ... start `bits` bytes apart at the same bit shift, so each of the 8 residues is one
    # strided (unaligned) uint64 view over a chunk's positions and their k / 8 ids; TABLE_CHUNK positions at a
    # time keep the chunk in cache.
    for start in range(0, n, TABLE_CHUNK):
        rows = min(TABLE_CHUNK, n - start)
        padded[:rows, :width] = packed[start : start + rows]
        for i in range(min(8, k)):
            offset, shift = divmod(i * bits, 8)
            window = np.ndarray(
                (rows, len(range(i, k, 8))), dtype="<u8", buffer=padded, offset=offset, strides=(row, bits)
            )
            out[start : start + rows, i::8] = (window >> np.uint64(shift)) & mask
    return out


def _unpack_stream(packed: np.ndarray, bits: int, out: np.ndarray) -> None:
    """len(out) ids at `bits` bits each from one contiguous little-endian bit stream, into `out`.

    Ids m, m + P, m + 2P, ... (P = 8 / gcd(bits, 8)) start bits * P / 8 bytes apart at the same bit shift: each of
    the P residues is one strided uint64 view over the whole stream (count is a multiple of P here).
    """
    period = 8 // math.gcd(bits, 8)
    stride = bits * period // 8
    stream = np.zeros(packed.size + 8, dtype=np.uint8)  # 8 spare bytes: the last id's window stays inside
    stream[: packed.size] = packed.reshape(-1)
    mask = np.uint64((1 << bits) - 1)
    for i in range(period):
        offset, shift = divmod(i * bits, 8)
        window = np.ndarray((len(out) // period,), dtype="<u8", buffer=stream, offset=offset, strides=(stride,))
        np.bitwise_and(window >> np.uint64(shift), mask, out=out[i::period], casting="unsafe")


# ---------------------------------------------------------------- id sets
def bitmap_width(vocab_size: int) -> int:
    return (int(vocab_size) + 7) // 8


def pack_id_bitmap(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """`[N, k]` distinct ids per row -> `[N, ceil(V/8)]` uint8, bit `id` of the row set (little-endian bit order)."""
    n, k = ids.shape
    row_bits = 8 * bitmap_width(vocab_size)
    bits = np.zeros(n * row_bits, dtype=np.uint8)
    bits[(np.arange(n, dtype=np.int64) * row_bits)[:, None] + ids] = 1
    return np.packbits(bits.reshape(n, row_bits), axis=1, bitorder="little")


def unpack_id_bitmap(bitmap: np.ndarray, k: int, where: str = "bitmap", out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of `pack_id_bitmap`: `[N, width]` uint8, k bits set per row -> `[N, k]` int32 ascending (or `out`)."""
    n, width = bitmap.shape
    out = np.empty((n, k), dtype=np.int32) if out is None else out
    for start in range(0, n, TABLE_CHUNK):
        rows = min(TABLE_CHUNK, n - start)
        bits = np.unpackbits(bitmap[start : start + rows], axis=1, bitorder="little")
        set_bits = np.flatnonzero(bits.view(np.bool_))  # on bool, not uint8: several times faster
        if len(set_bits) != rows * k:
            raise CodecError(f"{where}: an id bitmap holds {len(set_bits)} ids in {rows} positions, expected {k} each")
        # row-major order: each row's k set bits in turn, ascending; subtracting the row's first bit gives its ids
        set_bits = set_bits.reshape(rows, k)
        set_bits -= np.arange(0, rows * 8 * width, 8 * width)[:, None]
        if rows and (set_bits[:, 0].min() < 0 or set_bits[:, -1].max() >= 8 * width):
            raise CodecError(f"{where}: an id bitmap does not hold {k} ids in every position")
        out[start : start + rows] = set_bits
    return out
