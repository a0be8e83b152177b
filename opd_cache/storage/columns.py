"""The columns of a shard: their Arrow types, and building or reading them as flat numpy arrays.

Per-token columns are `list<…>` with one entry per response token; per-token
top-k columns are `list<fixed_size_list<…, k>>`, so a whole column decodes to a
dense `[total_tokens, k]` array without any per-row work.

Schema version 2 adds two optional per-response-token columns to rollout shards, for multi-turn rows (a
conversation rendered into one token sequence, docs/design.md §3 "Schema version 2"): `loss_mask` (uint8, 1 = a
token the student sampled in an assistant turn) and `turn_index` (int16, the message the token belongs to).
Both or neither; a null entry is a single-turn row (every response position trained). Annotated parts of a
teacher with another tokenizer add `target_flags` (uint8 per trained position, opd_cache/target_flags.py).

opd_cache/storage/codec.py (the packed annotation columns) and opd_cache/storage/schema.py (shard
metadata, reading, writing, validation) both build on this module; it imports neither.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from opd_cache.target_flags import ALL_FLAGS

try:
    # pyarrow's C++ converter (every to_numpy below) imports pandas on its first call and drops any exception
    # raised meanwhile, the KeyboardInterrupt of a Ctrl-C included: a stage interrupted during that import
    # (a second or more on a busy machine) went on working. Imported here, a Ctrl-C during it stops the process.
    import pandas  # noqa: F401
except ImportError:  # pyarrow works without pandas, and then imports nothing
    pass


class ShardError(ValueError):
    """A shard that cannot be used: truncated, foreign, from another run, or internally inconsistent."""


LOSS_MASK = "loss_mask"
TURN_INDEX = "turn_index"
MULTI_TURN_COLUMNS = (LOSS_MASK, TURN_INDEX)
TARGET_FLAGS = "target_flags"  # cross-tokenizer annotated parts (schema version 2)


def rollout_schema(student_topk: int = 0, multi_turn: bool = False) -> pa.Schema:
    """The rollout shard's columns; `multi_turn` adds `loss_mask` and `turn_index` (schema version 2)."""
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("policy_version", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("data_source", pa.string()),
        pa.field("ground_truth", pa.string()),
        pa.field("extra", pa.string()),
    ]
    if multi_turn:  # per-token columns stay together, after behavior_logprobs (and student_topk_ids)
        fields[6:6] = [pa.field(LOSS_MASK, pa.list_(pa.uint8())), pa.field(TURN_INDEX, pa.list_(pa.int16()))]
    if student_topk:
        fields.insert(6, pa.field("student_topk_ids", pa.list_(pa.list_(pa.int32(), student_topk))))
    return pa.schema(fields)


def annotated_schema(
    top_k: int, logprob_dtype: str = "float32", support_k: int = 0, target_flags: bool = False
) -> pa.Schema:
    """An annotated part's columns; `target_flags` adds the cross-tokenizer flags column (schema version 2)."""
    value_type = {"float16": pa.float16(), "float32": pa.float32()}.get(logprob_dtype)
    if value_type is None:
        raise ValueError(f"logprob dtype {logprob_dtype!r} is not supported: use float16 or float32")
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("teacher_topk_ids", pa.list_(pa.list_(pa.int32(), top_k)), nullable=False),
        pa.field("teacher_topk_logprobs", pa.list_(pa.list_(value_type, top_k)), nullable=False),
        pa.field("teacher_token_logprob", pa.list_(pa.float32()), nullable=False),
    ]
    if support_k:
        fields.append(pa.field("teacher_support_logprobs", pa.list_(pa.list_(pa.float32(), support_k))))
    if target_flags:
        fields.append(pa.field(TARGET_FLAGS, pa.list_(pa.uint8()), nullable=False))
    return pa.schema(fields)


def check_target_flags(table: pa.Table, where: str) -> None:
    """Flag values use only the known bits (opd_cache/target_flags.py), vectorised over the column."""
    flags = flat_values(table[TARGET_FLAGS])
    bad = np.nonzero(flags & ~np.uint8(ALL_FLAGS))[0]
    if len(bad):
        row = int(np.searchsorted(np.cumsum(list_lengths(table[TARGET_FLAGS])), int(bad[0]), side="right"))
        raise ShardError(
            f"{where}: row {row} (sample {table['sample_id'][row].as_py()!r}) has target_flags value "
            f"{int(flags[bad[0]])}, outside the known bits {ALL_FLAGS:#x}"
        )


def check_multi_turn(table: pa.Table, where: str) -> None:
    """Multi-turn rows: a mask and a turn index per response token, mask values 0/1, at least one trained token,
    turn indices that never go back, behavior log-probs 0.0 where nothing is trained. Null entries (single-turn
    rows) are not looked at. Vectorised over the whole column."""

    def row_error(r: int, problem: str) -> ShardError:
        return ShardError(f"{where}: row {r} (sample {table['sample_id'][r].as_py()!r}) {problem}")

    mask_null = table[LOSS_MASK].is_null().to_numpy(zero_copy_only=False)
    turn_null = table[TURN_INDEX].is_null().to_numpy(zero_copy_only=False)
    differ = np.nonzero(mask_null != turn_null)[0]
    if len(differ):
        r = int(differ[0])
        has, lacks = (TURN_INDEX, LOSS_MASK) if mask_null[r] else (LOSS_MASK, TURN_INDEX)
        raise row_error(r, f"has a {has!r} but no {lacks!r}")
    rows = np.nonzero(~mask_null)[0]
    if not len(rows):
        return
    multi = table.take(pa.array(rows))
    response = list_lengths(multi["response_ids"])
    for name in MULTI_TURN_COLUMNS:
        got = list_lengths(multi[name])
        bad = np.nonzero(got != response)[0]
        if len(bad):
            r = int(bad[0])
            raise row_error(int(rows[r]), f"has {got[r]} entries in {name!r} but {response[r]} in 'response_ids'")
    mask = flat_values(multi[LOSS_MASK])
    ends = np.cumsum(response)  # row r's tokens are [ends[r - 1], ends[r]) of the flat columns

    def row_of(position: int) -> int:
        return int(rows[int(np.searchsorted(ends, position, side="right"))])

    if len(mask) and mask.max() > 1:
        position = int(np.argmax(mask > 1))
        raise row_error(row_of(position), f"has loss_mask value {int(mask[position])}: the mask holds 0 or 1")
    trained = np.diff(np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])[np.concatenate([[0], ends])])
    empty = np.nonzero(trained == 0)[0]
    if len(empty):
        raise row_error(
            int(rows[int(empty[0])]),
            "has no trained token (its loss_mask is all 0): a row with nothing to train is not written",
        )
    turns = flat_values(multi[TURN_INDEX]).astype(np.int64)
    steps = np.diff(turns)
    steps[ends[:-1][ends[:-1] > 0] - 1] = 0  # the step from one row's last token to the next row's first
    if len(turns) and (turns.min() < 0 or steps.min(initial=0) < 0):
        position = int(np.argmax(turns < 0)) if turns.min() < 0 else int(np.argmax(steps < 0)) + 1
        raise row_error(row_of(position), "has a turn_index that is negative or goes back (messages are in order)")
    behavior = flat_values(multi["behavior_logprobs"])
    stray = np.nonzero((mask == 0) & (behavior != 0))[0]
    if len(stray):
        raise row_error(row_of(int(stray[0])), "has a behavior log-prob other than 0.0 where loss_mask is 0")


# ---------------------------------------------------------------- building columns
def offsets_from_lengths(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def ragged(values: np.ndarray, lengths: np.ndarray, value_type: pa.DataType | None = None) -> pa.ListArray:
    """A `list<value>` column from a flat array and per-row lengths (no per-row Python work)."""
    flat = pa.array(np.ascontiguousarray(values), type=value_type)
    return pa.ListArray.from_arrays(pa.array(offsets_from_lengths(np.asarray(lengths))), flat)


def ragged_fixed(values: np.ndarray, lengths: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """A `list<fixed_size_list<value, k>>` column from a `[total_tokens, k]` array and per-row lengths."""
    values = np.ascontiguousarray(values)
    k = values.shape[1]
    inner = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=value_type), k)
    return pa.ListArray.from_arrays(pa.array(offsets_from_lengths(np.asarray(lengths))), inner)


def flat_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """All values of a `list<…>` (or `list<fixed_size_list<…>>`) column, concatenated, as numpy.

    For fixed-size inner lists the result is `[total_tokens, k]`. Zero-copy when
    the column has one chunk and no nulls.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    inner = column.flatten()
    if pa.types.is_fixed_size_list(inner.type):
        k = inner.type.list_size
        return inner.flatten().to_numpy(zero_copy_only=False).reshape(-1, k)
    return inner.to_numpy(zero_copy_only=False)


def list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def trained_mask(table: pa.Table) -> np.ndarray:
    """One bool per response token of `table` (rows concatenated): the positions the student trains on.

    Every position of a single-turn row (no `loss_mask` column, or a null entry), the mask-1 positions of a
    multi-turn row. Annotated parts hold one entry per True here (docs/design.md, "Trained positions").
    """
    lengths = list_lengths(table["response_ids"])
    trained = np.ones(int(lengths.sum()), dtype=bool)
    if LOSS_MASK not in table.schema.names:
        return trained
    column = table[LOSS_MASK]
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    has_mask = ~column.is_null().to_numpy(zero_copy_only=False)
    if has_mask.any():  # masks have their row's response length (validated), so they line up token by token
        masked_tokens = np.repeat(has_mask, lengths)
        trained[masked_tokens] = flat_values(column) != 0
    return trained


def trained_lengths(table: pa.Table) -> np.ndarray:
    """Trained positions per row of `table` (int64): the length of each row's annotated lists."""
    lengths = list_lengths(table["response_ids"])
    if LOSS_MASK not in table.schema.names or not len(lengths):
        return lengths
    counts = np.concatenate([[0], np.cumsum(trained_mask(table), dtype=np.int64)])
    offsets = offsets_from_lengths(lengths)
    return counts[offsets[1:]] - counts[offsets[:-1]]
