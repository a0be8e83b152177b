"""Whether `opd run` may start on its store: a new store, its own run continued, or one line with the choices.

`opd run` once attached to whatever run its store held: the example config, whose store was then the demo's,
printed `step 800/5` for half a minute, exited 0 and overwrote the demo's logs/config.yaml (issue #26). Now:

    the store holds                       opd run                --resume                      --overwrite
    nothing (no run.json)                 starts a run           refused: nothing to resume    starts a run
    an unfinished run of this config      continues it (a        continues it                  deletes it, starts
                                          restart after a crash)
    a finished run (train/DONE)           refused                continues it (DONE cleared,   deletes it, starts
                                                                 to a higher max_steps)
    a run of another config               refused                continues it with this one    deletes it, starts

"This config" is the resolved config `opd run` records in the store when it starts (launch/config.yaml), compared
key by key except the keys that say how the run is carried out rather than what it trains (RESUMABLE_KEYS: the
step limit, worker counts, the evaluator, devices, polling). A store that no `opd run` recorded (stages started
by hand, a store of an earlier version) is compared on its run.json: the student.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from opd_cache.config import Config
from opd_cache.storage.layout import LAUNCH_CONFIG, TRAIN_DONE
from opd_cache.storage.manifest import student_id
from opd_cache.storage.store import Store

# Keys a continued run may change: how it runs, not what it trains (prefixes end with a dot).
RESUMABLE_KEYS = (
    "train.max_steps",
    "train.idle_timeout",
    "train.report_to",
    "train.tensorboard",
    "train.keep_states",
    "train.keep_versions",
    "train.prefetch_batches",
    "train.micro_batch_tokens",
    "train.activation_checkpointing",
    "train.chunk_size",
    "train.save_every",
    "rollout.max_samples",
    "rollout.max_shards",
    "rollout.flush_seconds",
    "annotate.max_shards",
    "annotate.max_tokens_per_batch",
    "annotate.head_chunk_tokens",
    "annotate.gpu_memory_utilization",
    "annotate.lease_seconds",
    "annotate.worker_index",
    "annotate.num_workers",
    "store.s3_endpoint",
    "run.",
    "ray.",
    "eval.",
)
RESUMABLE_SUFFIXES = (".poll_seconds", ".follow", ".device", ".worker_id")
SHOWN_DIFFERENCES = 3  # the refusal names this many differing keys, then counts the rest

CHOICES = "pass --resume to continue it{resume_hint}, --overwrite to delete it and start afresh, or another --store"


@dataclass(frozen=True)
class StoreRun:
    """What `opd run` found in its store, and what it will do there."""

    action: str  # "start" (a new run), "continue" (the store's run), "overwrite" (delete it, then start)
    message: str | None = None  # one line for the user, when there is something to say


def flat_config(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value) and name != "run.teachers":
            out.update(flat_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def resumable(key: str) -> bool:
    return key.endswith(RESUMABLE_SUFFIXES) or any(
        key.startswith(k) if k.endswith(".") else key == k for k in RESUMABLE_KEYS
    )


def _comparable(value: Any) -> Any:
    """A local path the same however it is written (runs/x and /abs/runs/x); anything else as it is."""
    if isinstance(value, str) and "://" not in value and value and os.path.exists(value):
        return os.path.realpath(value)
    return value


def _store_key(uri: str) -> str:
    return uri.rstrip("/") if "://" in uri else os.path.abspath(uri)


def config_differences(recorded: dict, given: Config) -> list[str]:
    """`key: A there, B here` for every key that decides what the run trains and differs."""
    there, here = flat_config(recorded), flat_config(given.model_dump(mode="json"))
    return [
        f"{key} {there.get(key)!r} there, {here.get(key)!r} here"
        for key in sorted(set(there) | set(here))
        if not resumable(key) and _comparable(there.get(key)) != _comparable(here.get(key))
    ]


def recorded_config(store: Store) -> dict | None:
    """The config `opd run` started the store's run with (None for a store no `opd run` started)."""
    if not store.exists(LAUNCH_CONFIG):
        return None
    return yaml.safe_load(store.read_bytes(LAUNCH_CONFIG)) or {}


def record_run_config(store: Store, cfg: Config) -> None:
    """Keep the run's config in its store: what a later `opd run` on it is compared with."""
    store.write_bytes(LAUNCH_CONFIG, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).encode())


def check_store_run(store: Store, cfg: Config, *, resume: bool = False, overwrite: bool = False) -> StoreRun:
    """What `opd run` does on `store` (the table of the module docstring), or ValueError with the choices."""
    where = f"store {store.uri}"
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other: --resume continues the store's run")
    run = store.manifest.read()
    if run is None:
        if resume:
            raise ValueError(f"--resume: {where} holds no run to continue; leave out --resume to start one")
        return StoreRun("start")
    if overwrite:
        return StoreRun("overwrite", f"{where}: deleting run {run.run_id} (--overwrite), then starting afresh")
    step = store.read_progress().get("step", 0)
    if store.is_done():
        if not resume:
            raise ValueError(
                f"{where} holds a finished run ({TRAIN_DONE} at step {step}); "
                + CHOICES.format(resume_hint=f" to a higher --train-max-steps than {step}")
            )
        if cfg.train.max_steps <= step:
            raise ValueError(
                f"--resume: the run in {store.uri} finished at step {step} and --train-max-steps is {cfg.train.max_steps}: "
                f"give a higher --train-max-steps to continue it"
            )
    recorded = recorded_config(store)
    if recorded is not None:
        differences = config_differences(recorded, cfg)
    elif run.student and cfg.rollout.student and run.student != student_id(cfg.rollout.student):
        differences = [f"rollout.student {run.student!r} there, {cfg.rollout.student!r} here"]
    else:
        differences = []
    if differences and not resume:
        more = len(differences) - SHOWN_DIFFERENCES
        shown = "; ".join(differences[:SHOWN_DIFFERENCES]) + (f"; {more} more" if more > 0 else "")
        raise ValueError(f"{where} holds a run of another config ({shown}); " + CHOICES.format(resume_hint=""))
    return StoreRun("continue", f"{where}: continuing run {run.run_id} from step {step}")


STAGE_LOGS = ("rollout-*.log", "annotate-*.log", "train.log", "eval.log")  # launch/run.py stage_commands' names


def overwrite_run(store: Store, logs: Path) -> None:
    """Delete the store's run (every file of it) and the logs an `opd run` wrote for it (the stages' logs and
    config.yaml; nothing else of the logs folder, which the user may share)."""
    for name in store.list_dirs(""):
        store.delete_dir(name)
    for info in store.list_files(""):
        store.delete(store.relative_path(info.path))
    for path in [logs / "config.yaml", *(p for pattern in STAGE_LOGS for p in logs.glob(pattern))]:
        path.unlink(missing_ok=True)


def check_logs_folder(logs: Path, cfg: Config) -> None:
    """Refuse a logs folder whose config.yaml belongs to a run on another store: never overwrite it silently."""
    previous = logs / "config.yaml"
    if not previous.is_file():
        return
    try:
        other = ((yaml.safe_load(previous.read_text()) or {}).get("store") or {}).get("uri")
    except yaml.YAMLError:
        other = None
    if other is not None and _store_key(other) != _store_key(cfg.store.uri):
        raise ValueError(
            f"--logs {logs}: its config.yaml is the run in {other}'s, not this store's ({cfg.store.uri}); "
            f"choose another --logs"
        )
