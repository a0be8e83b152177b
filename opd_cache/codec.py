"""The `packed` codec of annotated parts: the top-k ids as a set, 8-bit top-k log-probs.

A plain part stores per response position k int32 ids and k float16/float32
log-probs (389 bytes/token at k = 64 in float16), best first. A packed part
(codec version 2) may store each position's k entries in ascending id order,
so the ids form a set and their order costs nothing:

    teacher_topk_ids_bitmap   list<fixed_size_binary(ceil(V / 8))>     the set as V bits (bit id set), little-endian
      or teacher_topk_ids_packed  list<fixed_size_binary(ceil(k * b / 8))>  the ids at b = ceil(log2 V) bits (order below)
    teacher_topk_lp_codes     list<fixed_size_binary(k)>                 one uint8 code per entry, aligned with the ids
    teacher_topk_log_mass     list<float32>                              log sum_j p_j over the k entries (exact)
    teacher_topk_range_level  list<uint8>                                the row's quantization range L, a grid level
      or teacher_topk_log_range   list<float32>                          L itself (a row spans more than 1e6 nats)
    teacher_token_logprob     list<float32>                              unchanged (exact)

Each part makes its own choices, and its schema records them: the bitmap when it
is smaller (ceil(V/8) < ceil(k*b/8) bytes: V = 99, k = 64 takes 13 bytes instead
of 56) and the ids are distinct, with V in the column's field metadata
('opd.vocab_size') so its width is checked; packed ids otherwise, in id or in
rank order, whichever zstd compresses less (sorted ids repeat across a trained
teacher's positions; codes rise along a rank-ordered row), recorded in the
codes' field metadata ('opd.entry_order'). A reader
restores rank order with one sort of (code << b | id) keys per position (codes
rise as log-probs fall): every consumer sees entries best first, ties by
ascending id. The sampled token's log-prob stays exact: the k1/k3 estimators and
policy-gradient OPD read it, and decoding it from the row (an index instead of
4 bytes) moved k3's mean loss by 1.4e-3 nats/token on tests/test_codec.py's demo sample.

Log-probs are coded by their gap below the row's maximum, g_j = max - lp_j >= 0,
on a log scale so that the entries that carry the mass (small gaps) get the
finest steps: code_j = round(254 * log1p(g_j / c) / L) with L = log1p(max_j g_j / c)
over the finite entries rounded up onto a grid of 256 levels (steps of 0.049; rows spanning more than
1e6 nats keep their exact L), c = GAP_SCALE = 4 nats, and code 255 means -inf (p_j = 0). On the grid, the
reader turns (level, code) into a gap with one table lookup instead of an expm1 and an exp per entry; parts
written before the grid (exact L) decode with the same arithmetic, the slow way.
(c trades the two losses: small c favours forward KL, which weighs entries by the
teacher's p; large c, uniform steps, favours reverse KL, which weighs them by the
student's q; benchmarks/bench_codec.py measures both.) Decoding inverts
the code and then shifts the whole row so that its log-sum-exp equals the stored
`log_mass`: the teacher's tail mass 1 - sum_j p_j, which the losses' tail
bucket uses, is therefore exact (to float32), not a sum of rounded terms.

Bound (tests/test_codec.py checks it for every entry): a gap decodes within
delta(g) = (c + g) * (exp(L / 508) - 1) (half a code step on the log scale),
and the renormalising shift is a weighted mean of those errors, at most
C = exp(delta(0)) * sum_i exp(-g_i + delta(g_i)) * delta(g_i). So every log-prob
is within delta(g_j) + C. For a row spanning 30 nats, L <= log1p(7.5) + 0.049 and delta(g) <= 0.0043 (4 + g).

The codec version and the id width live in the part's Arrow metadata; a reader
refuses versions from the future and packed columns of the wrong width. Version 1
parts (ids in rank order at b bits, float32 L) decode unchanged: their rows are
already in rank order, which the sort keeps (ties by ascending id).
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from opd_cache.columns import (
    ShardError,
    annotated_schema,
    flat_values,
    list_lengths,
    offsets_from_lengths,
    ragged,
    ragged_fixed,
)

CODEC_VERSION = 2  # 1: ids in rank order at b bits, float32 L, exact token log-prob
CODECS = ("none", "packed")
META_CODEC = "opd.codec"
META_CODEC_VERSION = "opd.codec_version"
META_ID_BITS = "opd.codec_id_bits"

# the per-token columns a packed part may hold (opd_cache/schema.py checks that their lengths agree)
PACKED_COLUMNS = (
    "teacher_topk_ids_packed",
    "teacher_topk_ids_bitmap",
    "teacher_topk_lp_codes",
    "teacher_topk_log_mass",
    "teacher_topk_log_range",
    "teacher_topk_range_level",
)
_NEG_INF_CODE = 255
_MAX_CODE = 254
GAP_SCALE = 4.0  # c, in nats: steps are ~uniform for gaps << c and ~relative for gaps >> c
MAX_GRID_GAP = 1e6  # rows spanning up to this many nats get a range on the lookup grid (below)
RANGE_LEVELS = 256
TABLE_CHUNK = 1024  # positions per step of the decoders (a chunk's arrays stay in cache)
RANGE_STEP = math.log1p(MAX_GRID_GAP / GAP_SCALE) / (RANGE_LEVELS - 1)  # 0.049: the grid of row ranges L


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


# ---------------------------------------------------------------- log-probs
def _row_ranges(max_gaps: np.ndarray) -> np.ndarray:
    """Each row's quantization range L >= log1p(max gap / c), rounded up onto the grid of RANGE_STEP when it fits.

    On the grid, a decoder turns (L, code) into a gap with one lookup in a [RANGE_LEVELS, 256] table instead of an
    expm1 per entry; rounding L up widens a row's code step by at most RANGE_STEP / L (1 % for a row spanning
    30 nats, L = 2.14). A row spanning more than MAX_GRID_GAP nats keeps its exact L and decodes the slow way.
    """
    exact = np.log1p(max_gaps / GAP_SCALE)
    level = np.ceil(exact / RANGE_STEP - 1e-9)
    return np.where(level < RANGE_LEVELS, level * RANGE_STEP, exact)


def quantize_logprobs(logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`[N, k]` log-probs -> (codes `[N, k]` uint8, log_mass `[N]` float32, log_range `[N]` float32)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    n, k = lp.shape
    finite = np.isfinite(lp)
    row_max = np.max(np.where(finite, lp, -np.inf), axis=1, initial=-np.inf) if k else np.full(n, -np.inf)
    has_any = np.isfinite(row_max)
    safe_max = np.where(has_any, row_max, 0.0)
    gaps = np.where(finite, safe_max[:, None] - lp, 0.0)
    # L as stored (float32), so the codes are computed with exactly the step the decoder will use
    log_range = _row_ranges(np.max(gaps, axis=1, initial=0.0)).astype(np.float32).astype(np.float64)
    scale = np.where(log_range > 0, _MAX_CODE / np.where(log_range > 0, log_range, 1.0), 0.0)
    codes = np.minimum(np.rint(np.log1p(gaps / GAP_SCALE) * scale[:, None]), _MAX_CODE).astype(np.uint8)
    codes[~finite] = _NEG_INF_CODE
    with np.errstate(divide="ignore"):
        shifted = np.where(finite, lp - safe_max[:, None], -np.inf)
        log_mass = np.where(has_any, safe_max + np.log(np.sum(np.exp(shifted), axis=1)), -np.inf)
    return codes, log_mass.astype(np.float32), log_range.astype(np.float32)


def _gap_tables() -> tuple[np.ndarray, np.ndarray]:
    """gap[level, code] = c * expm1(code * level * RANGE_STEP / 254) and exp(-gap), for every grid level.

    Code 255 (-inf) has gap inf; exp(-gap) is 0 at code 0 as well, so a row's sum of it is the mass outside its
    maximum (what the log-sum-exp below needs). float32, 256 KiB each: they stay in cache.
    """
    levels = np.arange(RANGE_LEVELS, dtype=np.float64)[:, None] * RANGE_STEP
    codes = np.arange(256, dtype=np.float64)[None, :]
    gaps = GAP_SCALE * np.expm1(codes * levels / _MAX_CODE)
    gaps[:, _NEG_INF_CODE] = np.inf
    exp_neg = np.exp(-gaps)
    exp_neg[:, 0] = 0.0
    return gaps.astype(np.float32), exp_neg.astype(np.float32)


_GAPS, _EXP_NEG_GAPS = _gap_tables()
# both as one table of (gap, exp(-gap)) pairs, so the decoder gathers each entry's two values in one lookup
_GAP_PAIRS = np.stack([_GAPS.ravel(), _EXP_NEG_GAPS.ravel()], axis=1).view(np.complex64).ravel()


def dequantize_logprobs(codes: np.ndarray, log_mass: np.ndarray, log_range: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_logprobs` (within the module's bound): `[N, k]` float32 whose log-sum-exp is log_mass.

    Rows whose range lies on the grid (every row `quantize_logprobs` writes, unless it spans more than
    MAX_GRID_GAP nats) decode by table lookup; others, and parts written before the grid, compute the same
    values with expm1/exp.
    """
    codes = np.asarray(codes)
    log_range = np.asarray(log_range, dtype=np.float32)
    log_mass = np.asarray(log_mass, dtype=np.float32)
    level, on_grid = _grid_levels(log_range)
    if on_grid.all():
        return _dequantize_by_table(codes, log_mass, level)
    out = np.empty(codes.shape, dtype=np.float32)
    out[on_grid] = _dequantize_by_table(codes[on_grid], log_mass[on_grid], level[on_grid])
    off = ~on_grid
    out[off] = _dequantize_exact(codes[off], log_mass[off], log_range[off])
    return out


def _shift_to_mass(at_max: np.ndarray, rest: np.ndarray, log_mass: np.ndarray) -> np.ndarray:
    """The per-row shift that makes a row's log-sum-exp equal log_mass.

    log-sum-exp as log(n0) + log1p(rest / n0), n0 the entries at the max (code 0, exp(0) = 1 each): for a
    peaked row the rest is ~1e-7 of the max, which 1 + rest would round away in float32, and the tail
    1 - sum p that the losses derive from these values depends on exactly that difference.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(at_max) + np.log1p(rest / at_max)
        return np.where(at_max > 0, log_mass - lse, np.float32(0))


def _dequantize_by_table(codes: np.ndarray, log_mass: np.ndarray, level: np.ndarray) -> np.ndarray:
    out = np.empty(codes.shape, dtype=np.float32)
    level_base = level.astype(np.uint16) << np.uint16(8)
    # TABLE_CHUNK positions at a time, so the [chunk, k] index and gathered values stay in cache
    for start in range(0, len(codes), TABLE_CHUNK):
        rows = slice(start, start + TABLE_CHUNK)
        _table_chunk(codes[rows], log_mass[rows], level_base[rows], out[rows])
    return out


def _table_chunk(codes: np.ndarray, log_mass: np.ndarray, level_base: np.ndarray, out: np.ndarray) -> None:
    """Decode `[rows, k]` codes into `out` by one lookup per entry; level_base: each row's grid level << 8, uint16."""
    # [rows, k] uint16 (level, code) indices: take() widens them to intp itself, faster than building intp here
    index = level_base[:, None] | codes
    pairs = _GAP_PAIRS.take(index)
    at_max = (codes == 0).sum(axis=1, dtype=np.int32).astype(np.float32)
    rest = pairs.imag.sum(axis=1, dtype=np.float32)
    np.negative(pairs.real, out=out)
    out += _shift_to_mass(at_max, rest, log_mass)[:, None]


def _dequantize_exact(codes: np.ndarray, log_mass: np.ndarray, log_range: np.ndarray) -> np.ndarray:
    finite = codes != _NEG_INF_CODE
    # float32 arithmetic (numpy's vectorised exp/log): its rounding, ~1e-7 relative, is far below a code step
    step = (log_range / np.float32(_MAX_CODE))[:, None]
    gaps = np.float32(GAP_SCALE) * np.expm1(codes.astype(np.float32) * step)
    rel = np.where(finite, -gaps, np.float32(-np.inf))  # 0 at the row max
    at_max = (codes == 0).sum(axis=1).astype(np.float32)
    rest = np.sum(np.where(finite & (codes != 0), np.exp(rel), np.float32(0)), axis=1)
    out = rel + _shift_to_mass(at_max, rest, log_mass)[:, None]
    return out.astype(np.float32, copy=False)


def logprob_bound(logprobs: np.ndarray) -> np.ndarray:
    """The per-entry bound of the module docstring, `[N, k]` (inf where the entry is -inf)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    finite = np.isfinite(lp)
    row_max = np.max(np.where(finite, lp, -np.inf), axis=1)
    gaps = np.where(finite, row_max[:, None] - lp, np.inf)
    log_range = _row_ranges(np.max(np.where(finite, gaps, 0.0), axis=1)).astype(np.float32).astype(np.float64)
    unit = np.expm1(log_range / (2 * _MAX_CODE))[:, None]
    delta = (GAP_SCALE + gaps) * unit
    with np.errstate(invalid="ignore"):
        shift = np.exp(GAP_SCALE * unit[:, 0]) * np.sum(np.where(finite, np.exp(-gaps + delta) * delta, 0.0), axis=1)
    return np.where(finite, delta + shift[:, None], np.inf)


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


# ---------------------------------------------------------------- tables
IDS_PACKED, IDS_BITMAP = "teacher_topk_ids_packed", "teacher_topk_ids_bitmap"
META_VOCAB = b"opd.vocab_size"  # field metadata of the bitmap column: V, so its width can be checked
META_ORDER = b"opd.entry_order"  # field metadata of the codes: "id" or "rank", the order a part stores entries in


def _zstd_size(rows: np.ndarray) -> int:
    return pa.compress(np.ascontiguousarray(rows).reshape(-1), codec="zstd", asbytes=False).size


def _ragged_binary(rows: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    """A `list<fixed_size_binary(width)>` column from `[total_tokens, width]` uint8 rows and per-row lengths."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    width = rows.shape[1]
    inner = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(rows), [None, pa.py_buffer(rows.tobytes())])
    return pa.ListArray.from_arrays(pa.array(offsets_from_lengths(np.asarray(lengths))), inner)


def packed_fields(top_k: int, bits: int, *, vocab_size: int = 0, range_levels: bool = True) -> list[pa.Field]:
    """The columns of a packed part: ids as a bitmap (vocab_size > 0) or packed, row ranges as levels or float32."""
    if vocab_size:
        ids = pa.field(
            IDS_BITMAP,
            pa.list_(pa.binary(bitmap_width(vocab_size))),
            nullable=False,
            metadata={META_VOCAB: str(vocab_size).encode()},
        )
    else:
        ids = pa.field(IDS_PACKED, pa.list_(pa.binary(packed_id_width(top_k, bits))), nullable=False)
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        ids,
        pa.field("teacher_topk_lp_codes", pa.list_(pa.binary(top_k)), nullable=False),
        pa.field("teacher_topk_log_mass", pa.list_(pa.float32()), nullable=False),
    ]
    if range_levels:
        fields.append(pa.field("teacher_topk_range_level", pa.list_(pa.uint8()), nullable=False))
    else:
        fields.append(pa.field("teacher_topk_log_range", pa.list_(pa.float32()), nullable=False))
    fields.append(pa.field("teacher_token_logprob", pa.list_(pa.float32()), nullable=False))
    return fields


def _grid_levels(log_range: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's grid level, whether its range lies on the grid) for stored float32 ranges L."""
    log_range = np.asarray(log_range, dtype=np.float32)
    level = np.rint(log_range / np.float32(RANGE_STEP))
    on_grid = (np.abs(log_range - (level * RANGE_STEP).astype(np.float32)) <= 1e-6 * np.maximum(log_range, 1)) & (
        level < RANGE_LEVELS
    )
    return level.astype(np.int32), on_grid


def encode_annotation(table: pa.Table, vocab_size: int) -> tuple[pa.Table, dict[str, str]]:
    """A plain annotated table -> (its packed table, the codec's metadata entries).

    The choices of id layout, entry order and range column are the part's own and show in its schema (module
    docstring).
    """
    bits = id_bits(vocab_size)
    lengths = list_lengths(table["teacher_token_logprob"])
    k = table.schema.field("teacher_topk_ids").type.value_type.list_size
    ids = flat_values(table["teacher_topk_ids"]).reshape(-1, k)
    codes, log_mass, log_range = quantize_logprobs(flat_values(table["teacher_topk_logprobs"]).reshape(-1, k))
    level, on_grid = _grid_levels(log_range)
    by_id = np.argsort(ids, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(ids, by_id, axis=1)

    distinct = k < 2 or not (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any()  # a bitmap holds a set, not repeats
    use_bitmap = distinct and bitmap_width(vocab_size) < packed_id_width(k, bits)
    if use_bitmap:
        order, id_rows, codes = "id", pack_id_bitmap(sorted_ids, vocab_size), np.take_along_axis(codes, by_id, axis=1)
    else:
        # Packed ids cost k * b bits in either order. In id order zstd finds more in the ids (a trained teacher's
        # sets repeat), in rank order more in the codes (they rise along the row): keep whichever compresses less.
        candidates = [
            ("id", pack_ids(sorted_ids, bits), np.take_along_axis(codes, by_id, axis=1)),
            ("rank", pack_ids(ids, bits), codes),
        ]
        order, id_rows, codes = min(candidates, key=lambda c: _zstd_size(c[1]) + _zstd_size(c[2]))
    range_levels = bool(on_grid.all())
    fields = packed_fields(k, bits, vocab_size=vocab_size if use_bitmap else 0, range_levels=range_levels)
    fields[2] = fields[2].with_metadata({META_ORDER: order.encode()})
    columns = {
        "sample_id": table["sample_id"],
        fields[1].name: _ragged_binary(id_rows, lengths),
        "teacher_topk_lp_codes": _ragged_binary(codes, lengths),
        "teacher_topk_log_mass": ragged(log_mass, lengths, pa.float32()),
    }
    if range_levels:
        columns["teacher_topk_range_level"] = ragged(level.astype(np.uint8), lengths, pa.uint8())
    else:
        columns["teacher_topk_log_range"] = ragged(log_range, lengths, pa.float32())
    # exact: the k1/k3 estimators and policy-gradient OPD read it (docs/benchmarks.md, Codec: why not an index)
    columns["teacher_token_logprob"] = table["teacher_token_logprob"]
    if "teacher_support_logprobs" in table.schema.names:
        columns["teacher_support_logprobs"] = table["teacher_support_logprobs"]
        fields.append(table.schema.field("teacher_support_logprobs"))
    meta = {META_CODEC: "packed", META_CODEC_VERSION: str(CODEC_VERSION), META_ID_BITS: str(bits)}
    return pa.table(columns, schema=pa.schema(fields)), meta


def codec_of(metadata: dict[str, str], where: str) -> tuple[str, int]:
    """(codec name, id bits) from decoded Arrow metadata; refuses unknown codecs and versions from the future."""
    codec = metadata.get(META_CODEC, "none")
    if codec == "none":
        return "none", 0
    if codec != "packed":
        raise CodecError(f"{where}: unknown annotation codec {codec!r} (this opd_cache reads {', '.join(CODECS)})")
    version = int(metadata.get(META_CODEC_VERSION, "-1"))
    if version > CODEC_VERSION:
        raise CodecError(
            f"{where}: packed codec version {version} is newer than this opd_cache reads "
            f"(version {CODEC_VERSION}); upgrade opd_cache"
        )
    if version < 1:
        raise CodecError(f"{where}: packed codec without a valid '{META_CODEC_VERSION}' ({version})")
    bits = int(metadata.get(META_ID_BITS, "0"))
    if not 1 <= bits <= 32:
        raise CodecError(f"{where}: packed codec id width {bits} bits is not in 1..32")
    return codec, bits


def _layout_of(table: pa.Table, top_k: int, bits: int, where: str) -> list[pa.Field]:
    """The packed fields this table's own choices (id layout, range and token columns) call for."""
    names = table.schema.names
    vocab_size = 0
    if IDS_BITMAP in names:
        vocab = (table.schema.field(IDS_BITMAP).metadata or {}).get(META_VOCAB)
        if vocab is None or not vocab.isdigit() or not 1 <= int(vocab) <= 1 << bits:
            raise CodecError(f"{where}: packed column {IDS_BITMAP!r} has no valid '{META_VOCAB.decode()}' metadata")
        vocab_size = int(vocab)
    return packed_fields(
        top_k,
        bits,
        vocab_size=vocab_size,
        range_levels="teacher_topk_log_range" not in names,
    )


def check_packed(table: pa.Table, top_k: int, bits: int, where: str) -> None:
    """Column types and widths of a packed part; a truncated column is refused with its expected width."""
    for field in _layout_of(table, top_k, bits, where):
        if field.name not in table.schema.names:
            raise CodecError(f"{where}: packed part is missing column {field.name!r} ({field.type})")
        got = table.schema.field(field.name).type
        if got != field.type:
            if pa.types.is_list(got) and pa.types.is_fixed_size_binary(got.value_type):
                raise CodecError(
                    f"{where}: packed column {field.name!r} is truncated: "
                    f"{got.value_type.byte_width} bytes per position, expected "
                    f"{field.type.value_type.byte_width} (k={top_k}, {bits}-bit ids)"
                )
            raise CodecError(f"{where}: packed column {field.name!r} has type {got}, expected {field.type}")


def _binary_rows(column: pa.ChunkedArray, width: int) -> np.ndarray:
    """All fixed-size binary values of a `list<fixed_size_binary(width)>` column as `[N, width]` uint8."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    inner = array.flatten()
    data = np.frombuffer(inner.buffers()[1], dtype=np.uint8)
    start = inner.offset * width
    return data[start : start + len(inner) * width].reshape(-1, width)


def decode_annotation(table: pa.Table, top_k: int, bits: int, where: str = "packed part") -> pa.Table:
    """A packed part -> the plain columns (`teacher_topk_ids` int32, `teacher_topk_logprobs` float32, ...).

    Each row's entries come back in rank order, best first (ties by ascending id), as a plain part has them.
    """
    lengths = list_lengths(table["teacher_token_logprob"])
    fields = {f.name: f for f in _layout_of(table, top_k, bits, where)}
    codes = _binary_rows(table["teacher_topk_lp_codes"], top_k)
    n = len(codes)
    if IDS_BITMAP in fields:
        width = fields[IDS_BITMAP].type.value_type.byte_width
        id_rows = _binary_rows(table[IDS_BITMAP], width)
        key_bits = max(1, (8 * width - 1).bit_length())

        def unpack(rows, out):
            unpack_id_bitmap(id_rows[rows], top_k, where, out=out)
    else:
        id_rows = _binary_rows(table[IDS_PACKED], packed_id_width(top_k, bits))
        key_bits = bits

        def unpack(rows, out):
            unpack_ids(id_rows[rows], top_k, bits, out=out)

    key_type = np.uint16 if key_bits <= 8 else np.uint32 if key_bits <= 24 else np.uint64
    id_mask = key_type((1 << key_bits) - 1)
    log_mass = flat_values(table["teacher_topk_log_mass"])
    if "teacher_topk_range_level" in fields:
        level_base = flat_values(table["teacher_topk_range_level"]).astype(np.uint16) << np.uint16(8)
    else:
        log_range = flat_values(table["teacher_topk_log_range"])
    ids = np.empty((n, top_k), dtype=np.int32)
    logprobs = np.empty((n, top_k), dtype=np.float32)
    key_buffer = np.empty((min(n, TABLE_CHUNK), top_k), dtype=key_type)
    # TABLE_CHUNK positions at a time, every step on arrays that stay in cache
    for start in range(0, n, TABLE_CHUNK):
        rows = slice(start, start + TABLE_CHUNK)
        chunk_codes = codes[rows]
        # Rank order: sort each position's (code, id) keys. Codes rise as log-probs fall, so the sorted keys hold
        # the entries best first, ties by ascending id. (Version-1 parts, stored in rank order, stay as they are
        # but for the order of ties.)
        keys = key_buffer[: len(chunk_codes)]
        unpack(rows, keys)
        keys |= chunk_codes.astype(key_type) << key_type(key_bits)
        keys.sort(axis=1)
        ranked_codes = (keys >> key_type(key_bits)).astype(np.uint8)
        np.bitwise_and(keys, id_mask, out=ids[rows], casting="unsafe")
        if "teacher_topk_range_level" in fields:
            _table_chunk(ranked_codes, log_mass[rows], level_base[rows], logprobs[rows])
        else:
            logprobs[rows] = dequantize_logprobs(ranked_codes, log_mass[rows], log_range[rows])
    columns = {
        "sample_id": table["sample_id"],
        "teacher_topk_ids": ragged_fixed(ids, lengths, pa.int32()),
        "teacher_topk_logprobs": ragged_fixed(logprobs, lengths, pa.float32()),
        "teacher_token_logprob": table["teacher_token_logprob"],
    }
    support_k = 0
    if "teacher_support_logprobs" in table.schema.names:
        columns["teacher_support_logprobs"] = table["teacher_support_logprobs"]
        support_k = table.schema.field("teacher_support_logprobs").type.value_type.list_size
    schema = annotated_schema(top_k, "float32", support_k).with_metadata(table.schema.metadata)
    return pa.table(columns, schema=schema)
