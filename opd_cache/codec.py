"""The `packed` codec of annotated parts: bit-packed top-k ids and 8-bit top-k log-probs.

A plain part stores per response position k int32 ids and k float16/float32
log-probs (389 bytes/token at k = 64 in float16). A packed part stores instead

    teacher_topk_ids_packed   list<fixed_size_binary(ceil(k * b / 8))>   ids at b = ceil(log2 V) bits, little-endian
    teacher_topk_lp_codes     list<fixed_size_binary(k)>                 one uint8 code per entry (below)
    teacher_topk_log_mass     list<float32>                              log sum_j p_j over the k entries (exact)
    teacher_topk_log_range    list<float32>                              the row's quantization range L
    teacher_token_logprob     list<float32>                              unchanged

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
refuses versions from the future and packed columns of the wrong width.
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

CODEC_VERSION = 1
CODECS = ("none", "packed")
META_CODEC = "opd.codec"
META_CODEC_VERSION = "opd.codec_version"
META_ID_BITS = "opd.codec_id_bits"

PACKED_COLUMNS = ("teacher_topk_ids_packed", "teacher_topk_lp_codes", "teacher_topk_log_mass", "teacher_topk_log_range")
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


def unpack_ids(packed: np.ndarray, k: int, bits: int) -> np.ndarray:
    """Inverse of `pack_ids`: `[N, width]` uint8 -> `[N, k]` int32."""
    n, width = packed.shape
    row = width + 8  # 8 spare bytes per row so every id's 8-byte window stays inside it
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((n, k), dtype=np.int32)
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


def dequantize_logprobs(codes: np.ndarray, log_mass: np.ndarray, log_range: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_logprobs` (within the module's bound): `[N, k]` float32 whose log-sum-exp is log_mass.

    Rows whose range lies on the grid (every row `quantize_logprobs` writes, unless it spans more than
    MAX_GRID_GAP nats) decode by table lookup; others, and parts written before the grid, compute the same
    values with expm1/exp.
    """
    codes = np.asarray(codes)
    log_range = np.asarray(log_range, dtype=np.float32)
    log_mass = np.asarray(log_mass, dtype=np.float32)
    level = np.rint(log_range / np.float32(RANGE_STEP))
    on_grid = (np.abs(log_range - (level * RANGE_STEP).astype(np.float32)) <= 1e-6 * np.maximum(log_range, 1)) & (
        level < RANGE_LEVELS
    )
    if on_grid.all():
        return _dequantize_by_table(codes, log_mass, level.astype(np.int32))
    out = np.empty(codes.shape, dtype=np.float32)
    out[on_grid] = _dequantize_by_table(codes[on_grid], log_mass[on_grid], level[on_grid].astype(np.int32))
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
    gaps, exp_neg = _GAPS.ravel(), _EXP_NEG_GAPS.ravel()
    level = level.astype(np.intp)  # take() converts any other index type to intp first: a copy per call
    out = np.empty(codes.shape, dtype=np.float32)
    # TABLE_CHUNK positions at a time, so the [chunk, k] index and gathered values stay in cache
    for start in range(0, len(codes), TABLE_CHUNK):
        rows = slice(start, start + TABLE_CHUNK)
        chunk_codes, chunk_out = codes[rows], out[rows]
        index = (level[rows, None] << 8) | chunk_codes  # [chunk, k]: the row's level, the entry's code
        at_max = (chunk_codes == 0).sum(axis=1, dtype=np.int32).astype(np.float32)
        rest = exp_neg.take(index).sum(axis=1, dtype=np.float32)
        gaps.take(index, out=chunk_out)
        np.negative(chunk_out, out=chunk_out)
        chunk_out += _shift_to_mass(at_max, rest, log_mass[rows])[:, None]
    return out


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


# ---------------------------------------------------------------- tables
def _ragged_binary(rows: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    """A `list<fixed_size_binary(width)>` column from `[total_tokens, width]` uint8 rows and per-row lengths."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    width = rows.shape[1]
    inner = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(rows), [None, pa.py_buffer(rows.tobytes())])
    return pa.ListArray.from_arrays(pa.array(offsets_from_lengths(np.asarray(lengths))), inner)


def packed_schema(top_k: int, bits: int, support_k: int = 0) -> pa.Schema:
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("teacher_topk_ids_packed", pa.list_(pa.binary(packed_id_width(top_k, bits))), nullable=False),
        pa.field("teacher_topk_lp_codes", pa.list_(pa.binary(top_k)), nullable=False),
        pa.field("teacher_topk_log_mass", pa.list_(pa.float32()), nullable=False),
        pa.field("teacher_topk_log_range", pa.list_(pa.float32()), nullable=False),
        pa.field("teacher_token_logprob", pa.list_(pa.float32()), nullable=False),
    ]
    if support_k:
        fields.append(pa.field("teacher_support_logprobs", pa.list_(pa.list_(pa.float32(), support_k))))
    return pa.schema(fields)


def encode_annotation(table: pa.Table, vocab_size: int) -> tuple[pa.Table, dict[str, str]]:
    """A plain annotated table -> (its packed table, the codec's metadata entries)."""
    bits = id_bits(vocab_size)
    lengths = list_lengths(table["teacher_token_logprob"])
    ids = flat_values(table["teacher_topk_ids"])
    k = table.schema.field("teacher_topk_ids").type.value_type.list_size
    codes, log_mass, log_range = quantize_logprobs(flat_values(table["teacher_topk_logprobs"]).reshape(-1, k))
    support_k = 0
    if "teacher_support_logprobs" in table.schema.names:
        support_k = table.schema.field("teacher_support_logprobs").type.value_type.list_size
    columns = {
        "sample_id": table["sample_id"],
        "teacher_topk_ids_packed": _ragged_binary(pack_ids(ids.reshape(-1, k), bits), lengths),
        "teacher_topk_lp_codes": _ragged_binary(codes, lengths),
        "teacher_topk_log_mass": ragged(log_mass, lengths, pa.float32()),
        "teacher_topk_log_range": ragged(log_range, lengths, pa.float32()),
        "teacher_token_logprob": table["teacher_token_logprob"],
    }
    if support_k:
        columns["teacher_support_logprobs"] = table["teacher_support_logprobs"]
    meta = {META_CODEC: "packed", META_CODEC_VERSION: str(CODEC_VERSION), META_ID_BITS: str(bits)}
    return pa.table(columns, schema=packed_schema(k, bits, support_k)), meta


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


def check_packed(table: pa.Table, top_k: int, bits: int, where: str) -> None:
    """Column types and widths of a packed part; a truncated column is refused with its expected width."""
    expected = packed_schema(top_k, bits)
    for field in expected:
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


def decode_annotation(table: pa.Table, top_k: int, bits: int) -> pa.Table:
    """A packed part -> the plain columns (`teacher_topk_ids` int32, `teacher_topk_logprobs` float32, ...)."""
    lengths = list_lengths(table["teacher_token_logprob"])
    ids = unpack_ids(_binary_rows(table["teacher_topk_ids_packed"], packed_id_width(top_k, bits)), top_k, bits)
    logprobs = dequantize_logprobs(
        _binary_rows(table["teacher_topk_lp_codes"], top_k),
        flat_values(table["teacher_topk_log_mass"]),
        flat_values(table["teacher_topk_log_range"]),
    )
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
