"""One rollout shard joined with its annotated parts, as flat numpy arrays.

A rollout shard `rollouts/<id>.arrow` holds the rows; each teacher's part
`annotated/<id>/<teacher>.arrow` holds exactly the rows routed to that teacher,
in rollout order. `ShardData` reads them once, validates them against
run.json, and exposes every per-token column as one flat array (zero-copy views
of the memory-mapped files where possible) plus offsets, so the decoder can
gather any set of rows with a few numpy fancy-indexing calls.

Rows that no part holds (routing sent them to no teacher) are "unrouted": they
are never trained and are recorded in the skipped ledger.

Multi-turn rows (schema version 2) train only at their loss_mask=1 positions, and their parts hold one entry
per such position; `trained` marks them and `teacher_token_index` maps each one to its part entry (untrained
tokens, e.g. tool output, map to -1: they are context for the forward pass and never get a loss).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from opd_cache.storage import layout
from opd_cache.storage.manifest import RunManifest, as_manifest
from opd_cache.storage.schema import (
    ANNOTATED,
    ROLLOUT,
    TARGET_FLAGS,
    ShardError,
    check_annotation_matches,
    flat_values,
    list_lengths,
    read_shard,
    trained_mask,
)
from opd_cache.storage.store import Store, parse_shard_id
from opd_cache.target_flags import SAME_TOKENIZER


def required_teachers(run: RunManifest | dict) -> list[str]:
    """The teachers whose part must exist before a shard can train (`RunManifest.required_teachers`)."""
    return as_manifest(run).required_teachers()


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """int64 offsets [n + 1] from per-row lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def ragged_index(offsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Concatenation of arange(offsets[r], offsets[r + 1]) for r in rows, without a Python loop."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # position inside the output minus the output offset of its row, plus the row's start
    shift = np.repeat(starts - offsets_of(lengths)[:-1], lengths)
    return np.arange(total, dtype=np.int64) + shift


@dataclass
class ShardData:
    shard_id: str
    policy_version: int
    num_rows: int
    sample_ids: pa.Array  # string
    prompt_index: np.ndarray  # [rows] int64
    data_source: pa.Array
    ground_truth: pa.Array
    prompt_values: np.ndarray  # [prompt tokens] int32
    prompt_offsets: np.ndarray  # [rows + 1] int64
    response_values: np.ndarray  # [response tokens T] int32
    response_offsets: np.ndarray  # [rows + 1] int64
    behavior_logprobs: np.ndarray  # [T] float32
    student_topk_ids: np.ndarray | None  # [T, k_s] int32
    teacher_names: list[str]
    teacher_of_row: np.ndarray  # [rows] int16, index into teacher_names, -1 = unrouted
    # Teacher columns. `teacher_token_index[t]` is the row of these arrays that holds rollout token t
    # (-1 for tokens of unrouted rows); None when one part holds every row in order (the identity).
    topk_ids: np.ndarray  # [T', k] int32
    topk_logprobs: np.ndarray  # [T', k] float16/float32
    token_logprob: np.ndarray  # [T'] float32
    support_logprobs: np.ndarray | None  # [T', k_s] float32
    teacher_token_index: np.ndarray | None
    trained: np.ndarray | None = None  # [T] bool, the tokens with a loss; None: every token (single-turn rows)
    # [T'] uint8, cross-tokenizer target flags (opd_cache/target_flags.py); None when no part has the column
    target_flags: np.ndarray | None = None

    prompt_lengths: np.ndarray | None = None  # [rows] int64, derived from the offsets
    response_lengths: np.ndarray | None = None
    trained_lengths: np.ndarray | None = None  # [rows] int64, tokens with a loss per row

    def __post_init__(self):
        self.prompt_lengths = np.diff(self.prompt_offsets)
        self.response_lengths = np.diff(self.response_offsets)
        if self.trained is None:
            self.trained_lengths = self.response_lengths
        else:
            counts = np.concatenate([[0], np.cumsum(self.trained, dtype=np.int64)])
            self.trained_lengths = counts[self.response_offsets[1:]] - counts[self.response_offsets[:-1]]


def load_shard(
    store: Store, run: RunManifest | dict, shard_id: str, teachers: list[str], *, need_support: bool = False
) -> ShardData:
    """Read and join a rollout shard and the parts of `teachers`; raises ShardError naming the file."""
    run = as_manifest(run)
    version = parse_shard_id(shard_id)[0]
    rollout_rel = layout.rollout_path(shard_id)
    rollout, rmeta = read_shard(store, rollout_rel, kind=ROLLOUT, run=run)
    if need_support and "student_topk_ids" not in rollout.schema.names:
        raise ShardError(
            f"{store.path(rollout_rel)}: support 'union' needs the column 'student_topk_ids' "
            f"(run rollout with rollout.student_topk > 0) or use --support teacher"
        )
    n = rollout.num_rows
    response_lengths = list_lengths(rollout["response_ids"])
    response_offsets = offsets_of(response_lengths)
    total = int(response_offsets[-1])

    parts = []
    for teacher in teachers:
        rel = layout.annotated_path(shard_id, teacher)
        table, meta = read_shard(store, rel, kind=ANNOTATED, run=run)
        where = store.path(rel)
        if run.top_k is not None and meta.top_k != run.top_k:
            raise ShardError(
                f"{where}: annotated with top_k={meta.top_k} but run.json has top_k={run.top_k}; "
                f"re-annotate with the run's top_k or use a new store"
            )
        if meta.teacher is not None and meta.teacher != teacher:
            raise ShardError(f"{where}: metadata names teacher {meta.teacher!r}, expected {teacher!r}")
        if need_support and "teacher_support_logprobs" not in table.schema.names:
            raise ShardError(
                f"{where}: support 'union' needs the column 'teacher_support_logprobs' "
                f"(annotate with the HF back-end on rollouts with student_topk_ids) or use --support teacher"
            )
        parts.append((teacher, table, where))

    teacher_of_row = np.full(n, -1, dtype=np.int16)
    trained = trained_mask(rollout)
    all_trained = bool(trained.all())
    single_full = len(parts) == 1 and parts[0][1].num_rows == n and all_trained
    part_rows: list[np.ndarray] = []
    for i, (teacher, table, where) in enumerate(parts):
        rows = check_annotation_matches(rollout, table, where, every_row=False)
        taken = teacher_of_row[rows] >= 0
        if taken.any():
            other = teachers[int(teacher_of_row[rows[np.argmax(taken)]])]
            raise ShardError(
                f"{where}: sample {table['sample_id'][int(np.argmax(taken))].as_py()!r} is also in the "
                f"part of teacher {other!r}; each row must be routed to one teacher"
            )
        teacher_of_row[rows] = i
        part_rows.append(rows)

    def column(table: pa.Table, name: str) -> np.ndarray | None:
        return flat_values(table[name]) if name in table.schema.names else None

    if single_full:
        table = parts[0][1]
        topk_ids, topk_lp = column(table, "teacher_topk_ids"), column(table, "teacher_topk_logprobs")
        token_lp, support_lp = column(table, "teacher_token_logprob"), column(table, "teacher_support_logprobs")
        index = None
        flags = column(table, TARGET_FLAGS)
    else:
        # Several parts (or a partial one, or masked rows): concatenate them once and map the trained rollout
        # tokens to their rows.
        topk_ids = _concat([column(t, "teacher_topk_ids") for _, t, _ in parts])
        topk_lp = _concat([column(t, "teacher_topk_logprobs").astype(np.float32, copy=False) for _, t, _ in parts])
        token_lp = _concat([column(t, "teacher_token_logprob") for _, t, _ in parts])
        support_lp = _concat([column(t, "teacher_support_logprobs") for _, t, _ in parts]) if need_support else None
        flags = part_target_flags([t for _, t, _ in parts])
        index = np.full(total, -1, dtype=np.int64)
        base = 0
        for rows in part_rows:
            tokens = ragged_index(response_offsets, rows)
            tokens = tokens if all_trained else tokens[trained[tokens]]
            index[tokens] = base + np.arange(len(tokens), dtype=np.int64)
            base += len(tokens)

    return ShardData(
        shard_id=shard_id,
        policy_version=version,
        num_rows=n,
        sample_ids=_one_chunk(rollout["sample_id"]),
        prompt_index=rollout["prompt_index"].to_numpy(),
        data_source=_one_chunk(rollout["data_source"]),
        ground_truth=_one_chunk(rollout["ground_truth"]),
        prompt_values=flat_values(rollout["prompt_ids"]),
        prompt_offsets=offsets_of(list_lengths(rollout["prompt_ids"])),
        response_values=flat_values(rollout["response_ids"]),
        response_offsets=response_offsets,
        behavior_logprobs=flat_values(rollout["behavior_logprobs"]),
        student_topk_ids=column(rollout, "student_topk_ids") if need_support else None,
        teacher_names=list(teachers),
        teacher_of_row=teacher_of_row,
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        token_logprob=token_lp,
        support_logprobs=support_lp,
        teacher_token_index=index,
        trained=None if all_trained else trained,
        target_flags=flags,
    )


def part_target_flags(tables: list[pa.Table]) -> np.ndarray | None:
    """The parts' target flags, concatenated; a same-tokenizer part among cross-tokenizer ones counts as
    SAME_TOKENIZER at every position. None when no part has the column."""
    if not any(TARGET_FLAGS in t.schema.names for t in tables):
        return None
    return _concat(
        [
            flat_values(t[TARGET_FLAGS])
            if TARGET_FLAGS in t.schema.names
            else np.full(int(list_lengths(t["teacher_token_logprob"]).sum()), SAME_TOKENIZER, dtype=np.uint8)
            for t in tables
        ]
    )


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) != 1 else arrays[0]


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def read_rollout_ids(store: Store, run: RunManifest, shard_id: str) -> pa.Array:
    """The sample ids of a rollout shard (to record the rows of a shard that expired before it was annotated)."""
    table, _ = read_shard(store, layout.rollout_path(shard_id), kind=ROLLOUT, run=run)
    return _one_chunk(table["sample_id"])


class ShardCache:
    """The last few loaded shards (a global batch touches few shards; the decoder revisits them)."""

    def __init__(
        self, store: Store, run: RunManifest, teachers: list[str], *, need_support: bool = False, capacity: int = 16
    ):
        self.store, self.run, self.teachers = store, run, list(teachers)
        self.need_support = need_support
        self.capacity = capacity
        self._shards: OrderedDict[str, ShardData] = OrderedDict()

    def refresh_run(self) -> None:
        """Re-read the manifest (a trainer started with --follow before annotate registered the teachers)."""
        self.run = self.store.manifest.require()
        self.teachers = required_teachers(self.run)

    def get(self, shard_id: str) -> ShardData:
        data = self._shards.get(shard_id)
        if data is None:
            data = load_shard(self.store, self.run, shard_id, self.teachers, need_support=self.need_support)
            self._shards[shard_id] = data
            while len(self._shards) > self.capacity:
                self._shards.popitem(last=False)
        else:
            self._shards.move_to_end(shard_id)
        return data
