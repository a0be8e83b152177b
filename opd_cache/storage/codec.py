"""The `packed` codec of annotated parts: the top-k ids as a set, 8-bit top-k log-probs, 16-bit mass and token.

A plain part stores per response position k int32 ids and k float16/float32
log-probs (389 bytes/token at k = 64 in float16), best first. A packed part
(codec version 3) stores every per-position field in one struct, so the fields
share one list offsets buffer:

    sample_id               string
    teacher_topk_packed     list<struct<
        ids_bitmap   fixed_size_binary(ceil(V / 8))      the set as V bits (bit id set), little-endian
          or ids_packed  fixed_size_binary(ceil(k * b / 8))  the ids at b = ceil(log2 V) bits (order below)
        lp_codes     fixed_size_binary(k)                  one uint8 code per entry, aligned with the ids
        range_level  uint8                                 the row's quantization range L, a grid level
          or log_range   float32                           L itself (a row spans more than 1e6 nats)
        mass_code    int16                                 logit of the top-k mass in steps of 2**-8
        token_code   uint16                                -log p of the sampled token in steps of 2**-9
        target_flags uint8                                 cross-tokenizer parts only (opd_cache/target_flags.py)
    >>

A cross-tokenizer part (a teacher with another tokenizer, docs/cross-tokenizer.md) adds the `target_flags`
child; its `token_code` holds the aligned group's log-prob at the group's end (0 elsewhere), in the same steps:
a group less likely than e**-128 (p < 1e-55) is stored as that bound, like a sampled token.

Each part makes its own choices, and its schema records them: the bitmap when it
is smaller (ceil(V/8) < ceil(k*b/8) bytes: V = 99, k = 64 takes 13 bytes instead
of 56) and the ids are distinct, with V in the field's metadata
('opd.vocab_size') so its width is checked; packed ids otherwise, in id or in
rank order, whichever zstd compresses less (sorted ids repeat across a trained
teacher's positions; codes rise along a rank-ordered row), recorded in the
codes' field metadata ('opd.entry_order'). A reader
restores rank order with one sort of (code << b | id) keys per position (codes
rise as log-probs fall): every consumer sees entries best first, ties by
ascending id.

The id packings (b-bit ids, bitmaps) are in opd_cache/storage/idpack.py.
The quantizers, their scales and the error bounds that tests/test_codec.py checks for every entry are in
opd_cache/storage/quantize.py: log-probs as 8-bit codes relative to the row's maximum (gap scale 1 nat), the
mass so that both log m and the tail log(1 - m) keep ~2**-9 precision, the sampled token's log-prob within
2**-10 nats (the k1/k3 estimators and policy-gradient OPD read it).

The codec version and the id width live in the part's Arrow metadata; a reader
refuses versions from the future and packed fields of the wrong width. Earlier
versions decode unchanged, with their own gap scale (4) and exact floats:
version 2 parts have one flat list column per field (`teacher_topk_ids_bitmap` or
`teacher_topk_ids_packed`, `teacher_topk_lp_codes`, `teacher_topk_log_mass` float32,
`teacher_topk_range_level` or `teacher_topk_log_range`, `teacher_token_logprob`
float32); version 1 parts are laid out the same with ids in rank order and float32
ranges (the sort keeps their order but for ties).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa

from opd_cache.storage.columns import (
    TARGET_FLAGS,
    annotated_schema,
    flat_values,
    list_lengths,
    offsets_from_lengths,
    ragged,
    ragged_fixed,
)
from opd_cache.storage.idpack import (
    CodecError,
    bitmap_width,
    id_bits,
    pack_id_bitmap,
    pack_ids,
    packed_id_width,
    unpack_id_bitmap,
    unpack_ids,
)
from opd_cache.storage.quantize import (
    GAP_SCALE,
    LEGACY_GAP_SCALE,
    TABLE_CHUNK,
    dequantize_chunk,
    dequantize_logprobs,
    dequantize_mass,
    dequantize_token_logprob,
    grid_levels,
    quantize_logprobs,
    quantize_mass,
    quantize_token_logprob,
)

CODEC_VERSION = 3  # 1: ids in rank order at b bits, float32 L; 2: flat columns, exact float32 mass and token log-prob
CODECS = ("none", "packed")
META_CODEC = "opd.codec"
META_CODEC_VERSION = "opd.codec_version"
META_ID_BITS = "opd.codec_id_bits"


# ---------------------------------------------------------------- tables
PACKED = "teacher_topk_packed"  # version 3: every per-token field of a packed part in one list<struct> column
IDS_PACKED, IDS_BITMAP = "ids_packed", "ids_bitmap"  # its id child: k ids at b bits, or the set as V bits
META_VOCAB = b"opd.vocab_size"  # field metadata of the bitmap child: V, so its width can be checked
META_ORDER = b"opd.entry_order"  # field metadata of the codes child: "id" or "rank", the order a part stores entries in

# the per-token columns a packed part may hold (opd_cache/storage/schema.py checks that their lengths agree): version 3's
# one column, and versions 1 and 2's flat columns (read only)
LEGACY_IDS_PACKED, LEGACY_IDS_BITMAP = "teacher_topk_ids_packed", "teacher_topk_ids_bitmap"
PACKED_COLUMNS = (
    PACKED,
    LEGACY_IDS_PACKED,
    LEGACY_IDS_BITMAP,
    "teacher_topk_lp_codes",
    "teacher_topk_log_mass",
    "teacher_topk_log_range",
    "teacher_topk_range_level",
)


def _zstd_size(rows: np.ndarray) -> int:
    return pa.compress(np.ascontiguousarray(rows).reshape(-1), codec="zstd", asbytes=False).size


def _fixed_binary(rows: np.ndarray) -> pa.FixedSizeBinaryArray:
    """`[N, width]` uint8 rows as one fixed_size_binary(width) array (one copy of the bytes)."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    width = rows.shape[1]
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(rows), [None, pa.py_buffer(rows.tobytes())])


def packed_fields(
    top_k: int,
    bits: int,
    *,
    vocab_size: int = 0,
    range_levels: bool = True,
    order: str | None = None,
    target_flags: bool = False,
) -> list[pa.Field]:
    """The columns of a version-3 packed part (an optional `teacher_support_logprobs` comes after them): the
    per-token struct with ids as a bitmap (vocab_size > 0) or packed, ranges as levels or float32, the mass and
    the sampled token's log-prob as opd_cache/storage/quantize.py codes; `order` ("id" or "rank") goes in the codes'
    metadata; `target_flags` adds the cross-tokenizer flags child."""
    if vocab_size:
        ids = pa.field(
            IDS_BITMAP,
            pa.binary(bitmap_width(vocab_size)),
            nullable=False,
            metadata={META_VOCAB: str(vocab_size).encode()},
        )
    else:
        ids = pa.field(IDS_PACKED, pa.binary(packed_id_width(top_k, bits)), nullable=False)
    rng = ("range_level", pa.uint8()) if range_levels else ("log_range", pa.float32())
    struct = pa.struct(
        [
            ids,
            pa.field(
                "lp_codes", pa.binary(top_k), nullable=False, metadata={META_ORDER: order.encode()} if order else None
            ),
            pa.field(*rng, nullable=False),
            pa.field("mass_code", pa.int16(), nullable=False),
            pa.field("token_code", pa.uint16(), nullable=False),
            *([pa.field(TARGET_FLAGS, pa.uint8(), nullable=False)] if target_flags else []),
        ]
    )
    return [pa.field("sample_id", pa.string(), nullable=False), pa.field(PACKED, pa.list_(struct), nullable=False)]


def encode_annotation(table: pa.Table, vocab_size: int) -> tuple[pa.Table, dict[str, str]]:
    """A plain annotated table -> (its packed table, the codec's metadata entries).

    The choices of id layout, entry order and range child are the part's own and show in its schema (module
    docstring).
    """
    bits = id_bits(vocab_size)
    lengths = list_lengths(table["teacher_token_logprob"])
    k = table.schema.field("teacher_topk_ids").type.value_type.list_size
    ids = flat_values(table["teacher_topk_ids"]).reshape(-1, k)
    codes, log_mass, log_range = quantize_logprobs(flat_values(table["teacher_topk_logprobs"]).reshape(-1, k))
    level, on_grid = grid_levels(log_range)
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
    flags = TARGET_FLAGS in table.schema.names
    fields = packed_fields(
        k, bits, vocab_size=vocab_size if use_bitmap else 0, range_levels=range_levels, order=order, target_flags=flags
    )
    struct = fields[1].type.value_type
    children = [
        _fixed_binary(id_rows),
        _fixed_binary(codes),
        pa.array(level.astype(np.uint8)) if range_levels else pa.array(log_range, pa.float32()),
        pa.array(quantize_mass(log_mass)),
        pa.array(quantize_token_logprob(flat_values(table["teacher_token_logprob"]))),
    ]
    if flags:
        children.append(pa.array(flat_values(table[TARGET_FLAGS]).astype(np.uint8, copy=False)))
    per_token = pa.StructArray.from_arrays(children, fields=list(struct))
    columns = [
        table["sample_id"],
        pa.ListArray.from_arrays(pa.array(offsets_from_lengths(lengths)), per_token),
    ]
    if "teacher_support_logprobs" in table.schema.names:
        columns.append(table["teacher_support_logprobs"])
        fields.append(table.schema.field("teacher_support_logprobs"))
    meta = {META_CODEC: "packed", META_CODEC_VERSION: str(CODEC_VERSION), META_ID_BITS: str(bits)}
    return pa.table(columns, schema=pa.schema(fields)), meta


def codec_of(metadata: dict[str, str], where: str) -> tuple[str, int, int]:
    """(codec name, id bits, codec version) from decoded Arrow metadata; refuses unknown codecs and versions from
    the future."""
    codec = metadata.get(META_CODEC, "none")
    if codec == "none":
        return "none", 0, 0
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
    return codec, bits, version


def _vocab_of(field: pa.Field, bits: int, where: str) -> int:
    vocab = (field.metadata or {}).get(META_VOCAB)
    if vocab is None or not vocab.isdigit() or not 1 <= int(vocab) <= 1 << bits:
        raise CodecError(f"{where}: packed column {field.name!r} has no valid '{META_VOCAB.decode()}' metadata")
    return int(vocab)


def _expected_fields(table: pa.Table, top_k: int, bits: int, version: int, where: str) -> list[pa.Field]:
    """The packed fields this table's own choices (id layout, range child or column) call for."""
    if version >= 3:
        got = table.schema.field(PACKED).type if PACKED in table.schema.names else None
        struct = got.value_type if got is not None and pa.types.is_list(got) else None
        if struct is None or not pa.types.is_struct(struct):
            raise CodecError(f"{where}: packed part (codec version {version}) has no list<struct> column {PACKED!r}")
        names = [f.name for f in struct]
        vocab = _vocab_of(struct.field(IDS_BITMAP), bits, where) if IDS_BITMAP in names else 0
        return packed_fields(
            top_k, bits, vocab_size=vocab, range_levels="log_range" not in names, target_flags=TARGET_FLAGS in names
        )
    names = table.schema.names
    vocab = _vocab_of(table.schema.field(LEGACY_IDS_BITMAP), bits, where) if LEGACY_IDS_BITMAP in names else 0
    return _legacy_fields(top_k, bits, vocab_size=vocab, range_levels="teacher_topk_log_range" not in names)


def packed_has_flags(table: pa.Table) -> bool:
    """Whether a packed part (any codec version) carries cross-tokenizer `target_flags`."""
    if PACKED not in table.schema.names:
        return False
    struct = table.schema.field(PACKED).type.value_type
    return pa.types.is_struct(struct) and struct.get_field_index(TARGET_FLAGS) >= 0


def _legacy_fields(top_k: int, bits: int, *, vocab_size: int, range_levels: bool) -> list[pa.Field]:
    """The flat columns of a version 1 or 2 part (read only): the same fields, one list column each, and the
    sampled token's and the mass's exact float32 log-probs."""
    ids = (
        pa.field(LEGACY_IDS_BITMAP, pa.list_(pa.binary(bitmap_width(vocab_size))))
        if vocab_size
        else pa.field(LEGACY_IDS_PACKED, pa.list_(pa.binary(packed_id_width(top_k, bits))))
    )
    rng = ("teacher_topk_range_level", pa.uint8()) if range_levels else ("teacher_topk_log_range", pa.float32())
    return [
        pa.field("sample_id", pa.string()),
        ids,
        pa.field("teacher_topk_lp_codes", pa.list_(pa.binary(top_k))),
        pa.field("teacher_topk_log_mass", pa.list_(pa.float32())),
        pa.field(rng[0], pa.list_(rng[1])),
        pa.field("teacher_token_logprob", pa.list_(pa.float32())),
    ]


def _truncation(name: str, got: pa.DataType, want: pa.DataType, top_k: int, bits: int, where: str) -> str | None:
    """A one-line message when a fixed-size binary field has the wrong width (a truncated part), else None."""
    got = got.value_type if pa.types.is_list(got) else got
    want = want.value_type if pa.types.is_list(want) else want
    if pa.types.is_fixed_size_binary(got) and pa.types.is_fixed_size_binary(want) and got != want:
        return (
            f"{where}: packed column {name!r} is truncated: {got.byte_width} bytes per position, expected "
            f"{want.byte_width} (k={top_k}, {bits}-bit ids)"
        )
    return None


def check_packed(table: pa.Table, top_k: int, bits: int, where: str, version: int = CODEC_VERSION) -> None:
    """Column types and widths of a packed part; a truncated field is refused with its expected width."""
    for field in _expected_fields(table, top_k, bits, version, where):
        if field.name not in table.schema.names:
            raise CodecError(f"{where}: packed part is missing column {field.name!r} ({field.type})")
        got = table.schema.field(field.name).type
        if got == field.type:
            continue
        message = _truncation(field.name, got, field.type, top_k, bits, where)
        if message is None and field.name == PACKED:  # (_expected_fields checked it is a list<struct>)
            got_children = {child.name: child.type for child in got.value_type}
            for want in field.type.value_type:
                if want.name in got_children:
                    name = f"{PACKED}.{want.name}"
                    message = message or _truncation(name, got_children[want.name], want.type, top_k, bits, where)
        raise CodecError(message or f"{where}: packed column {field.name!r} has type {got}, expected {field.type}")


def _binary_rows(array: pa.Array, width: int) -> np.ndarray:
    """The values of a fixed_size_binary(width) array as `[N, width]` uint8 (no copy)."""
    data = np.frombuffer(array.buffers()[1], dtype=np.uint8)
    start = array.offset * width
    return data[start : start + len(array) * width].reshape(-1, width)


def _list_values(column: pa.ChunkedArray) -> pa.Array:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.flatten()


class _Stored(NamedTuple):
    """A packed part's per-token fields as arrays, whichever version laid them out."""

    ids: pa.FixedSizeBinaryArray
    bitmap: bool
    codes: np.ndarray  # [N, k] uint8, in the part's entry order
    log_mass: np.ndarray  # [N] float32
    range_level: np.ndarray | None  # [N] uint8, or None when the part keeps float32 ranges
    log_range: np.ndarray | None
    token_logprob: pa.Array  # list<float32>, the plain column
    gap_scale: float
    target_flags: pa.Array | None = None  # list<uint8>, cross-tokenizer parts


def _stored_fields(table: pa.Table, top_k: int, version: int) -> _Stored:
    """Version 3's struct fields, or versions 1 and 2's flat columns, as one set of arrays (no copies but the
    decoded mass and sampled-token log-probs)."""
    if version >= 3:
        column = table[PACKED].combine_chunks()
        lengths = list_lengths(column)
        per_token = column.flatten()  # the struct's rows of this part, offsets applied
        child = dict(zip([f.name for f in per_token.type], per_token.flatten(), strict=True))
        bitmap = IDS_BITMAP in child
        token_lp = dequantize_token_logprob(child["token_code"].to_numpy(zero_copy_only=False))
        return _Stored(
            ids=child[IDS_BITMAP if bitmap else IDS_PACKED],
            bitmap=bitmap,
            codes=_binary_rows(child["lp_codes"], top_k),
            log_mass=dequantize_mass(child["mass_code"].to_numpy(zero_copy_only=False)),
            range_level=child["range_level"].to_numpy(zero_copy_only=False) if "range_level" in child else None,
            log_range=child["log_range"].to_numpy(zero_copy_only=False) if "log_range" in child else None,
            token_logprob=ragged(token_lp, lengths, pa.float32()),
            gap_scale=GAP_SCALE,
            target_flags=(
                ragged(child[TARGET_FLAGS].to_numpy(zero_copy_only=False), lengths, pa.uint8())
                if TARGET_FLAGS in child
                else None
            ),
        )
    names = table.schema.names
    bitmap = LEGACY_IDS_BITMAP in names
    return _Stored(
        ids=_list_values(table[LEGACY_IDS_BITMAP if bitmap else LEGACY_IDS_PACKED]),
        bitmap=bitmap,
        codes=_binary_rows(_list_values(table["teacher_topk_lp_codes"]), top_k),
        log_mass=flat_values(table["teacher_topk_log_mass"]),
        range_level=flat_values(table["teacher_topk_range_level"]) if "teacher_topk_range_level" in names else None,
        log_range=flat_values(table["teacher_topk_log_range"]) if "teacher_topk_log_range" in names else None,
        token_logprob=table["teacher_token_logprob"],
        gap_scale=LEGACY_GAP_SCALE,
    )


def decode_annotation(
    table: pa.Table, top_k: int, bits: int, where: str = "packed part", version: int = CODEC_VERSION
) -> pa.Table:
    """A packed part -> the plain columns (`teacher_topk_ids` int32, `teacher_topk_logprobs` float32, ...).

    Each row's entries come back in rank order, best first (ties by ascending id), as a plain part has them.
    """
    _expected_fields(table, top_k, bits, version, where)  # (checks the bitmap's V)
    stored = _stored_fields(table, top_k, version)
    n = len(stored.codes)
    lengths = list_lengths(stored.token_logprob)
    if stored.bitmap:
        width = stored.ids.type.byte_width
        id_rows = _binary_rows(stored.ids, width)
        key_bits = max(1, (8 * width - 1).bit_length())

        def unpack(rows, out):
            unpack_id_bitmap(id_rows[rows], top_k, where, out=out)
    else:
        id_rows = _binary_rows(stored.ids, packed_id_width(top_k, bits))
        key_bits = bits

        def unpack(rows, out):
            unpack_ids(id_rows[rows], top_k, bits, out=out)

    key_type = np.uint16 if key_bits <= 8 else np.uint32 if key_bits <= 24 else np.uint64
    id_mask = key_type((1 << key_bits) - 1)
    if stored.range_level is not None:
        level_base = stored.range_level.astype(np.uint16) << np.uint16(8)
    ids = np.empty((n, top_k), dtype=np.int32)
    logprobs = np.empty((n, top_k), dtype=np.float32)
    key_buffer = np.empty((min(n, TABLE_CHUNK), top_k), dtype=key_type)
    # TABLE_CHUNK positions at a time, every step on arrays that stay in cache
    for start in range(0, n, TABLE_CHUNK):
        rows = slice(start, start + TABLE_CHUNK)
        chunk_codes = stored.codes[rows]
        # Rank order: sort each position's (code, id) keys. Codes rise as log-probs fall, so the sorted keys hold
        # the entries best first, ties by ascending id. (Version-1 parts, stored in rank order, stay as they are
        # but for the order of ties.)
        keys = key_buffer[: len(chunk_codes)]
        unpack(rows, keys)
        keys |= chunk_codes.astype(key_type) << key_type(key_bits)
        keys.sort(axis=1)
        ranked_codes = (keys >> key_type(key_bits)).astype(np.uint8)
        np.bitwise_and(keys, id_mask, out=ids[rows], casting="unsafe")
        if stored.range_level is not None:
            dequantize_chunk(ranked_codes, stored.log_mass[rows], level_base[rows], logprobs[rows], stored.gap_scale)
        else:
            logprobs[rows] = dequantize_logprobs(
                ranked_codes, stored.log_mass[rows], stored.log_range[rows], stored.gap_scale
            )
    columns = {
        "sample_id": table["sample_id"],
        "teacher_topk_ids": ragged_fixed(ids, lengths, pa.int32()),
        "teacher_topk_logprobs": ragged_fixed(logprobs, lengths, pa.float32()),
        "teacher_token_logprob": stored.token_logprob,
    }
    support_k = 0
    if "teacher_support_logprobs" in table.schema.names:
        columns["teacher_support_logprobs"] = table["teacher_support_logprobs"]
        support_k = table.schema.field("teacher_support_logprobs").type.value_type.list_size
    if stored.target_flags is not None:
        columns[TARGET_FLAGS] = stored.target_flags
    schema = annotated_schema(top_k, "float32", support_k, target_flags=stored.target_flags is not None)
    schema = schema.with_metadata(table.schema.metadata)
    return pa.table(columns, schema=schema)
