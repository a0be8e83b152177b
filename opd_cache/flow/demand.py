"""The trainer's demand in samples (issue #14): published in `train/progress.json`, paced on by rollout and annotate.

A module of its own, without torch, so that the `opd run` supervisor can announce it before it starts the
stages without importing the trainer (train/checkpoint.py writes the rest of progress.json).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opd_cache.flow.schedule import SCHEDULE_KEY, TrainSchedule, schedule_from_config, schedule_progress

if TYPE_CHECKING:
    from opd_cache.config import TrainConfig
    from opd_cache.storage.store import Store


def samples_needed_total(cfg: TrainConfig) -> int | None:
    """The samples all `max_steps` steps of a TrainConfig train (rollout and annotate pace on it, issue #14).

    Unknown (None) with a token budget per step: the stages then pace on `max_buffer_samples` alone."""
    return cfg.max_steps * cfg.global_batch_samples if cfg.global_batch_samples else None


def announce_demand(store: Store, cfg: TrainConfig, max_staleness: int | None = None) -> None:
    """`train/progress.json` gets the demand, and with `max_staleness` the trainer's schedule (#25), before any
    stage starts (`opd run`): the trainer itself writes progress only once its model is loaded and run.json
    exists, and rollout would sample `max_buffer_samples` ahead until then.

    Continuing a store (a larger `max_steps`): the previous trainer's schedule keeps its anchor and counters with
    the new settings, and its train/DONE is cleared now (the trainer clears it too, but only once loaded: a
    following annotate or rollout worker would see it first and leave, and the new steps wait for ever)."""
    progress = store.read_progress()
    update: dict = {"samples_needed_total": samples_needed_total(cfg)}
    if max_staleness is not None:
        update.update(schedule_progress(continued_schedule(progress, cfg, max_staleness)))
        if store.is_done() and int(progress.get("step", 0)) < cfg.max_steps:
            store.clear_done()
    store.write_progress({**progress, **update})


def continued_schedule(progress: dict, cfg: TrainConfig, max_staleness: int) -> TrainSchedule:
    """The schedule of `cfg` from where the store's last trainer stopped (its progress record; none: the start)."""
    previous = progress.get(SCHEDULE_KEY)
    if previous is not None:
        counters = TrainSchedule.from_json(previous, where="train/progress.json 'schedule'")
        keep = ("anchor_step", "anchor_version", "step", "assembled_steps", "partial_rows", "trained_samples")
        fields = {name: getattr(counters, name) for name in keep}
        return schedule_from_config(cfg, max_staleness, done_rows=dict(counters.done_rows), **fields)
    step = int(progress.get("step", 0))  # a trainer older than #25: no anchor recorded, (0, 0) assumed
    return schedule_from_config(
        cfg, max_staleness, step=step, assembled_steps=step, trained_samples=int(progress.get("trained_samples", 0))
    )
