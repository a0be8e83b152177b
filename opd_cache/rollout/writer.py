"""Rollouts from any producer: `RolloutWriter` writes the shards `opd rollout` writes, from rows you give it.

An agent framework, a vLLM server loop or a converter (`opd ingest`) opens a store, appends rows (single-turn
responses or rendered conversations, with token ids, loss masks and behavior log-probs) and the writer publishes
them as rollout shards: the same shard ids (`make_shard_id(policy_version, worker_id, seq)`), schema, checksum
trailer and metadata as a rollout worker's, atomically (a killed writer leaves no partial shard: the rows it had
not flushed are lost, nothing else). `opd annotate` and `opd train` cannot tell them apart.

    with RolloutWriter("runs/agent", "data/models/student", worker_id="agent0", policy_version=3) as writer:
        writer.append(prompt_ids, response_ids, behavior_logprobs)             # one single-turn row
        writer.append_conversation(row)                                        # a ConversationRow (conversation.py)
    # closing publishes what is buffered; writer.shards lists the shard ids written

Rules a producer must keep:
- **One worker id per concurrent writer.** Shard ids are unique per (worker id, sequence number); a writer
  starts after the highest sequence number its id has used (quarantined shards included), and publishing
  refuses to replace an existing shard, so two writers sharing an id fail loudly instead of overwriting.
  Do not share an id with an `opd rollout --worker-id` either (its resume reads its own shards).
- **The policy version is the producer's**: the version of the student weights that sampled the rows. The
  trainer's staleness rule applies to it as to any rollout (`too_stale()` tells whether rows of the current
  version would still be trained). `set_policy_version` publishes the buffered rows first: a shard holds one
  version, and a writer's versions never go back.
- **Behavior log-probs** are those of the distribution each token was drawn from (temperature, top-k/top-p
  applied). Where the loss mask is 0 they are stored as 0.0 (never read), whatever was given.

`RolloutRows` (the buffer, and the table it becomes) and `publish_rollout_shard` are the flush path; the rollout
worker's flush is meant to share them (a multi-turn row is a row with a loss mask).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from opd_cache.flow.staleness import is_too_stale
from opd_cache.observe.metrics import MetricsLog
from opd_cache.rollout.conversation import ConversationRow
from opd_cache.rollout.resume import META_SAMPLES
from opd_cache.storage import layout
from opd_cache.storage.manifest import student_id
from opd_cache.storage.schema import ROLLOUT, ShardError, ShardMeta, read_shard, rollout_table, write_shard
from opd_cache.storage.store import Store, make_shard_id, validate_worker_id
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint

FINISH_REASONS = ("stop", "length")
META_PRODUCER = "opd.writer.producer"  # who wrote the shard (free text), beside ShardMeta's engine fields


class RowError(ValueError):
    """A row that cannot be written (the message says which field and what was expected)."""


# ---------------------------------------------------------------- rows
@dataclass
class RolloutRow:
    """One rollout row as a producer gives it (arrays or lists)."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behavior_logprobs: np.ndarray
    loss_mask: np.ndarray | None = None  # None: a single-turn row (every response position trained)
    turn_index: np.ndarray | None = None
    finish_reason: str = "stop"
    prompt_index: int = 0
    sample_index: int = 0
    data_source: str | None = None
    ground_truth: str | None = None
    extra: str | None = None
    student_topk_ids: np.ndarray | None = None  # [T, k] when the writer records the student's top-k

    @classmethod
    def checked(cls, vocab_size: int, student_topk: int = 0, max_tokens: int | None = None, **fields) -> RolloutRow:
        """A row with its fields converted and checked; RowError names the first problem."""
        row = cls(**fields)
        row.prompt_ids = _ids(row.prompt_ids, "prompt_ids", vocab_size)
        row.response_ids = _ids(row.response_ids, "response_ids", vocab_size)
        if not len(row.prompt_ids):
            raise RowError("prompt_ids is empty: every row needs a prompt")
        n = len(row.response_ids)
        if max_tokens is not None and len(row.prompt_ids) + n > max_tokens:
            raise RowError(
                f"{len(row.prompt_ids) + n} tokens (prompt {len(row.prompt_ids)} + response {n}), more "
                f"than the limit of {max_tokens}"
            )
        row.behavior_logprobs = _per_token(row.behavior_logprobs, "behavior_logprobs", n, np.float32)
        if not np.all(np.isfinite(row.behavior_logprobs)) or np.any(row.behavior_logprobs > 1e-3):
            raise RowError("behavior_logprobs must be finite log-probabilities (<= 0)")
        if row.loss_mask is None and row.turn_index is not None:
            raise RowError("turn_index without loss_mask")
        if row.loss_mask is not None:
            mask = _per_token(row.loss_mask, "loss_mask", n, np.int64)
            if mask.size and (mask.min() < 0 or mask.max() > 1):
                raise RowError(f"loss_mask holds 0 or 1, got {int(mask.max() if mask.max() > 1 else mask.min())}")
            if not mask.any():
                raise RowError("loss_mask is all 0: the row has nothing to train")
            row.loss_mask = mask.astype(np.uint8)
            if row.turn_index is None:
                row.turn_index = segment_index(row.loss_mask)
            turns = _per_token(row.turn_index, "turn_index", n, np.int64)
            if turns.size and (turns.min() < 0 or turns.max() > np.iinfo(np.int16).max or np.any(np.diff(turns) < 0)):
                raise RowError("turn_index must count up from 0 (one message after another, < 32768)")
            row.turn_index = turns.astype(np.int16)
            row.behavior_logprobs = np.where(row.loss_mask == 1, row.behavior_logprobs, np.float32(0.0))
            if row.loss_mask.all():  # every position trained: exactly a single-turn row, stored as one
                row.loss_mask = row.turn_index = None
        if row.finish_reason not in FINISH_REASONS:
            raise RowError(f"finish_reason {row.finish_reason!r}: expected one of {', '.join(FINISH_REASONS)}")
        if student_topk:
            if row.student_topk_ids is None:
                raise RowError(f"student_topk_ids missing: this run records the student's top-{student_topk}")
            topk = np.asarray(row.student_topk_ids, dtype=np.int64)
            if topk.shape != (n, student_topk):
                raise RowError(f"student_topk_ids has shape {topk.shape}, expected ({n}, {student_topk})")
            row.student_topk_ids = topk.astype(np.int32)
        elif row.student_topk_ids is not None:
            raise RowError("student_topk_ids given, but this run records no student top-k (student_topk=0)")
        return row


def segment_index(loss_mask: np.ndarray) -> np.ndarray:
    """A turn index from a mask alone: each run of equal mask values is one segment, numbered from 0 (what a
    row given without its messages can say about its turns)."""
    mask = np.asarray(loss_mask)
    return np.concatenate([[0], np.cumsum(mask[1:] != mask[:-1])]).astype(np.int16) if len(mask) else mask


def _ids(values, name: str, vocab_size: int) -> np.ndarray:
    ids = np.asarray(values if values is not None else [], dtype=np.int64)
    if ids.ndim != 1:
        raise RowError(f"{name} must be a flat list of token ids")
    bad = np.nonzero((ids < 0) | (ids >= vocab_size))[0]
    if len(bad):
        raise RowError(
            f"{name}[{int(bad[0])}] = {int(ids[bad[0]])} is outside the vocabulary (ids 0..{vocab_size - 1})"
        )
    return ids.astype(np.int32)


def _per_token(values, name: str, n: int, dtype) -> np.ndarray:
    array = np.asarray(values if values is not None else [], dtype=dtype)
    if array.ndim != 1 or len(array) != n:
        raise RowError(
            f"{name} has {len(array) if array.ndim == 1 else array.shape} entries, the response has {n} tokens"
        )
    return array


class RolloutRows:
    """Rows waiting to be published, and the rollout table they become."""

    def __init__(self, student_topk: int = 0):
        self.student_topk = student_topk
        self.rows: list[RolloutRow] = []
        self.tokens = 0
        self.started = time.monotonic()

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: RolloutRow) -> None:
        if not self.rows:
            self.started = time.monotonic()
        self.rows.append(row)
        self.tokens += len(row.response_ids)

    def clear(self) -> None:
        self.rows, self.tokens = [], 0

    def table(self, shard_id: str, policy_version: int) -> pa.Table:
        """The rows as a rollout table; the multi-turn columns only when some row has a loss mask, so a shard of
        single-turn rows is exactly what a single-turn rollout worker writes."""
        rows = self.rows
        multi_turn = any(r.loss_mask is not None for r in rows)
        return rollout_table(
            sample_ids=[f"{shard_id}-{i}" for i in range(len(rows))],
            prompt_index=[r.prompt_index for r in rows],
            sample_index=[r.sample_index for r in rows],
            prompt_ids=[r.prompt_ids for r in rows],
            response_ids=[r.response_ids for r in rows],
            behavior_logprobs=[r.behavior_logprobs for r in rows],
            policy_version=policy_version,
            finish_reason=[r.finish_reason for r in rows],
            data_source=[r.data_source for r in rows],
            ground_truth=[r.ground_truth for r in rows],
            extra=[r.extra for r in rows],
            student_topk_ids=[r.student_topk_ids for r in rows] if self.student_topk else None,
            student_topk=self.student_topk,
            loss_mask=[r.loss_mask for r in rows] if multi_turn else None,
            turn_index=[r.turn_index for r in rows] if multi_turn else None,
        )


@dataclass
class WriterShardMeta(ShardMeta):
    """ShardMeta plus the rows this writer id has published (this shard included) and who produced them."""

    samples: int = 0
    producer: str | None = None

    def to_metadata(self) -> dict[bytes, bytes]:
        meta = super().to_metadata()
        meta[META_SAMPLES.encode()] = str(self.samples).encode()
        if self.producer:
            meta[META_PRODUCER.encode()] = self.producer.encode()
        return meta


def publish_rollout_shard(store: Store, rows: RolloutRows, meta: ShardMeta) -> None:
    """Publish `rows` as rollout shard `meta.shard_id` (validated, checksummed, atomic, never replacing one)."""
    table = rows.table(meta.shard_id, meta.policy_version)
    write_shard(store, layout.rollout_path(meta.shard_id), table, meta, exclusive=True)


# ---------------------------------------------------------------- the writer
class RolloutWriter:
    """Append rows, publish rollout shards (module docstring).

    `store`: a Store or its URI. `tokenizer`: the student's tokenizer (or its folder): its fingerprint and size
    go into run.json and every shard, and token ids are checked against it. `student`: the student model
    (policy version 0) recorded in run.json; needed when the store has no run.json yet. `flush_rows`: publish a
    shard every N rows; `flush_seconds`: also when the oldest buffered row is this old (checked on `append`).
    `max_tokens`: refuse rows longer than this (prompt + response). `producer`, `engine`, `engine_version`,
    `model_dtype`: recorded in each shard's metadata.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike,
        tokenizer,
        *,
        worker_id: str = "writer",
        policy_version: int = 0,
        student: str | None = None,
        flush_rows: int = 256,
        flush_seconds: float | None = None,
        student_topk: int = 0,
        max_tokens: int | None = None,
        producer: str | None = None,
        engine: str | None = None,
        engine_version: str | None = None,
        model_dtype: str | None = None,
    ):
        self.store = store if isinstance(store, Store) else Store(os.fspath(store))
        self.worker = validate_worker_id(worker_id)
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be >= 1, got {flush_rows}")
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        self.tokenizer = (
            load_tokenizer(os.fspath(tokenizer)) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        )
        self.vocab_size = len(self.tokenizer)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        run = self.store.manifest.read()
        if run is None and student is None:
            raise ValueError(f"student= is required: store {self.store.path('')} has no run.json naming the student")
        self.run = self.store.manifest.ensure(
            student=student_id(student) if student is not None else None,
            tokenizer_fingerprint=self.fingerprint,
            vocab_size=self.vocab_size,
            student_topk=student_topk or None,
        )
        self.student_topk = student_topk or self.run.student_topk or 0
        self.flush_rows, self.flush_seconds, self.max_tokens = flush_rows, flush_seconds, max_tokens
        # what every shard of this writer carries (flush adds the shard's id, policy version and sample count)
        self.meta_fields = dict(
            kind=ROLLOUT,
            run_id=self.run.run_id,
            tokenizer_fingerprint=self.fingerprint,
            student_topk=self.student_topk,
            producer=producer,
            engine=engine,
            engine_version=engine_version,
            model_dtype=model_dtype,
        )
        self.seq, self.total_samples, last_version = _resume(self.store, self.worker)
        if policy_version < last_version:
            raise ValueError(
                f"writer {self.worker} already published policy version {last_version}; its versions never go "
                f"back (use another worker_id for rows of version {policy_version})"
            )
        self.policy_version = policy_version
        self.buffer = RolloutRows(self.student_topk)
        self.metrics = MetricsLog(self.store, "writer", self.worker)
        self.shards: list[str] = []  # shard ids this writer published
        self.rows_appended = 0

    # ------------------------------------------------------------ appending
    def append(
        self,
        prompt_ids,
        response_ids,
        behavior_logprobs,
        *,
        loss_mask=None,
        turn_index=None,
        finish_reason: str = "stop",
        prompt_index: int | None = None,
        sample_index: int = 0,
        data_source: str | None = None,
        ground_truth: str | None = None,
        extra: str | None = None,
        student_topk_ids=None,
    ) -> None:
        """Buffer one row (RowError when it cannot be written); publishes a shard when one is due.
        `prompt_index` groups samples of one prompt (task rewards compare them); default: a new group per row."""
        row = RolloutRow.checked(
            self.vocab_size,
            self.student_topk,
            self.max_tokens,
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            behavior_logprobs=behavior_logprobs,
            loss_mask=loss_mask,
            turn_index=turn_index,
            finish_reason=finish_reason,
            prompt_index=self.rows_appended if prompt_index is None else prompt_index,
            sample_index=sample_index,
            data_source=data_source,
            ground_truth=ground_truth,
            extra=extra,
            student_topk_ids=student_topk_ids,
        )
        self.buffer.add(row)
        self.rows_appended += 1
        if len(self.buffer) >= self.flush_rows or (
            self.flush_seconds is not None and time.monotonic() - self.buffer.started >= self.flush_seconds
        ):
            self.flush()

    def append_conversation(self, conversation: ConversationRow, *, behavior_logprobs=None, **fields) -> None:
        """Buffer a rendered conversation (opd_cache/rollout/conversation.py) with its mask and turn index.
        `behavior_logprobs` overrides the conversation's own (required when it was rendered from text)."""
        logprobs = behavior_logprobs if behavior_logprobs is not None else conversation.behavior_logprobs
        if logprobs is None:
            raise RowError("the conversation has no behavior log-probs (rendered from text): give behavior_logprobs")
        fields.setdefault("finish_reason", conversation.finish_reason)
        self.append(
            conversation.prompt_ids,
            conversation.response_ids,
            logprobs,
            loss_mask=conversation.loss_mask,
            turn_index=conversation.turn_index,
            **fields,
        )

    # ------------------------------------------------------------ publishing
    def set_policy_version(self, version: int) -> None:
        """Rows appended from now on were sampled by policy `version` (publishes the buffered rows first)."""
        if version < self.policy_version:
            raise ValueError(f"policy version {version} < {self.policy_version}: a writer's versions never go back")
        if version != self.policy_version:
            self.flush()
            self.policy_version = version

    def too_stale(self, max_staleness: int) -> bool:
        """Whether rows of the current version are already too old for the trainer (flow/staleness.py)."""
        return is_too_stale(self.policy_version, self.store.latest_version(), max_staleness)

    def flush(self) -> str | None:
        """Publish the buffered rows as one shard; returns its id (None when nothing was buffered)."""
        if not len(self.buffer):
            return None
        shard_id = make_shard_id(self.policy_version, self.worker, self.seq)
        rows = len(self.buffer)
        meta = WriterShardMeta(
            shard_id=shard_id, policy_version=self.policy_version, samples=self.total_samples + rows, **self.meta_fields
        )
        try:
            publish_rollout_shard(self.store, self.buffer, meta)
        except ShardError as e:
            if "already exists" in str(e):
                raise ShardError(f"{e} (give each concurrent writer its own worker_id)") from None
            raise
        self.metrics.log(
            {"shard": shard_id, "rows": rows, "tokens": self.buffer.tokens, "policy_version": self.policy_version},
            flush=True,
        )
        self.shards.append(shard_id)
        self.total_samples += rows
        self.seq += 1
        self.buffer.clear()
        return shard_id

    def close(self) -> None:
        self.flush()
        self.metrics.flush()

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:  # on an error the buffered rows are dropped, as a killed writer's would be
            self.close()


def _resume(store: Store, worker: str) -> tuple[int, int, int]:
    """(next sequence number, rows published, newest version) of writer `worker`, from its shards."""
    mine = [s for s in store.shards.rollouts() if s.worker == worker]
    moved = [s.seq for s in store.quarantined_rollouts() if s.worker == worker]
    next_seq = max([s.seq for s in mine] + moved, default=-1) + 1
    if not mine:
        return next_seq, 0, 0
    last = max(mine, key=lambda s: s.seq)
    table, _ = read_shard(store, last.path, kind=ROLLOUT)
    metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    samples = int(metadata[META_SAMPLES]) if META_SAMPLES in metadata else table.num_rows
    return next_seq, samples, max(s.policy_version for s in mine)
