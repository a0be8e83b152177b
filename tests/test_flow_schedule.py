"""The trainer's schedule and the admission rule (opd_cache/flow/schedule.py, issue #25): pure arithmetic, no clock.

The step/version arithmetic is checked against the trainer's own (`Trainer.version_of_step`: the anchor, then a
version every `publish_every` steps), the rule against hand-counted cases, and the JSON against a round trip and
the one-line errors of a damaged file.
"""

from __future__ import annotations

import json

import pytest

from opd_cache.config import TrainConfig
from opd_cache.flow.schedule import (
    SCHEDULE_KEY,
    ScheduleError,
    TrainSchedule,
    read_schedule,
    schedule_from_config,
    schedule_progress,
)


def test_versions_and_last_steps_follow_the_trainers_anchor_and_publish_every():
    # a run resumed at step 4 with version 2 (its anchor moved there), a version every 3 steps
    schedule = TrainSchedule(max_steps=20, publish_every=3, max_staleness=1, anchor_step=4, anchor_version=2)
    # steps 5-7 train at version 2, 8-10 at 3, ... (the trainer publishes after steps 7, 10, 13)
    assert [schedule.version_of_step(s) for s in range(5, 14)] == [2, 2, 2, 3, 3, 3, 4, 4, 4]
    # rows of version 2 may train while V(s) <= 3: the last such step is 10
    assert schedule.last_step_for_version(2) == 10
    for v in range(2, 8):
        s_max = schedule.last_step_for_version(v)
        assert schedule.version_of_step(s_max) <= v + 1 < schedule.version_of_step(s_max + 1)
    assert schedule.deadline_step(7) == 20  # capped by max_steps


def test_a_fresh_run_publishing_every_step_has_the_designs_s_max():
    schedule = TrainSchedule(max_steps=100, publish_every=1, max_staleness=2, batch_samples=8)
    assert schedule.last_step_for_version(5) == 8  # s_max(v) = v + S + 1 with the anchor (0, 0)
    assert schedule.admissible_rows(5) == 64  # DESIGN.md §9's case: B·s_max(5) = 64


def test_the_rule_counts_trained_rows_and_pending_rows_against_the_open_slots():
    # B = 8, S = 2, P = 1; the stream has assembled 3 steps (24 rows trained)
    schedule = TrainSchedule(
        max_steps=10, publish_every=1, max_staleness=2, batch_samples=8, assembled_steps=3, trained_samples=24
    )
    # version 2's last step is 5: 40 rows in all through it, 24 taken -> 16 open slots
    assert schedule.open_slots(2) == 16
    assert schedule.may_emit(2, pending_at_or_below=8, rows=8)
    assert not schedule.may_emit(2, pending_at_or_below=8, rows=9)
    assert schedule.allowance(2, 16) == 0
    # a newer version has more open slots: its window reaches further
    assert schedule.open_slots(4) == 32 and schedule.allowance(4, 16) == 16


def test_pending_rows_leave_out_dead_versions_and_what_the_trainer_is_done_with():
    # next step 6 trains at version 5; with S = 1 versions < 4 can no longer train
    schedule = TrainSchedule(
        max_steps=50, max_staleness=1, batch_samples=8, assembled_steps=5, trained_samples=40, done_rows={4: 6}
    )
    assert schedule.oldest_live_version == 4
    published = {2: 16, 3: 8, 4: 8, 5: 16}  # versions 2, 3 are dead: those rows will expire, they take no slot
    in_flight = {5: 4, 6: 8}
    assert schedule.pending_at_or_below(5, published, in_flight) == (8 - 6) + (16 + 4)
    assert schedule.pending_at_or_below(6, published, in_flight) == (8 - 6) + (16 + 4) + 8
    # a quarantined shard's trained rows stay in done_rows while its rows leave `published`: never negative
    assert schedule.pending_at_or_below(4, {4: 2}, {}) == 0


def test_expired_rows_free_their_slots_so_the_run_can_still_finish():
    """DESIGN.md §9's first statement counted expired rows for ever; after one expiry the last steps would wait."""
    schedule = TrainSchedule(
        max_steps=4, max_staleness=0, batch_samples=8, assembled_steps=3, trained_samples=24, done_rows={3: 0}
    )
    # 8 rows of version 2 expired at step 3; the last step (version 3) needs 8 rows and nothing is pending
    assert schedule.allowance(3, schedule.pending_at_or_below(3, {2: 8, 3: 0}, {})) == 8


def test_rollout_rounds_whole_prompts_down_inside_the_run_and_up_for_its_last_rows():
    # S = 1: the remainder of version 1's slots can be filled by version 2's rows
    mid = TrainSchedule(max_steps=100, max_staleness=1, batch_samples=10)
    assert mid.allowance(1, 0) == 30 and mid.prompts_allowed(1, 0, n=4) == 7  # 28 rows, never beyond the bound
    # the run's last rows: nobody else can make them, so the last prompt is sampled whole (2 rows left over)
    end = TrainSchedule(max_steps=3, max_staleness=1, batch_samples=10, assembled_steps=2, trained_samples=20)
    assert end.allowance(5, 0) == 10 and end.prompts_allowed(5, 0, n=4) == 3
    # max_staleness 0: a version's rows are its steps' only source: rounded up too
    sync = TrainSchedule(max_steps=100, max_staleness=0, batch_samples=10)
    assert sync.prompts_allowed(0, 0, n=4) == 3


def test_annotate_deadlines_order_shards_by_version_and_a_passed_one_is_skipped():
    schedule = TrainSchedule(max_steps=30, publish_every=2, max_staleness=1, batch_samples=8, assembled_steps=9)
    # step 10 trains at version 4 (steps 9-10): version 3 can still train at step 10, version 2 cannot
    assert schedule.version_of_step(10) == 4
    assert [schedule.deadline_step(v) for v in (2, 3, 4)] == [8, 10, 12]
    assert schedule.deadline_passed(2) and not schedule.deadline_passed(3)
    shards = ["v000004-w00-000001", "v000002-w01-000000", "v000003-w00-000000"]
    order = sorted(shards, key=lambda s: (schedule.deadline_step(int(s[1:7])), s))
    assert order == ["v000002-w01-000000", "v000003-w00-000000", "v000004-w00-000001"]


def test_a_token_budget_admits_by_the_measured_rows_per_step_and_nothing_before_the_first_batch():
    before = TrainSchedule(max_steps=10, batch_samples=None, batch_tokens=4096)
    assert before.open_slots(3) is None and before.may_emit(3, 10**6)  # unknown: pacing as before #25
    assert before.prompts_allowed(3, 0, n=4) is None
    after = TrainSchedule(
        max_steps=10, batch_samples=None, batch_tokens=4096, rows_per_step=12.5, assembled_steps=2, partial_rows=5
    )
    # version 0's last step is 3 (S = 2): one more step at ~12.5 rows, less the 5 in the batch in assembly
    assert after.open_slots(0) == 12 - 5


def test_schedule_json_round_trips_through_progress_json(local_store):
    schedule = TrainSchedule(
        max_steps=12, publish_every=2, max_staleness=1, batch_samples=16, anchor_step=4, anchor_version=2,
        step=6, assembled_steps=8, partial_rows=3, trained_samples=131, done_rows={3: 16, 4: 7},
    )  # fmt: skip
    assert read_schedule(local_store) is None  # nothing published yet: the stages pace as before
    local_store.write_progress({"step": 6, **schedule_progress(schedule)})
    assert read_schedule(local_store) == schedule
    assert json.loads(schedule.dumps())["done_rows"] == {"3": 16, "4": 7}


def test_the_configs_schedule_before_the_trainer_starts():
    cfg = TrainConfig(max_steps=30, publish_every=3, global_batch_samples=32)
    schedule = schedule_from_config(cfg, max_staleness=1)
    assert (schedule.max_steps, schedule.publish_every, schedule.batch_samples, schedule.max_staleness) == (
        30,
        3,
        32,
        1,
    )
    assert schedule.anchor_step == schedule.trained_samples == 0


@pytest.mark.parametrize(
    "data, field",
    [
        ({"publish_every": 1}, "max_steps is missing"),
        ({"max_steps": "ten"}, "max_steps = 'ten', expected an integer"),
        ({"max_steps": 10, "done_rows": {"x": 1}}, "done_rows"),
        ({"max_steps": 10, "format": 99}, "format 99"),
        ({"max_steps": 10, "publish_every": 0}, "publish_every 0"),
        ({"max_steps": 10, "batch_samples": None}, "exactly one of batch_samples and batch_tokens"),
    ],
)
def test_a_damaged_schedule_is_a_one_line_error_naming_the_field(local_store, data, field):
    local_store.write_progress({SCHEDULE_KEY: data})
    with pytest.raises(ScheduleError, match=field) as error:
        read_schedule(local_store)
    assert "progress.json" in str(error.value) or "schedule" in str(error.value)
    assert "\n" not in str(error.value)
