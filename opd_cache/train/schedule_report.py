"""The schedule the trainer publishes in `train/progress.json` (issue #25; the rule: opd_cache/flow/schedule.py).

Every progress write carries the static schedule (max_steps, publish_every, max_staleness, the batch size, the
version anchor) and one snapshot of the stream's counters, taken from one cursor so that they agree: the global
batches assembled, the rows of the one in assembly, every row handed to a step, and per live version the rows
the stream is done with. Rollout admits prompts by it, annotate orders and skips shards by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opd_cache.flow.schedule import schedule_from_config, schedule_progress

if TYPE_CHECKING:
    from opd_cache.config import TrainConfig
    from opd_cache.train.resume import TrainPosition
    from opd_cache.train.stream import StreamCursor


def trainer_schedule(
    cfg: TrainConfig,
    max_staleness: int,
    position: TrainPosition,
    cursor: StreamCursor,
    assembled_steps: int | None = None,
    partial_rows: int = 0,
) -> dict:
    """The `{"schedule": ...}` entry of a progress write: `cursor` is the stream's position after
    `assembled_steps` complete batches (None: the optimizer's step, the cursor of its batch) and `partial_rows`
    rows of the next one."""
    if assembled_steps is None:
        assembled_steps = position.step
    rows_per_step = None
    if cfg.global_batch_samples is None and assembled_steps > 0:  # a token budget: the measured mean
        rows_per_step = max(cursor.trained_samples - partial_rows, 0) / assembled_steps
    schedule = schedule_from_config(
        cfg,
        max_staleness,
        anchor_step=position.anchor_step,
        anchor_version=position.anchor_version,
        step=position.step,
        assembled_steps=assembled_steps,
        partial_rows=partial_rows,
        trained_samples=cursor.trained_samples,
        rows_per_step=rows_per_step,
        done_rows=dict(cursor.done_rows),
    )
    return schedule_progress(schedule)
