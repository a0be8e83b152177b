"""Admission by schedule in the real stages (issue #25 phase 2), each decision checked on a known store.

The stages' clocks are the trainer's counters: every test writes (or lets the trainer write) the schedule in
train/progress.json and then asks a stage what it does, so nothing waits on time. The timing side (a slow
annotator, a slow trainer, a burst of rollout workers, the property that no admitted row expires unless a stage
stalls longer than the window) is checked on the simulated pipeline, tests/test_flow_simulate.py; the end-of-run
stall with the real stages in tests/test_flow_end_of_run.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opd_cache.config import TrainConfig
from opd_cache.flow.demand import announce_demand
from opd_cache.flow.schedule import TrainSchedule, read_schedule, schedule_from_config, schedule_progress
from opd_cache.observe.metrics import read_metrics
from opd_cache.rollout.pacing import BacklogGauge
from opd_cache.storage.layout import make_shard_id
from tests.conftest import write_random_rollout_shard
from tests.test_annotate import config as annotate_config
from tests.test_annotate import store, teacher_path, write_shards  # noqa: F401  (fixtures)
from tests.test_trainer import student_path, teacher  # noqa: F401  (fixtures)


def publish_fake_policy(store, version: int, folder: Path) -> None:
    """policy/LATEST = `version` (the stages read only the number here)."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    store.publish_policy(version, folder)


def set_schedule(store, schedule: TrainSchedule) -> None:
    store.write_progress({**store.read_progress(), **schedule_progress(schedule)})


def add_rows(store, version: int, rows: int, seq: int = 0, worker: str = "w00") -> str:
    shard_id = make_shard_id(version, worker, seq)
    write_random_rollout_shard(store, shard_id=shard_id, num_rows=rows, seed=seq, run=store.manifest.require())
    return shard_id


def admission_schedule(**fields) -> TrainSchedule:
    """The admission tests' run: 100 steps of 8 rows, a version every step, staleness 1; `fields` change it."""
    return TrainSchedule(**{"max_steps": 100, "publish_every": 1, "max_staleness": 1, "batch_samples": 8, **fields})


# ---------------------------------------------------------------- rollout: how many prompts a call may take
def test_rollout_admits_by_the_schedule_with_publish_every_two(student_store):
    store = student_store
    add_rows(store, 0, 16)  # 8 of them trained (done_rows), 8 pending
    # P = 2, S = 1, B = 8: rows of version 0 train until step s_max(0) = (0 + 1 + 1)·2 = 4
    set_schedule(store, admission_schedule(publish_every=2, assembled_steps=1, trained_samples=8, done_rows={0: 8}))
    gauge = BacklogGauge(store)
    gauge.backlog()
    # B·4 − trained − pending = 32 − 8 − 8 = 16 rows: 4 prompts of 4; a buffer of 4 own rows takes one
    assert gauge.prompts_allowed(0, 0, n=4, max_buffer_samples=1000) == 4
    assert gauge.prompts_allowed(0, 4, n=4, max_buffer_samples=1000) == 3
    # version 1 trains until step 6: 48 − 8 − 8 = 32 rows, 8 prompts; the live backlog bound (20 rows) caps it
    assert gauge.prompts_allowed(1, 0, n=4, max_buffer_samples=1000) == 8
    assert gauge.prompts_allowed(1, 0, n=4, max_buffer_samples=20) == 3  # (20 − 8 pending) // 4


def test_a_late_shard_of_a_dead_version_blocks_no_one(student_store):
    store = student_store
    for version in (5, 6):
        add_rows(store, version, 8)
    schedule = admission_schedule(assembled_steps=6, trained_samples=48, done_rows={5: 8})
    set_schedule(store, schedule)
    gauge = BacklogGauge(store)
    gauge.backlog()
    before = gauge.prompts_allowed(6, 0, n=4, max_buffer_samples=1000)
    # s_max(6) = 8: 64 − 48 − 8 (version 6's rows) = 8 rows
    assert before == 2
    add_rows(store, 0, 64, seq=1)  # a worker that sampled with version 0 publishes now: it can never train
    gauge.backlog()
    assert gauge.rows.by_version[0] == 64
    assert gauge.prompts_allowed(6, 0, n=4, max_buffer_samples=1000) == before


def test_a_resumed_trainer_whose_anchor_moved_admits_by_its_anchor(student_store):
    store = student_store
    # a stop at step 5 published an extra version: version 6 after 5 steps, later steps count from (5, 6)
    moved = admission_schedule(anchor_step=5, anchor_version=6, step=5, assembled_steps=5, trained_samples=40)
    set_schedule(store, moved)
    gauge = BacklogGauge(store)
    gauge.backlog()
    assert moved.version_of_step(6) == 6 and moved.last_step_for_version(6) == 7
    assert gauge.prompts_allowed(6, 0, n=4, max_buffer_samples=1000) == 4  # 8·7 − 40 = 16 rows
    set_schedule(store, TrainSchedule(**{**moved.__dict__, "anchor_step": 0, "anchor_version": 0}))
    gauge.backlog()
    assert gauge.prompts_allowed(6, 0, n=4, max_buffer_samples=1000) == 6  # unmoved, s_max(6) = 8: 64 − 40


def test_the_runs_last_rows_round_up_and_no_schedule_paces_as_before(student_store):
    store = student_store
    gauge = BacklogGauge(store)
    gauge.backlog()
    assert gauge.schedule is None and gauge.prompts_allowed(0, 0, n=4, max_buffer_samples=64) is None
    # 3 steps of 6 rows, 12 trained: 6 rows left, 1.5 prompts: 2 (nothing else can fill the last step)
    set_schedule(store, TrainSchedule(max_steps=3, batch_samples=6, assembled_steps=2, trained_samples=12))
    gauge.backlog()
    assert gauge.prompts_allowed(2, 0, n=4, max_buffer_samples=64) == 2
    store.mark_done()  # the trainer finished: rows sampled now are for a later run, paced by count
    gauge.backlog()
    assert gauge.schedule is None and gauge.prompts_allowed(2, 0, n=4, max_buffer_samples=64) is None


@st.composite
def mid_run_schedules(draw) -> TrainSchedule:
    """A 25-step run anywhere in its course: any batch, publication period and staleness bound, 0-20 steps done."""
    batch, assembled = draw(st.integers(1, 16)), draw(st.integers(0, 20))
    return TrainSchedule(
        max_steps=25,
        publish_every=draw(st.integers(1, 3)),
        max_staleness=draw(st.integers(0, 3)),
        batch_samples=batch,
        assembled_steps=assembled,
        trained_samples=assembled * batch,
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    schedule=mid_run_schedules(),
    version_offset=st.integers(-3, 3),
    published=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    n=st.integers(1, 5),
)
def test_no_admitted_row_is_beyond_the_bound(schedule, version_offset, published, n):
    """Whatever the counters: trained + pending(≤ v) + the admitted rows ≤ B·min(s_max(v), max_steps), but for
    the rounding up of a version's only source (at most n − 1 rows)."""
    live = schedule.oldest_live_version
    by_version = {live + i: rows for i, rows in enumerate(published)}
    version = schedule.version_of_step(schedule.next_step) + version_offset
    pending = schedule.pending_at_or_below(version, by_version)
    prompts = schedule.prompts_allowed(version, pending, n)
    bound = schedule.batch_samples * schedule.deadline_step(version)
    slack = n - 1 if schedule.deadline_step(version) == schedule.max_steps or schedule.max_staleness == 0 else 0
    assert schedule.trained_samples + pending + prompts * n <= max(bound, schedule.trained_samples + pending) + slack


# ---------------------------------------------------------------- annotate: deadline order, expired skipped
class AdvancingTrainer:
    """A scorer wrapper: the trainer assembles `steps_per_shard` steps while each shard is scored (the clock)."""

    def __init__(self, scorer, store, schedule: TrainSchedule, steps_per_shard: int):
        self.scorer, self.store, self.schedule, self.steps = scorer, store, schedule, steps_per_shard
        self.order: list[int] = []

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def score(self, prompts, responses, top_k, support=None):
        out = self.scorer.score(prompts, responses, top_k, support)
        self.schedule = TrainSchedule(
            **{**self.schedule.__dict__, "assembled_steps": self.schedule.assembled_steps + self.steps}
        )
        set_schedule(self.store, self.schedule)
        return out


def test_annotate_scores_by_deadline_and_skips_what_expired_meanwhile(store, teacher_path, tmp_path):
    from opd_cache.annotate import Annotator
    from opd_cache.annotate.engines import make_scorer

    shards = {v: write_shards(store, 1, version=v, num_rows=2)[0] for v in range(4)}
    publish_fake_policy(store, 3, tmp_path / "policy")
    # P = 1, S = 2, B = 2; the trainer assembled 3 steps: next step 4 trains version 3, version 0's window (steps
    # 1..3) is over; the first shard scored takes 2 steps, after which version 1's deadline (step 4) has passed too
    schedule = TrainSchedule(max_steps=100, max_staleness=2, batch_samples=2, assembled_steps=3, trained_samples=6)
    set_schedule(store, schedule)
    cfg = annotate_config(teacher_path, top_k=4, max_staleness=2)
    annotator = Annotator(cfg, store, progress=False)
    annotator.scorer = AdvancingTrainer(make_scorer(cfg.annotate, 4, annotator.vocab_size), store, schedule, 2)
    stats = annotator.run()
    assert stats.skipped_expired == [shards[0], shards[2]] and stats.skipped_expired_rows == 4
    assert stats.annotated == [shards[1], shards[3]]  # deadlines 4 and 6: 1 first
    events = [r for r in read_metrics(store)["annotate-teacher-0"] if r.get("event") == "skipped_expired"]
    assert [(e["shard_id"], e["rows"], e["deadline_step"]) for e in events] == [(shards[0], 2, 3), (shards[2], 2, 5)]


# ---------------------------------------------------------------- the trainer publishes, opd run announces
def test_the_trainer_publishes_its_schedule_with_a_moved_anchor(tmp_path, student_path, tokenizer, teacher):
    from opd_cache.train import run_train
    from tests.test_trainer import config, make_store

    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=3, rows=8)
    result = run_train(config(store, max_steps=3, publish_every=2, max_staleness=2), store)
    assert result.step == 3
    schedule = read_schedule(store)
    # step 3 is not a publish step: the end published version 2 and moved the anchor to (3, 2)
    assert (schedule.anchor_step, schedule.anchor_version, schedule.step) == (3, 2, 3)
    assert (schedule.assembled_steps, schedule.partial_rows, schedule.trained_samples) == (3, 0, 24)
    assert schedule.done_rows == {0: 24} and schedule.publish_every == 2 and schedule.batch_samples == 8


def test_announcing_a_continued_run_keeps_the_anchor_and_clears_a_stale_done(local_store):
    store = local_store
    # a finished run of 4 steps of 8 rows whose end published version 5 (the anchor moved to (4, 5))
    four_steps = TrainConfig(max_steps=4, global_batch_samples=8)
    finished = schedule_from_config(
        four_steps,
        2,  # max_staleness
        anchor_step=4,
        anchor_version=5,
        step=4,
        assembled_steps=4,
        trained_samples=32,
        done_rows={3: 8, 4: 8},
    )
    store.write_progress({"step": 4, "trained_samples": 32, **schedule_progress(finished)})
    store.mark_done()
    announce_demand(store, four_steps, max_staleness=2)
    assert store.is_done()  # nothing more to train: the DONE stands
    announce_demand(store, TrainConfig(max_steps=6, global_batch_samples=8), max_staleness=2)
    assert not store.is_done()
    schedule = read_schedule(store)
    assert schedule.max_steps == 6 and store.read_progress()["samples_needed_total"] == 48
    assert (schedule.anchor_step, schedule.anchor_version, schedule.trained_samples) == (4, 5, 32)
    assert schedule.done_rows == {3: 8, 4: 8}


@pytest.mark.parametrize("step", [0, 3])
def test_announcing_without_a_previous_schedule_starts_from_the_progress(local_store, step):
    local_store.write_progress({"step": step, "trained_samples": 8 * step} if step else {})
    announce_demand(local_store, TrainConfig(max_steps=10, global_batch_samples=8), max_staleness=1)
    schedule = read_schedule(local_store)
    assert (schedule.max_staleness, schedule.assembled_steps, schedule.trained_samples) == (1, step, 8 * step)
