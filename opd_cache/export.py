"""`opd export`: a store's annotations as ordinary dataset files, one table per teacher.

The shards are already Arrow, but a shard alone is half a row: the rollout shard holds the tokens and the
student's log-probs, each teacher's part holds that teacher's top-k. The export joins them, decodes the
token ids to text with the run's tokenizer (loaded from a local folder, never a hub), and writes

    <to>/<teacher>.parquet   (or <teacher>.arrow: an Arrow IPC stream)
    <to>/export.json         what was exported: the store, its run id, rows and tokens per teacher

which `datasets.load_dataset("parquet" | "arrow", data_files=...)`, polars and duckdb read as they are.
It streams: one rollout shard (and its parts) is in memory at a time, written as one record batch / row
group. The store is only read, through the same validated reader the trainer uses (`load_shard`).

Columns are plain nested lists (no fixed-size lists, no float16) because that is what every reader
understands; the shard's top-k log-prob dtype is kept in export.json (`topk_logprob_dtype`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from opd_cache.storage import layout
from opd_cache.storage.damage import DAMAGE_ERRORS, DamagedFiles
from opd_cache.storage.filestore import AtomicOutput
from opd_cache.storage.schema import TARGET_FLAGS, read_shard
from opd_cache.storage.store import RUN_JSON, RunManifest, Store
from opd_cache.train.shard_data import load_shard, offsets_of, ragged_index

FORMATS = ("parquet", "arrow")
MANIFEST = "export.json"


def export_schema(target_flags: bool = False) -> pa.Schema:
    """One row per (sample, teacher): what a dataset user needs to train or analyse without opd_cache.

    `target_flags`: a teacher of another tokenizer (docs/cross-tokenizer.md) adds its flags per position; its
    `teacher_token_logprob` is then the aligned group's log-prob at the group's last position, 0 elsewhere."""
    flags = [pa.field(TARGET_FLAGS, pa.list_(pa.uint8()))] if target_flags else []
    return pa.schema(
        [
            pa.field("sample_id", pa.string(), nullable=False),
            pa.field("shard_id", pa.string(), nullable=False),
            pa.field("policy_version", pa.int32(), nullable=False),
            pa.field("prompt_index", pa.int64(), nullable=False),
            pa.field("sample_index", pa.int32(), nullable=False),
            pa.field("data_source", pa.string()),
            pa.field("ground_truth", pa.string()),
            pa.field("finish_reason", pa.string()),
            pa.field("prompt", pa.string()),
            pa.field("response", pa.string()),
            pa.field("prompt_ids", pa.list_(pa.int32())),
            pa.field("response_ids", pa.list_(pa.int32())),
            pa.field("behavior_logprobs", pa.list_(pa.float32())),  # the student's log-prob of each sampled token
            # multi-turn rows: 1 = a token the student sampled (trained); null: every response token is trained
            pa.field("loss_mask", pa.list_(pa.uint8())),
            # the teacher columns: one entry per trained token (every response token of a single-turn row)
            pa.field("teacher_token_logprob", pa.list_(pa.float32())),  # the teacher's log-prob of each sampled token
            pa.field("teacher_topk_ids", pa.list_(pa.list_(pa.int32()))),  # [tokens][k], best first
            pa.field("teacher_topk_logprobs", pa.list_(pa.list_(pa.float32()))),
            *flags,
        ]
    )


@dataclass
class TeacherTotals:
    rows: int = 0
    tokens: int = 0
    top_k: int | None = None
    topk_logprob_dtype: str | None = None
    shards_without_part: int = 0  # rollout shards this teacher has not annotated (yet): not in the table


@dataclass
class ExportResult:
    to: str
    format: str
    files: dict[str, str]  # teacher -> path of its table
    teachers: dict[str, TeacherTotals] = field(default_factory=dict)
    shards: int = 0
    seconds: float = 0.0
    damaged: dict[str, str] = field(default_factory=dict)  # with skip_damaged: files left out -> what is wrong


def _ragged(values: np.ndarray, offsets: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(np.ascontiguousarray(values), type=value_type)
    )


def _ragged_rows(values: np.ndarray, offsets: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """`list<list<value>>` from `[tokens, k]` values and per-row token offsets (no per-row Python work)."""
    tokens, k = values.shape
    inner = pa.ListArray.from_arrays(
        pa.array(np.arange(0, tokens * k + 1, k, dtype=np.int32)),
        pa.array(np.ascontiguousarray(values).reshape(-1), type=value_type),
    )
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), inner)


def _select(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of `rows` (flat) and their new offsets."""
    lengths = offsets[rows + 1] - offsets[rows]
    new_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    return values[ragged_index(offsets, rows)], new_offsets


def teacher_batch(store: Store, run: dict, shard_id: str, teacher: str, tokenizer) -> pa.RecordBatch:
    """The rows of one rollout shard that `teacher` annotated, joined with its part, as one record batch."""
    data = load_shard(store, run, shard_id, [teacher])  # validated: run id, tokenizer, top-k, lengths, order
    rows = np.nonzero(data.teacher_of_row == 0)[0].astype(np.int64)
    # The rollout's string columns the trainer does not need (ShardData has no finish_reason / sample_index).
    rollout, _ = read_shard(store, layout.rollout_path(shard_id), run=run)
    take = pa.array(rows)
    prompt_ids, prompt_offsets = _select(data.prompt_values, data.prompt_offsets, rows)
    response_ids, response_offsets = _select(data.response_values, data.response_offsets, rows)
    behavior, _ = _select(data.behavior_logprobs, data.response_offsets, rows)
    # A single part's teacher arrays hold exactly its rows' trained tokens, in rollout order.
    teacher_offsets = offsets_of(data.trained_lengths[rows])
    if data.trained is None:
        loss_mask = pa.nulls(len(rows), pa.list_(pa.uint8()))
    else:
        loss_mask = _ragged(
            data.trained[ragged_index(data.response_offsets, rows)].astype(np.uint8), response_offsets, pa.uint8()
        )
    top_k = data.topk_ids.shape[1]
    prompt_lists = [prompt_ids[prompt_offsets[i] : prompt_offsets[i + 1]].tolist() for i in range(len(rows))]
    response_lists = [response_ids[response_offsets[i] : response_offsets[i + 1]].tolist() for i in range(len(rows))]
    if tokenizer is not None:
        prompts = tokenizer.batch_decode(prompt_lists, skip_special_tokens=False)
        responses = tokenizer.batch_decode(response_lists, skip_special_tokens=False)
    else:
        prompts = responses = [None] * len(rows)
    columns = [
        data.sample_ids.take(take),
        pa.array([shard_id] * len(rows), pa.string()),
        pa.array(np.full(len(rows), data.policy_version, dtype=np.int32)),
        pa.array(data.prompt_index[rows]),
        rollout["sample_index"].take(take).combine_chunks(),
        data.data_source.take(take),
        data.ground_truth.take(take),
        rollout["finish_reason"].take(take).combine_chunks(),
        pa.array(prompts, pa.string()),
        pa.array(responses, pa.string()),
        _ragged(prompt_ids, prompt_offsets, pa.int32()),
        _ragged(response_ids, response_offsets, pa.int32()),
        _ragged(behavior, response_offsets, pa.float32()),
        loss_mask,
        _ragged(data.token_logprob.astype(np.float32, copy=False), teacher_offsets, pa.float32()),
        _ragged_rows(data.topk_ids.reshape(-1, top_k), teacher_offsets, pa.int32()),
        _ragged_rows(
            data.topk_logprobs.astype(np.float32, copy=False).reshape(-1, top_k), teacher_offsets, pa.float32()
        ),
    ]
    if data.target_flags is not None:
        columns.append(_ragged(data.target_flags, response_offsets, pa.uint8()))
    return pa.RecordBatch.from_arrays(columns, schema=export_schema(data.target_flags is not None))


def resolve_tokenizer(run: RunManifest, tokenizer_path: str | None, store: Store):
    """The run's tokenizer from a local folder (`--tokenizer`, else run.json `student`); never a hub download."""
    from opd_cache.tokenizer import load_tokenizer

    path = tokenizer_path or run.student
    if not path or not Path(path).is_dir():
        raise ValueError(
            f"cannot decode text: {store.path(RUN_JSON)} names the student {path!r}, which is not a "
            f"local folder; pass --tokenizer DIR (the run's tokenizer) or --no-text"
        )
    return load_tokenizer(path)


class _Writer:
    """One teacher's output table, streamed to an `AtomicOutput`: a reader never sees half a file."""

    def __init__(self, output: AtomicOutput, fmt: str, target_flags: bool = False):
        self.output, self.fmt = output, fmt
        schema = export_schema(target_flags)
        self.writer = (
            pq.ParquetWriter(output.stream, schema, compression="zstd")
            if fmt == "parquet"
            else pa.ipc.new_stream(output.stream, schema)
        )

    def write(self, batch: pa.RecordBatch) -> None:
        if self.fmt == "parquet":  # one row group per shard
            self.writer.write_batch(batch, row_group_size=max(batch.num_rows, 1))
        else:
            self.writer.write_batch(batch)

    def close(self) -> None:
        self.writer.close()
        self.output.commit()

    def abort(self) -> None:
        try:
            self.writer.close()
        finally:
            self.output.abort()


def prepare_destination(to: str, overwrite: bool) -> Store:
    """The output folder: refuse a non-empty one without --overwrite, and with it anything but an old export."""
    out = Store(to)
    if out.fs.get_file_info(out.root).type == pafs.FileType.File:
        raise ValueError(f"--to {to} is a file, not a folder")
    existing = out.fs.get_file_info(pafs.FileSelector(out.root, allow_not_found=True, recursive=False))
    if existing:
        if not overwrite:
            raise ValueError(
                f"--to {to} is not empty ({len(existing)} entries): choose a new folder or pass --overwrite"
            )
        if not out.exists(MANIFEST):
            raise ValueError(
                f"--to {to} is not empty and holds no {MANIFEST}: --overwrite only replaces an earlier "
                f"`opd export`; choose a new folder"
            )
        out.fs.delete_dir_contents(out.root)
    else:
        out.make_dir("")
    return out


def export_store(
    store: Store,
    to: str,
    *,
    fmt: str = "parquet",
    overwrite: bool = False,
    tokenizer_path: str | None = None,
    text: bool = True,
    teachers: list[str] | None = None,
    on_shard: Callable[[int, int, str], None] | None = None,
    skip_damaged: bool = False,
) -> ExportResult:
    """Write one table per teacher under `to`; `on_shard(done, total, shard_id)` reports progress.

    A damaged shard or part stops the export (naming it, storage/damage.py) and leaves nothing under `to`; with
    `skip_damaged` it is left out of its teacher's table and counted in `result.damaged`."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    run = store.manifest.require()
    shards, parts = store.shards.dataset()
    found = sorted({t for shard in shards for t in parts.get(shard.shard_id, ())})
    if not found:
        raise ValueError(
            f"{store.path('')} has no annotated parts ({len(shards)} rollout shards, none annotated): "
            f"run `opd annotate` on it first"
        )
    if teachers:
        unknown = sorted(set(teachers) - set(found))
        if unknown:
            raise ValueError(f"--teacher {', '.join(unknown)}: the store has annotations from {', '.join(found)}")
        found = sorted(set(teachers))
    tokenizer = resolve_tokenizer(run, tokenizer_path, store) if text else None
    damaged = DamagedFiles(store.uri, skip=skip_damaged)
    target = Store(to)
    created = target.fs.get_file_info(target.root).type == pafs.FileType.NotFound  # removed again on an abort
    out = prepare_destination(to, overwrite)  # only after every check on the store: a refusal writes nothing

    start = time.monotonic()
    result = ExportResult(
        to=out.path(""),
        format=fmt,
        files={t: out.path(f"{t}.{fmt}") for t in found},
        teachers={t: TeacherTotals() for t in found},
    )
    writers: dict[str, _Writer] = {}
    try:
        cross = {r.name for r in store.manifest.teachers() if r.teacher_tokenizer_fingerprint}  # flags columns
        for t in found:
            writers[t] = _Writer(out.open_atomic_output(f"{t}.{fmt}"), fmt, target_flags=t in cross)
        for done, shard in enumerate(shards):
            for t in found:
                if t not in parts.get(shard.shard_id, ()):
                    result.teachers[t].shards_without_part += 1
                    continue
                try:
                    batch = teacher_batch(store, run, shard.shard_id, t, tokenizer)
                except DAMAGE_ERRORS as e:  # the rollout shard or this teacher's part
                    damaged.met(f"{shard.shard_id} ({t})", e)
                    continue
                if batch.num_rows:  # routing can leave a teacher's part of a shard empty
                    writers[t].write(batch)
                totals = result.teachers[t]
                totals.rows += batch.num_rows
                totals.tokens += int(pc.sum(pc.list_value_length(batch.column("response_ids"))).as_py() or 0)
                if totals.top_k is None:
                    part, _ = read_shard(store, layout.annotated_path(shard.shard_id, t), run=run)
                    lp = part.schema.field("teacher_topk_logprobs").type.value_type
                    totals.top_k, totals.topk_logprob_dtype = (
                        lp.list_size,
                        np.dtype(lp.value_type.to_pandas_dtype()).name,
                    )
            result.shards = done + 1
            if on_shard is not None:
                on_shard(done + 1, len(shards), shard.shard_id)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            try:
                w.abort()
            except Exception:
                pass
        if created:  # the folder this export made: an aborted export leaves nothing behind
            out.delete_dir("")
        raise
    result.seconds = time.monotonic() - start
    result.damaged = damaged.files
    manifest = {
        "store": store.uri,
        "run_id": run.run_id,
        "format": fmt,
        "text_decoded": text,
        "tokenizer": (tokenizer_path or run.student) if text else None,
        "shards": result.shards,
        "teachers": {t: {"file": f"{t}.{fmt}", **vars(v)} for t, v in result.teachers.items()},
        "skipped_damaged": result.damaged,  # shard (teacher) -> what was wrong: left out with --skip-damaged
    }
    out.write_json(MANIFEST, manifest)  # last: a folder with export.json holds a complete export
    return result
