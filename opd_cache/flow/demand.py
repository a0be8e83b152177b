"""The trainer's demand in samples (issue #14): published in `train/progress.json`, paced on by rollout and annotate.

A module of its own, without torch, so that the `opd run` supervisor can announce it before it starts the
stages without importing the trainer (train/checkpoint.py writes the rest of progress.json).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opd_cache.config import TrainConfig
    from opd_cache.storage.store import Store


def samples_needed_total(cfg: TrainConfig) -> int | None:
    """The samples all `max_steps` steps of a TrainConfig train (rollout and annotate pace on it, issue #14).

    Unknown (None) with a token budget per step: the stages then pace on `max_buffer_samples` alone."""
    return cfg.max_steps * cfg.global_batch_samples if cfg.global_batch_samples else None


def announce_demand(store: Store, cfg: TrainConfig) -> None:
    """`train/progress.json` gets the demand before any stage starts (`opd run`): the trainer itself writes
    progress only once its model is loaded and run.json exists, and rollout would sample `max_buffer_samples`
    ahead until then."""
    store.write_progress({**store.read_progress(), "samples_needed_total": samples_needed_total(cfg)})
