"""What the trainer leaves in the store: resume states, the sample ledger, policy versions, progress.

Resume state `train/state/step-<N>/` (every `save_every` steps and at the end):
    the model and the optimizer, sharded, with `torch.distributed.checkpoint`
    (DCP reshards on load, so a state saved by 2 ranks loads on 1 or 4);
    `trainer.json`: step, policy version, the stream cursor (finished shards,
    current shard and rows consumed of it), counters; `rng-<rank>.json`: each
    rank's torch RNG state; `_CHECKSUMS.json`, every file's size and xxh3-64
    (each rank hashes the files it wrote, rank 0 writes the merged list);
    `_COMPLETE`, written last. `load_state` checks every file against the
    manifest before loading anything; the trainer quarantines a state that
    fails and resumes from the previous complete one.
    Atomicity: on a local store every rank writes into `step-<N>.tmp-save/`
    beside the final folder, rank 0 adds `_COMPLETE` and renames the folder
    into place (`Store.replace_dir`). Object stores
    cannot rename folders: DCP writes to a local folder, each rank uploads its
    own files, and rank 0 writes `_COMPLETE` after all uploads. Only states
    with `_COMPLETE` are ever loaded; the newest `keep_states` are kept.

Ledger: `train/consumed/step-<N>.jsonl` lists the rows trained at step N (one
JSON object per line: sample_id, shard_id, teacher, policy_version), written
after the step. `train/skipped/<shard_id>.jsonl` lists the rows of a finished
shard that were not trained (reason "expired" or "unrouted"). On resume from
step S, ledger files of steps after S and skipped files of shards not finished
at S are deleted: the resumed run rewrites them, so every row ends up in the
ledger exactly once (`verify_ledger` checks it).

Policy version N: `publish.PolicyPublisher` copies the weights to CPU and
writes the HF checkpoint (safetensors, config, tokenizer) in a background
thread; `store.publish_policy(N, folder)` copies it into `policy/v<N>`
atomically (with `_CHECKSUMS.json` before `_COMPLETE`) and then replaces
`policy/LATEST`; old versions are pruned (opd_cache/storage/retention.py). A resumed
trainer that re-derives a version it finds damaged publishes it again.

Untrusted files. DCP writes its `.metadata` with pickle and the non-tensor
entries of a state (the optimizer's hyper-parameters) with `torch.save`, and
its default reader unpickles both without restriction: a crafted resume state
in a writable store could run code in the trainer. `load_state` therefore reads
`.metadata` with an unpickler that builds only DCP's metadata classes, torch
sizes/dtypes/layouts and plain values, and lets a non-tensor entry through only
if `torch.load(weights_only=True)` accepts it (tensors DCP already loads that
way). Anything else stops the trainer with a message naming the state folder.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import enum
import io
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from opd_cache.storage import layout
from opd_cache.storage.integrity import (
    MANIFEST,
    FileProblem,
    legacy_warning,
    manifest_bytes,
    manifest_for,
    verify_local_folder,
)
from opd_cache.storage.layout import TRAIN_CONSUMED, TRAIN_SKIPPED, TRAIN_STATE
from opd_cache.storage.retention import prune_states
from opd_cache.storage.scratch import owned_temp_prefix
from opd_cache.storage.store import COMPLETE_MARKER, Store, StoreError, iter_jsonl


def complete_states(store: Store) -> list[int]:
    """Steps of the resume states whose `_COMPLETE` marker exists, oldest first."""
    steps = (layout.state_step(name) for name in store.list_dirs(TRAIN_STATE))
    return sorted(s for s in steps if s is not None and store.exists(layout.complete_marker(layout.state_dir(s))))


def _barrier(distributed: bool) -> None:
    if distributed:
        torch.distributed.barrier()


def _rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(
            torch.from_numpy(np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy())
        )


def save_state(
    store: Store,
    step: int,
    objective: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    *,
    rank: int = 0,
    distributed: bool = False,
    keep: int = 2,
) -> None:
    """Save the resume state of step `step` (a collective under torchrun: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(objective, optimizer)
    rel = layout.state_dir(step)
    # A local store: every rank writes beside the final folder (one rename publishes it). An object store
    # cannot rename folders: DCP writes to a local folder and each rank uploads its own files.
    staged_in_store = store.local_dir(layout.tmp_name(rel, "save"))
    if staged_in_store is not None:
        folder = staged_in_store
    else:
        folder = Path(tempfile.gettempdir()) / f"opd-state-{store.manifest.require().run_id}-step-{step:06d}"
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    _barrier(distributed)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # single process: DCP warns that it saves without a process group
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    except CheckpointException as e:  # a BaseException: the CLI would print DCP's whole report
        raise StoreError(f"cannot write the resume state {store.path(rel)}: {_checkpoint_reason(e)}") from None
    (folder / f"rng-{rank}.json").write_text(json.dumps(_rng_state()))
    if rank == 0:
        (folder / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
    _barrier(distributed)
    mine = [
        p
        for p in folder.iterdir()
        if p.name.startswith(f"__{rank}_")
        or p.name == f"rng-{rank}.json"
        or (rank == 0 and p.name in (".metadata", "trainer.json"))
    ]
    # Each rank checksums the files it wrote (on an object store they exist only in its own local folder);
    # rank 0 writes the merged manifest before `_COMPLETE`.
    checksums = _gather_to_rank0(manifest_for(folder, [p.name for p in mine]), distributed)
    if staged_in_store is None:
        for p in mine:
            store.write_bytes(f"{rel}/{p.name}", p.read_bytes())
        _barrier(distributed)
    if rank == 0:
        manifest = manifest_bytes({name: entry for part in checksums for name, entry in part.items()})
        if staged_in_store is not None:
            (folder / MANIFEST).write_bytes(manifest)
            (folder / COMPLETE_MARKER).write_text(f"{step}\n")
            store.replace_dir(folder, rel)  # over a folder from a crashed save without marker
        else:
            store.write_bytes(f"{rel}/{MANIFEST}", manifest)
            store.write_bytes(layout.complete_marker(rel), f"{step}\n".encode())
            shutil.rmtree(folder, ignore_errors=True)
        # the marker first: a deletion cut short by a kill leaves an incomplete state, never a damaged "complete" one
        prune_states(store, keep)
    _barrier(distributed)


def drop_corrupt_state(store: Store, error: CorruptStateError) -> None:
    """Quarantine the damaged files of a resume state and withdraw its `_COMPLETE`, so nothing loads it again."""
    for problem in error.problems:
        rel = f"{error.rel}/{problem.name}"
        if problem.status == "corrupt" and store.exists(rel):
            store.quarantine(rel, problem.reason)
    store.delete(layout.complete_marker(error.rel))


def _gather_to_rank0(obj, distributed: bool) -> list:
    """Every rank's `obj`, on rank 0 (other ranks get an empty list); a collective under torchrun."""
    if not distributed:
        return [obj]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, obj)
    return gathered if torch.distributed.get_rank() == 0 else []


class CorruptStateError(StoreError):
    """A resume state whose files differ from its `_CHECKSUMS.json`: never loaded, even in part."""

    def __init__(self, rel: str, problems: list[FileProblem]):
        self.rel, self.problems = rel, problems
        super().__init__("; ".join(p.reason for p in problems))


def load_state(
    store: Store, step: int, objective: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int = 0
) -> dict:
    """Load the resume state of step `step` into the model and optimizer; returns trainer.json.

    Every file is checked against the state's `_CHECKSUMS.json` before anything is loaded; a damaged or
    missing file raises CorruptStateError (the model and optimizer are untouched).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rel = layout.state_dir(step)
    cleanup = None
    folder = store.local_dir(rel)  # a local store: read in place
    if folder is None:  # an object store: read a downloaded copy
        cleanup = folder = Path(tempfile.mkdtemp(prefix=owned_temp_prefix("opd-state-")))
        store.download_dir(rel, folder)
    problems = verify_local_folder(folder)  # the bytes about to be loaded (on S3: the downloaded copy)
    if problems:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise CorruptStateError(rel, problems)
    if problems is None:
        legacy_warning("resume state", store.path(rel))
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        model_sd, optim_sd = get_state_dict(objective, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        reader, planner = _safe_dcp_loaders(str(folder))
        with warnings.catch_warnings(), _quiet_dcp_logging():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, planner=planner)
        set_state_dict(objective, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng = folder / f"rng-{rank}.json"
        if rng.exists():  # absent when resuming with more ranks than saved
            _set_rng_state(json.loads(rng.read_text()))
        return json.loads((folder / "trainer.json").read_text())
    except (CheckpointException, Exception) as e:  # truncated, tampered with, or of another model
        reason = _checkpoint_reason(e) if isinstance(e, CheckpointException) else f"{type(e).__name__}: {e}"
        raise StoreError(
            f"{store.path(rel)}: the resume state cannot be loaded ({' '.join(reason.split())}); "
            f"move it out of {store.path(TRAIN_STATE)} to resume from the previous state"
        ) from None
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)


@contextlib.contextmanager
def _quiet_dcp_logging():
    """DCP logs each failed metadata read with a traceback on the root logger; the error we raise says it all."""

    def not_dcp(record: logging.LogRecord) -> bool:
        return "torch/distributed/checkpoint" not in record.pathname.replace(os.sep, "/")

    logging.root.addFilter(not_dcp)
    try:
        yield
    finally:
        logging.root.removeFilter(not_dcp)


def _checkpoint_reason(e) -> str:
    """The underlying errors of a DCP CheckpointException (its str() is a whole traceback per rank)."""
    return "; ".join(f"{type(exc).__name__}: {exc}" for exc, *_ in e.failures.values())


# DCP metadata classes are dataclasses and enums of these modules; everything else a resume state's
# `.metadata` needs is listed here.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` but refuses any other global (a crafted file cannot call os.system & co.)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f".metadata refers to {module}.{name}, which a resume state never holds")


def _safe_dcp_loaders(folder: str):
    """(storage reader, load planner) for `dcp.load` that deserialize nothing but plain data.

    Defined here rather than at module level: importing torch.distributed.checkpoint takes seconds.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """FileSystemReader whose `.metadata` is read with `_MetadataUnpickler` (same file, same result)."""

        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """Non-tensor entries must pass `torch.load(weights_only=True)` before DCP deserializes them."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            data = value.read()
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except Exception as e:
                raise pickle.UnpicklingError(
                    f"entry {read_item.dest_index.fqn!r} is not plain data: {' '.join(str(e).split())[:200]}"
                ) from None
            super().load_bytes(read_item, io.BytesIO(data))  # the same bytes, so only weights_only-safe objects

    return SafeReader(folder), SafeLoadPlanner()


# ------------------------------------------------------------------ ledger
def write_consumed(store: Store, step: int, batch) -> None:
    """The rows trained at `step` (a GlobalBatch), one JSON object per line."""
    shard_of_row = [batch.shard_ids[i] for i in batch.row_shard.tolist()]
    lines = [
        json.dumps({"sample_id": s, "shard_id": sh, "teacher": t, "policy_version": v})
        for s, sh, t, v in zip(batch.sample_ids, shard_of_row, batch.teachers, batch.row_version.tolist())
    ]
    store.write_bytes(layout.consumed_path(step), ("\n".join(lines) + "\n").encode())


def clear_ledger_after(store: Store, step: int, finished_shards: list[str]) -> None:
    """Forget what happened after the resumed state: the resumed run writes it again."""
    for info in store.list_files(TRAIN_CONSUMED):
        trained_at = layout.consumed_step(info.base_name)
        if trained_at is not None and trained_at > step:
            store.delete(store.relative_path(info.path))
    finished = set(finished_shards)
    for info in store.list_files(TRAIN_SKIPPED):
        if layout.skipped_shard(info.base_name) not in finished:
            store.delete(store.relative_path(info.path))


def read_ledger(store: Store) -> tuple[dict[int, list[str]], dict[str, str]]:
    """({step: trained sample ids}, {skipped sample id: reason})."""
    trained = {}
    for info in store.list_files(TRAIN_CONSUMED):
        step = layout.consumed_step(info.base_name)
        if step is not None:
            trained[step] = [r["sample_id"] for r in iter_jsonl(store.read_bytes(store.relative_path(info.path)))]
    skipped = {}
    for info in store.list_files(TRAIN_SKIPPED):
        for r in iter_jsonl(store.read_bytes(store.relative_path(info.path))):
            skipped[r["sample_id"]] = r["reason"]
    return dict(sorted(trained.items())), skipped


def verify_ledger(store: Store) -> dict:
    """Check exactly-once: no row trained twice, none both trained and skipped; counts per outcome."""
    trained, skipped = read_ledger(store)
    seen: dict[str, int] = {}
    duplicates = []
    for step, ids in trained.items():
        for sid in ids:
            if sid in seen:
                duplicates.append((sid, seen[sid], step))
            seen[sid] = step
    return {
        "steps": len(trained),
        "trained": len(seen),
        "skipped": len(skipped),
        "expired": sum(1 for r in skipped.values() if r == "expired"),
        "duplicates": duplicates,
        "trained_and_skipped": sorted(set(seen) & set(skipped)),
    }


# ------------------------------------------------------------------ progress
def write_progress(store: Store, *, step: int, policy_version: int, cursor: dict, extra: dict | None = None) -> None:
    """`train/progress.json`, read by rollout for pacing (backlog = rows − consumed − expired)."""
    store.write_progress(
        {
            "step": step,
            "policy_version": policy_version,
            # rows the trainer is done with without expiring them: trained, plus rows routed to no teacher
            "consumed_samples": cursor["trained_samples"] + cursor["unrouted_samples"],
            "expired_samples": cursor["expired_samples"],
            "consumed_shards": len(cursor["finished"]),
            "trained_samples": cursor["trained_samples"],
            "unrouted_samples": cursor["unrouted_samples"],
            # rows of rollout shards that failed their checksum (quarantined; the other stages never count them)
            "lost_samples": cursor.get("lost_samples", 0),
            "lost_shards": cursor.get("lost_shards", 0),
            "current_shard": cursor["current"],
            "current_shard_rows": cursor["current_rows"],
            "time": round(time.time(), 3),
            **(extra or {}),
        }
    )
