"""Rollout and annotated shards: their metadata, writing and reading them, and their validation.

Shards are Arrow IPC *stream* files (uncompressed by default), so
`datasets.Dataset.from_file`, `pyarrow`, `polars` and `duckdb` read them
without this package, and local reads are zero-copy through a memory map.

The columns themselves (their Arrow types, building and reading them as numpy) are in
opd_cache/storage/columns.py; this module re-exports the ones other modules import from here (`__all__`).

Schema versions: writers stamp SCHEMA_VERSION (2); readers accept every version in READABLE_SCHEMA_VERSIONS.
Version 2 adds the optional multi-turn columns of rollout shards (`loss_mask`, `turn_index`) and the
cross-tokenizer `target_flags` of annotated parts; a version-1 shard never holds them, so one that does is refused
rather than read with a meaning it never had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from opd_cache.storage import codec, integrity
from opd_cache.storage.columns import (
    LOSS_MASK,
    MULTI_TURN_COLUMNS,
    TARGET_FLAGS,
    TURN_INDEX,
    ShardError,
    annotated_schema,
    check_multi_turn,
    check_target_flags,
    flat_values,
    list_lengths,
    ragged,
    ragged_fixed,
    rollout_schema,
    trained_lengths,
    trained_mask,
)
from opd_cache.storage.layout import SCHEMA_VERSION
from opd_cache.storage.manifest import RunManifest, as_manifest

if TYPE_CHECKING:
    from opd_cache.storage.store import Store

__all__ = [  # the names other modules import from here that live in columns.py and layout.py
    "LOSS_MASK",
    "SCHEMA_VERSION",
    "TARGET_FLAGS",
    "TURN_INDEX",
    "ShardError",
    "annotated_schema",
    "flat_values",
    "list_lengths",
    "ragged",
    "ragged_fixed",
    "rollout_schema",
    "trained_lengths",
    "trained_mask",
]

READABLE_SCHEMA_VERSIONS = (1, 2)  # 2 = SCHEMA_VERSION, what this opd_cache writes
MULTI_TURN_SINCE = 2  # the first schema version whose rollout shards may hold loss_mask / turn_index
CROSS_TOKENIZER_SINCE = 2  # ... whose annotated parts may hold target_flags

ROLLOUT = "rollout"
ANNOTATED = "annotated"

# Metadata keys every shard carries (values are strings).
META_KIND = "opd.kind"
META_SCHEMA_VERSION = "opd.schema_version"
META_RUN_ID = "opd.run_id"
META_TOKENIZER = "opd.tokenizer_fingerprint"
META_SHARD_ID = "opd.shard_id"
META_POLICY_VERSION = "opd.policy_version"
META_TOP_K = "opd.top_k"
META_TEACHER = "opd.teacher"
META_TEMPERATURE = "opd.teacher_temperature"
META_STUDENT_TOPK = "opd.student_topk"
# What produced the shard (rollout: the student's sampler; annotated: the teacher's scorer); absent in old shards.
META_ENGINE = "opd.engine"
META_ENGINE_VERSION = "opd.engine_version"
META_MODEL_DTYPE = "opd.model_dtype"


class CorruptShardError(ShardError):
    """The stored bytes are damaged (checksum mismatch, truncation, undecodable): quarantine the file, regenerate.

    Unlike the other ShardErrors (a shard of another run or top-k is the user's to sort out), this one is never
    the configuration's fault, so the stages recover from it instead of stopping.
    """

    def __init__(self, message: str, rel: str):
        super().__init__(message)
        self.rel = rel  # store-relative path of the damaged file


# ---------------------------------------------------------------- metadata
@dataclass
class ShardMeta:
    kind: str
    run_id: str
    tokenizer_fingerprint: str
    shard_id: str
    policy_version: int
    top_k: int | None = None
    teacher: str | None = None
    student_topk: int = 0
    engine: str | None = None  # "hf" | "vllm"
    engine_version: str | None = None  # transformers / vllm version
    model_dtype: str | None = None  # the dtype the model's weights ran in
    schema_version: int = SCHEMA_VERSION
    codec: str = "none"  # annotated parts: "none" (plain columns) | "packed" (opd_cache/storage/codec.py)
    codec_id_bits: int = 0  # packed: bits per top-k id
    codec_version: int = 0  # packed: the layout's version (0: this opd_cache's codec.CODEC_VERSION when written)

    @property
    def packed_version(self) -> int:
        """The packed layout's version: as read, or this opd_cache's when the meta is new."""
        return self.codec_version or codec.CODEC_VERSION

    def to_metadata(self) -> dict[bytes, bytes]:
        meta = {
            META_KIND: self.kind,
            META_SCHEMA_VERSION: str(self.schema_version),
            META_RUN_ID: self.run_id,
            META_TOKENIZER: self.tokenizer_fingerprint,
            META_SHARD_ID: self.shard_id,
            META_POLICY_VERSION: str(self.policy_version),
            META_STUDENT_TOPK: str(self.student_topk),
        }
        if self.top_k is not None:
            meta[META_TOP_K] = str(self.top_k)
        if self.teacher is not None:
            meta[META_TEACHER] = self.teacher
            meta[META_TEMPERATURE] = "1.0"  # teacher log-probs are always of the raw distribution
        for key, value in (
            (META_ENGINE, self.engine),
            (META_ENGINE_VERSION, self.engine_version),
            (META_MODEL_DTYPE, self.model_dtype),
        ):
            if value is not None:
                meta[key] = value
        if self.codec != "none":
            meta.update(
                {
                    codec.META_CODEC: self.codec,
                    codec.META_CODEC_VERSION: str(self.packed_version),
                    codec.META_ID_BITS: str(self.codec_id_bits),
                }
            )
        return {k.encode(): v.encode() for k, v in meta.items()}

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes] | None, where: str) -> ShardMeta:
        meta = {k.decode(): v.decode() for k, v in (metadata or {}).items()}
        if META_KIND not in meta:
            raise ShardError(f"{where}: not an opd_cache shard (no '{META_KIND}' in the Arrow schema metadata)")
        version = int(meta.get(META_SCHEMA_VERSION, "-1"))
        if version not in READABLE_SCHEMA_VERSIONS:
            newer = " (written by a newer opd_cache: upgrade to read it)" if version > SCHEMA_VERSION else ""
            readable = " or ".join(str(v) for v in READABLE_SCHEMA_VERSIONS)
            raise ShardError(f"{where}: schema version {version}, this opd_cache reads version {readable}{newer}")
        codec_name, codec_id_bits, codec_version = codec.codec_of(meta, where)
        return cls(
            kind=meta[META_KIND],
            run_id=meta.get(META_RUN_ID, ""),
            tokenizer_fingerprint=meta.get(META_TOKENIZER, ""),
            shard_id=meta.get(META_SHARD_ID, ""),
            policy_version=int(meta.get(META_POLICY_VERSION, "0")),
            top_k=int(meta[META_TOP_K]) if META_TOP_K in meta else None,
            teacher=meta.get(META_TEACHER),
            student_topk=int(meta.get(META_STUDENT_TOPK, "0")),
            engine=meta.get(META_ENGINE),
            engine_version=meta.get(META_ENGINE_VERSION),
            model_dtype=meta.get(META_MODEL_DTYPE),
            schema_version=version,
            codec=codec_name,
            codec_id_bits=codec_id_bits,
            codec_version=codec_version,
        )


# ---------------------------------------------------------------- write / read
def write_shard(
    store, rel: str, table: pa.Table, meta: ShardMeta, compression: str | None = None, *, exclusive: bool = False
) -> None:
    """Validate `table` and publish it atomically at `rel` as an Arrow IPC stream plus its checksum trailer.

    `exclusive`: refuse (ShardError) to replace an existing file instead of replacing it: two writers given the
    same worker id would otherwise overwrite each other's shards. Atomic on local stores (a hard link of the
    complete file); on object stores a check before the upload, which two writers in the same instant can pass.
    """
    validate_table(table, meta, where=rel)
    metadata = {**meta.to_metadata(), integrity.META_CHECKSUM.encode(): integrity.TRAILER_KIND.encode()}
    table = table.replace_schema_metadata(metadata)
    options = pa.ipc.IpcWriteOptions(compression=compression)

    def write(out):
        sink = integrity.HashingWriter(out)  # hashes the stream on its way out
        with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), table.schema, options=options) as writer:
            writer.write_table(table)
        out.write(sink.trailer())

    if not exclusive:
        store.write_atomic(rel, write)
        return
    buffer = pa.BufferOutputStream()
    write(buffer)
    if not store.create_if_absent(rel, buffer.getvalue().to_pybytes()):
        raise ShardError(f"{store.path(rel)} already exists: another writer published a shard with this id")


def read_shard(
    store, rel: str, *, kind: str | None = None, run: RunManifest | dict | None = None
) -> tuple[pa.Table, ShardMeta]:
    """Read and validate a shard; raises ShardError naming the file and the problem."""
    where = store.path(rel)
    # The checksum first: a damaged file is reported as damaged, not as whatever its garbage happens to decode to.
    data = store.read_buffer(rel)  # FileNotFoundError passes through
    try:
        payload, checked = integrity.split_trailer(data, f"shard {where}")
    except integrity.ChecksumError as e:
        raise CorruptShardError(str(e), rel) from None
    try:
        table = pa.ipc.open_stream(pa.BufferReader(payload)).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, EOFError) as e:
        raise CorruptShardError(f"{where}: truncated or not an Arrow IPC stream ({e})", rel) from e
    try:
        # The IPC reader does not check that list offsets stay inside their value buffers; a crafted file
        # would make later kernels read out of bounds. Full validation is cheap next to decoding.
        table.validate(full=True)
    except pa.ArrowInvalid as e:
        raise CorruptShardError(f"{where}: invalid Arrow data ({e})", rel) from None
    if not checked:
        if (table.schema.metadata or {}).get(integrity.META_CHECKSUM.encode()):
            raise CorruptShardError(str(integrity.missing_trailer(f"shard {where}", len(data))), rel)
        integrity.legacy_warning("shard", where)
    meta = ShardMeta.from_metadata(table.schema.metadata, where)
    if kind is not None and meta.kind != kind:
        raise ShardError(f"{where}: is a {meta.kind!r} shard, expected {kind!r}")
    if run is not None:
        run = as_manifest(run)
        if meta.run_id != run.run_id:
            raise ShardError(f"{where}: belongs to run {meta.run_id!r}, this store is run {run.run_id!r}")
        fp = run.tokenizer_fingerprint
        if fp and meta.tokenizer_fingerprint != fp:
            raise ShardError(f"{where}: written with tokenizer {meta.tokenizer_fingerprint!r}, this run uses {fp!r}")
    validate_table(table, meta, where=where)
    if meta.codec == "packed":  # every reader (trainer, export, inspect) gets the plain columns
        table = codec.decode_annotation(table, meta.top_k, meta.codec_id_bits, where, meta.packed_version)
    return table, meta


def validate_table(table: pa.Table, meta: ShardMeta, where: str) -> None:
    """Check columns, types and per-row per-token list lengths (vectorised)."""
    if meta.kind == ROLLOUT:
        expected = rollout_schema(meta.student_topk, multi_turn=_has_multi_turn_columns(table, meta, where))
    elif meta.kind == ANNOTATED:
        if not meta.top_k:
            raise ShardError(f"{where}: annotated shard without '{META_TOP_K}' metadata")
        if meta.codec == "packed":
            codec.check_packed(table, meta.top_k, meta.codec_id_bits, where, meta.packed_version)
            reference = codec.PACKED if codec.PACKED in table.schema.names else "teacher_token_logprob"
            _check_same_lengths(table, reference, [*codec.PACKED_COLUMNS, "teacher_support_logprobs"], where)
            _check_version_of(table, meta, codec.packed_has_flags(table), where)
            return
        lp_type = (
            table.schema.field("teacher_topk_logprobs").type if "teacher_topk_logprobs" in table.schema.names else None
        )
        dtype = "float16" if lp_type is not None and lp_type.value_type.value_type == pa.float16() else "float32"
        support_k = 0
        if "teacher_support_logprobs" in table.schema.names:
            support_k = table.schema.field("teacher_support_logprobs").type.value_type.list_size
        flags = _check_version_of(table, meta, TARGET_FLAGS in table.schema.names, where)
        expected = annotated_schema(meta.top_k, dtype, support_k, target_flags=flags)
    else:
        raise ShardError(f"{where}: unknown shard kind {meta.kind!r}")

    for field in expected:
        if field.name not in table.schema.names:
            raise ShardError(f"{where}: missing column {field.name!r} ({field.type})")
        got = table.schema.field(field.name).type
        if got != field.type:
            raise ShardError(f"{where}: column {field.name!r} has type {got}, expected {field.type}")

    if meta.kind == ROLLOUT:
        prompt_lengths = list_lengths(table["prompt_ids"])
        if table.num_rows and prompt_lengths.min() == 0:
            raise ShardError(f"{where}: row {int(np.argmin(prompt_lengths))} has an empty prompt")
        _check_same_lengths(table, "response_ids", ["behavior_logprobs", "student_topk_ids"], where)
        if LOSS_MASK in table.schema.names:
            check_multi_turn(table, where)
    else:
        _check_same_lengths(
            table,
            "teacher_token_logprob",
            ["teacher_topk_ids", "teacher_topk_logprobs", "teacher_support_logprobs", TARGET_FLAGS],
            where,
        )
        if TARGET_FLAGS in table.schema.names:
            check_target_flags(table, where)


def _check_version_of(table: pa.Table, meta: ShardMeta, has_flags: bool, where: str) -> bool:
    """A part with `target_flags` (cross-tokenizer targets) must be schema version 2 or later."""
    if has_flags and meta.schema_version < CROSS_TOKENIZER_SINCE:
        raise ShardError(
            f"{where}: schema version {meta.schema_version} part with column {TARGET_FLAGS!r}, which only version "
            f"{CROSS_TOKENIZER_SINCE} and later have"
        )
    return has_flags


def _has_multi_turn_columns(table: pa.Table, meta: ShardMeta, where: str) -> bool:
    present = [name for name in MULTI_TURN_COLUMNS if name in table.schema.names]
    if present and meta.schema_version < MULTI_TURN_SINCE:
        raise ShardError(
            f"{where}: schema version {meta.schema_version} shard with column {present[0]!r}, which only version "
            f"{MULTI_TURN_SINCE} and later have"
        )
    if len(present) == 1:
        missing = next(name for name in MULTI_TURN_COLUMNS if name not in present)
        raise ShardError(f"{where}: column {present[0]!r} without {missing!r} (multi-turn rows need both)")
    return bool(present)


def _check_same_lengths(table: pa.Table, reference: str, others: list[str], where: str) -> None:
    ref = list_lengths(table[reference])
    for name in others:
        if name not in table.schema.names:
            continue
        got = list_lengths(table[name])
        bad = np.nonzero(got != ref)[0]
        if len(bad):
            r = int(bad[0])
            raise ShardError(
                f"{where}: row {r} (sample {table['sample_id'][r].as_py()!r}) has {got[r]} entries in "
                f"{name!r} but {ref[r]} in {reference!r}"
            )


def check_annotation_matches(
    rollout: pa.Table, annotated: pa.Table, where: str, *, every_row: bool = True
) -> np.ndarray:
    """An annotated part must cover samples of its rollout shard, in rollout order, with one entry per response
    token it trains (every response token of a single-turn row, the loss_mask=1 ones of a multi-turn
    row); returns the rollout row of each of its rows. `every_row=False` accepts a part that covers only some
    rows (routing sends the others to other teachers)."""
    if annotated.num_rows == rollout.num_rows and annotated["sample_id"].equals(rollout["sample_id"]):
        rows = np.arange(rollout.num_rows, dtype=np.int64)
    else:
        found = pc.index_in(annotated["sample_id"], value_set=rollout["sample_id"])
        if found.null_count or (every_row and annotated.num_rows != rollout.num_rows):
            missing = np.nonzero(found.is_null().to_numpy(zero_copy_only=False))[0]
            which = (
                f" (sample {annotated['sample_id'][int(missing[0])].as_py()!r} is not in it)" if len(missing) else ""
            )
            raise ShardError(f"{where}: sample ids differ from its rollout shard{which}")
        rows = found.to_numpy(zero_copy_only=False).astype(np.int64)
        if len(rows) > 1 and not np.all(np.diff(rows) > 0):
            raise ShardError(f"{where}: rows are not in rollout order (or repeat a sample)")
    expected = trained_lengths(rollout)[rows]  # one entry per trained position ("Schema version 2")
    got = list_lengths(annotated["teacher_token_logprob"])
    bad = np.nonzero(expected != got)[0]
    if len(bad):
        r = int(bad[0])
        raise ShardError(
            f"{where}: row {r} has {got[r]} teacher positions but its response has {expected[r]} tokens to train"
        )
    return rows


# ---------------------------------------------------------------- table builders
def _concat(arrays: list, dtype) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    flat = np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype=dtype)
    return flat, lengths


def rollout_table(
    *,
    sample_ids: list[str],
    prompt_index,
    sample_index,
    prompt_ids: list,
    response_ids: list,
    behavior_logprobs: list,
    policy_version: int,
    finish_reason: list[str],
    data_source: list | None = None,
    ground_truth: list | None = None,
    extra: list | None = None,
    student_topk_ids: list | None = None,
    student_topk: int = 0,
    loss_mask: list | None = None,
    turn_index: list | None = None,
) -> pa.Table:
    """A rollout table from per-row token arrays (one concatenation per column, no per-row Arrow work).

    `loss_mask` / `turn_index` (schema version 2): one array per row, or None for a single-turn row; both or
    neither. Without them (None) the table has no multi-turn columns: exactly a version-1 table.
    """
    n = len(sample_ids)
    prompt_flat, prompt_len = _concat(prompt_ids, np.int32)
    resp_flat, resp_len = _concat(response_ids, np.int32)
    lp_flat, lp_len = _concat(behavior_logprobs, np.float32)  # own lengths, so validation sees a mismatch
    columns = {
        "sample_id": pa.array(sample_ids, pa.string()),
        "prompt_index": pa.array(np.asarray(prompt_index, dtype=np.int64)),
        "sample_index": pa.array(np.asarray(sample_index, dtype=np.int32)),
        "prompt_ids": ragged(prompt_flat, prompt_len, pa.int32()),
        "response_ids": ragged(resp_flat, resp_len, pa.int32()),
        "behavior_logprobs": ragged(lp_flat, lp_len, pa.float32()),
    }
    if student_topk_ids is not None:
        if not student_topk:
            raise ValueError("rollout_table: student_topk_ids needs student_topk=k")
        flat = np.concatenate([np.asarray(a, dtype=np.int32).reshape(-1, student_topk) for a in student_topk_ids])
        columns["student_topk_ids"] = ragged_fixed(flat, resp_len, pa.int32())
    if (loss_mask is None) != (turn_index is None):
        raise ValueError("rollout_table: loss_mask and turn_index go together (both or neither)")
    if loss_mask is not None:
        columns[LOSS_MASK] = _nullable_ragged(loss_mask, np.uint8, pa.uint8())
        columns[TURN_INDEX] = _nullable_ragged(turn_index, np.int16, pa.int16())
    columns.update(
        {
            "policy_version": pa.array(np.full(n, policy_version, dtype=np.int32)),
            "finish_reason": pa.array(finish_reason, pa.string()),
            "data_source": pa.array(data_source if data_source is not None else [None] * n, pa.string()),
            "ground_truth": pa.array(ground_truth if ground_truth is not None else [None] * n, pa.string()),
            "extra": pa.array(extra if extra is not None else [None] * n, pa.string()),
        }
    )
    return pa.table(columns, schema=rollout_schema(student_topk, multi_turn=loss_mask is not None))


def _nullable_ragged(rows: list, dtype, value_type: pa.DataType) -> pa.ListArray:
    """A `list<value>` column whose None rows are null (a single-turn row in a multi-turn column)."""
    present = [r is not None for r in rows]
    flat, lengths = _concat([r for r in rows if r is not None], dtype)
    all_lengths = np.zeros(len(rows), dtype=np.int64)
    all_lengths[np.asarray(present, dtype=bool)] = lengths
    offsets = pa.array(np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int32))
    mask = pa.array([not p for p in present], pa.bool_()) if not all(present) else None
    return pa.ListArray.from_arrays(offsets, pa.array(flat, type=value_type), mask=mask)


def annotated_table(
    *,
    sample_ids,
    lengths,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    token_logprob: np.ndarray,
    logprob_dtype: str = "float32",
    support_logprobs: np.ndarray | None = None,
    target_flags: np.ndarray | None = None,
) -> pa.Table:
    """An annotated part from flat `[total_tokens, k]` arrays and per-row response lengths (`target_flags`:
    `[total_tokens]` uint8, the cross-tokenizer flags)."""
    k = topk_ids.shape[1]
    support_k = support_logprobs.shape[1] if support_logprobs is not None else 0
    schema = annotated_schema(k, logprob_dtype, support_k, target_flags=target_flags is not None)
    lp_type = schema.field("teacher_topk_logprobs").type.value_type.value_type
    columns = {
        "sample_id": pa.array(list(sample_ids), pa.string()),
        "teacher_topk_ids": ragged_fixed(topk_ids.astype(np.int32, copy=False), lengths, pa.int32()),
        "teacher_topk_logprobs": ragged_fixed(
            topk_logprobs.astype(np.float16 if lp_type == pa.float16() else np.float32, copy=False), lengths, lp_type
        ),
        "teacher_token_logprob": ragged(token_logprob.astype(np.float32, copy=False), lengths, pa.float32()),
    }
    if support_k:
        columns["teacher_support_logprobs"] = ragged_fixed(
            support_logprobs.astype(np.float32, copy=False), lengths, pa.float32()
        )
    if target_flags is not None:
        columns[TARGET_FLAGS] = ragged(target_flags.astype(np.uint8, copy=False), lengths, pa.uint8())
    return pa.table(columns, schema=schema)


def count_rows(store: Store, rel: str) -> int:
    """Rows of an Arrow IPC stream file (zero-copy through a memory map on local stores)."""
    with store.open_input_file(rel) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
