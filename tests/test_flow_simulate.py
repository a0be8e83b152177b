"""The pipeline model (opd_cache/flow/simulate.py) on a simulated clock: no sleeps, no models, seconds of CPU.

Both pacings are run on the same scenarios — a slow annotator, a slow trainer, a burst of rollout workers,
publish_every > 1 — so each test shows what admission by schedule changes: today's count-based pacing expires
rows (and, at the end of a run, can leave the trainer waiting on rows that will never train), the schedule does
not. A property test (hypothesis) draws stage speeds and settings: no admitted row expires unless one call of a
stage outlasts the window, and the trainer never waits while nothing in the pipeline works for it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opd_cache.flow.events import Signal, Simulation, Work
from opd_cache.flow.simulate import PipelineSpec, Service, simulate
from opd_cache.flow.suggest import Target, capacities, min_publish_every, predict, suggest

# a small pipeline: 16 samples per step, one shard per step, polls of 50 ms
BASE = PipelineSpec(
    rollout=Service(per_row=0.01, cv=0.3),
    annotate=Service(per_row=0.01, cv=0.3),
    train=Service(per_row=0.01, cv=0.3),
    steps=150,
    batch_samples=16,
    n=4,
    batch_prompts=4,
    flush_rows=16,
    max_buffer_samples=48,
    max_staleness=2,
    publish_every=1,
    save_every=50,
    rollout_poll_s=0.05,
    annotate_poll_s=0.05,
    train_poll_s=0.05,
    publish_latency_s=0.02,
    reload_latency_s=0.02,
)
POLLS = BASE.rollout_poll_s + BASE.annotate_poll_s + BASE.train_poll_s


# ---------------------------------------------------------------------- the kernel
def test_processes_share_cores_and_wake_on_signals_in_simulated_time():
    sim = Simulation(cores=1)
    finished, ready = {}, Signal(sim)

    def job(name, seconds):
        yield Work(seconds)
        finished[name] = sim.now
        ready.fire()

    def waiter():
        yield ready
        finished["woken"] = sim.now

    sim.spawn(waiter())
    sim.spawn(job("a", 1.0))
    sim.spawn(job("b", 2.0))
    sim.run()
    # one core: both run at half speed until a is done at t=2, then b alone needs 1 more second
    assert finished == {"woken": pytest.approx(2.0), "a": pytest.approx(2.0), "b": pytest.approx(3.0)}
    assert sim.cpu.busy_seconds == pytest.approx(3.0)


def run_jobs(cores: float, *jobs: tuple[str, float, float]) -> tuple[dict[str, float], Simulation]:
    """Start every (name, core-seconds, kept cores) job at t=0 on `cores`; when each finished."""
    sim, finished = Simulation(cores=cores), {}

    def job(name, seconds, kept_cores):
        yield Work(seconds, kept_cores=kept_cores)
        finished[name] = sim.now

    for spec in jobs:
        sim.spawn(job(*spec))
    sim.run()
    return finished, sim


def test_a_job_that_keeps_cores_runs_at_their_speed_while_the_others_share_the_rest():
    finished, sim = run_jobs(2, ("trainer", 2.0, 1.0), ("rollout", 1.0, 0.0), ("annotate", 3.0, 0.0))
    # the trainer alone on a core (2 s); rollout and annotate at half a core each until rollout is done at t=2,
    # then annotate alone: 3 - 1 = 2 more core-seconds on a free core
    assert finished == {"trainer": pytest.approx(2.0), "rollout": pytest.approx(2.0), "annotate": pytest.approx(4.0)}
    assert sim.cpu.busy_seconds == pytest.approx(6.0)

    # a trainer whose threads keep 1.5 cores: 3 core-seconds in 2 s, beside a job on the half core left
    finished, _ = run_jobs(2, ("trainer", 3.0, 1.5), ("rollout", 1.0, 0.0))
    assert finished == {"trainer": pytest.approx(2.0), "rollout": pytest.approx(2.0)}

    # one core: nothing is left to share, so the keeper is shared like any job
    finished, _ = run_jobs(1, ("trainer", 1.0, 1.0), ("rollout", 1.0, 0.0))
    assert finished == {"trainer": pytest.approx(2.0), "rollout": pytest.approx(2.0)}


def test_on_two_shared_cores_the_trainer_waits_when_the_producers_need_more_than_the_core_left():
    # per step: trainer 0.16 s, rollout + annotate 0.08 + 0.12 = 0.20 s of CPU. With a core each nobody waits long;
    # on 2 cores the trainer keeps one and the producers share the other: 0.16 s of their work fits beside a step,
    # the other 0.04 s runs while the trainer waits (on both cores, but the pipeline's shards come one after the
    # other, so it takes ~0.04 s): busy ~0.16 / 0.20
    spec = replace(
        BASE,
        rollout=Service(per_row=0.005),
        annotate=Service(per_row=0.0075),
        train=Service(per_row=0.01),
        bells=True,
    )
    separate, shared = simulate(spec, "schedule"), simulate(replace(spec, cores=2), "schedule")
    assert separate.busy_share > 0.97
    assert shared.busy_share == pytest.approx(0.80, abs=0.03)
    assert shared.expired == 0 and separate.expired == 0


def test_the_trainers_busy_share_counts_its_steps_elapsed_time_not_their_cpu():
    # the measured busy share is Σ step_time_s / Σ (step_time_s + data_wait_s), wall times; a trainer that keeps
    # 1.1 cores does 0.176 CPU-s of work in 0.16 s, and its compute is those 0.16 s
    spec = replace(BASE, train=Service(per_row=0.011), cores=2, train_kept_cores=1.1, bells=True, steps=50)
    result = simulate(spec, "schedule")
    assert result.compute_s == pytest.approx(50 * 16 * 0.011 / 1.1)
    assert result.busy_share == pytest.approx(result.compute_s / (result.compute_s + result.wait_s))


def test_in_lockstep_each_stages_pickup_latency_adds_to_every_step():
    # max_staleness 0: every step's rows are sampled after the version before it, so each step waits for the whole
    # chain; an idle annotate worker starts a shard annotate_pickup_s after it lands, the trainer takes it
    # train_pickup_s after it is scored (a bell's poll, a listing, a read on the real stages)
    lockstep = replace(
        BASE,
        rollout=Service(per_row=0.005),
        annotate=Service(per_row=0.005),
        train=Service(per_row=0.005),
        bells=True,
        steps=100,
        max_staleness=0,
        publish_latency_s=0.0,
        reload_latency_s=0.0,
    )
    plain = simulate(lockstep, "schedule")
    annotate_late = simulate(replace(lockstep, annotate_pickup_s=0.02), "schedule")
    train_late = simulate(replace(lockstep, train_pickup_s=0.03), "schedule")
    assert annotate_late.wall_s == pytest.approx(plain.wall_s + 100 * 0.02)
    assert train_late.wall_s == pytest.approx(plain.wall_s + 100 * 0.03)
    assert train_late.wait_s == pytest.approx(plain.wait_s + 100 * 0.03)  # the trainer waits for its own pickup


def test_a_busy_annotate_worker_takes_the_shards_that_landed_meanwhile_at_once():
    # rollout far ahead of a slow annotator: its next listing, after each shard, holds the next one, so the pickup
    # latency is paid once, for the first shard, which landed while the worker was idle
    backlog = replace(BASE, rollout=Service(per_row=0.002), annotate=Service(per_row=0.02), bells=True, steps=60)
    plain = simulate(backlog, "schedule")
    late = simulate(replace(backlog, annotate_pickup_s=0.05), "schedule")
    assert late.wall_s == pytest.approx(plain.wall_s + 0.05, abs=0.01)
    assert late.trained == plain.trained and late.expired == 0


def test_an_evaluator_slows_the_pipeline_only_when_it_shares_the_cores():
    spec = replace(BASE, bells=True)
    evaluated = replace(spec, eval_every=1, eval_s=0.1)  # 0.1 s of CPU per version: ~half a step each
    assert simulate(evaluated, "schedule").wall_s == pytest.approx(simulate(spec, "schedule").wall_s)  # own core
    alone, beside = simulate(replace(spec, cores=2), "schedule"), simulate(replace(evaluated, cores=2), "schedule")
    assert beside.wall_s > alone.wall_s * 1.05
    assert beside.trained == alone.trained and beside.expired == 0


def test_a_simulation_is_deterministic_and_cheap():
    spec = replace(BASE, steps=2000)
    t0 = time.process_time()
    first, second = simulate(spec, "schedule"), simulate(spec, "schedule")
    assert first == second
    assert first.trained == 2000 * 16
    assert time.process_time() - t0 < 20  # two runs of 2,000 steps: ~1 s of CPU here


# ---------------------------------------------------------------------- scenarios, both pacings
def both(spec: PipelineSpec, seeds: int = 2):
    return predict(spec, "count", seeds), predict(spec, "schedule", seeds)


def assert_nothing_wasted(result) -> None:
    assert result.finished
    assert result.expired_share == 0
    assert result.generated_per_trained <= 1.0 + 3 / BASE.batch_samples / BASE.steps  # at most n - 1 rows over


def test_balanced_stages():
    count, schedule = both(BASE)
    assert count.expired_share > 0.05  # today: rollout runs ahead at versions the trainer is about to leave
    assert_nothing_wasted(schedule)
    assert schedule.wall_s < count.wall_s


def test_a_slow_annotator_does_not_make_rows_expire():
    spec = replace(BASE, annotate=Service(per_row=0.03, cv=0.5))
    count, schedule = both(spec)
    assert count.expired_share > 0.2
    assert_nothing_wasted(schedule)


def test_a_slow_trainer_is_not_fed_rows_it_cannot_use():
    # no sample bound: only the rule holds rollout back
    spec = replace(BASE, train=Service(per_row=0.05, cv=0.5), max_buffer_samples=10**6)
    count, schedule = both(spec)
    assert count.generated_per_trained > 2  # today the backlog bound is the only brake, and it was lifted
    assert_nothing_wasted(schedule)
    assert schedule.longest_mutual_wait_s <= 2 * POLLS


def test_a_burst_of_rollout_workers_shares_one_budget():
    # eight fast workers: their unpublished batches count against the same open slots
    spec = replace(BASE, rollout_workers=8, max_buffer_samples=10**6)
    count, schedule = both(spec)
    assert count.generated_per_trained > 1.5
    # a batch (0.16 s) and a shard's scoring (0.16 s) plus the latencies just outlast the window (3 steps of
    # 0.16 s): now and then one batch arrives after newer rows took its slots
    assert schedule.expired_share <= 0.01
    assert schedule.generated_per_trained <= 1.01 + 8 * 3 / (BASE.batch_samples * BASE.steps)


def test_a_burst_of_slow_rollout_workers_expires_rows_once_a_batch_outlasts_the_window():
    """The rule is necessary, not sufficient: a batch that takes longer than (S + 1)·P steps arrives after newer
    rows took its slots. The model shows it, and `suggest` removes it (a larger publish_every here)."""
    spec = replace(BASE, rollout_workers=8, rollout=Service(per_row=0.04, cv=0.5))
    window_s = (spec.max_staleness + 1) * spec.publish_every * spec.train.mean(spec.batch_samples)
    assert spec.rollout.mean(spec.batch_prompts * spec.n) > window_s
    assert predict(spec, "schedule").expired_share > 0.05
    found = suggest(spec, publish_every=(2, 4, 8), target=Target(busy_share=0.0, expired_share=0.01))
    assert found.met and found.spec.publish_every > 1 and found.summary.expired_share <= 0.01


def test_publish_every_above_one():
    spec = replace(BASE, publish_every=3, max_staleness=1)
    count, schedule = both(spec)
    assert count.expired_share > 0
    assert_nothing_wasted(schedule)


def test_the_end_of_run_stall_of_todays_pacing():
    """A shard published late into a version below the trainer's window stays counted as coverage by rollout until
    the trainer's sweep lists its partition (one old partition per listing): the last steps wait for it, as the
    demo's `step 799/800 ... wait 59 s` did. By schedule, rows of dead versions cover nothing."""
    spec = replace(BASE, steps=400, train=Service(per_row=0.01, cv=0.6), annotate=Service(per_row=0.008, cv=0.6))
    counts = [simulate(replace(spec, seed=seed), "count") for seed in range(6)]
    schedules = [simulate(replace(spec, seed=seed), "schedule") for seed in range(6)]
    assert max(r.longest_mutual_wait_s for r in counts) > 20 * POLLS
    assert max(r.longest_mutual_wait_s for r in schedules) <= 2 * POLLS
    assert max(r.last_step_wait_s for r in schedules) <= chain_s(spec)  # a row's way through the pipeline, no more


# ---------------------------------------------------------------------- the property
def chain_s(spec: PipelineSpec) -> float:
    """The longest a row can take from its version's publication to the trainer's listing, with cv = 0."""
    return (
        spec.publish_latency_s
        + spec.reload_latency_s
        + spec.rollout.mean(spec.batch_prompts * spec.n)
        + spec.annotate.mean(spec.flush_rows)
        + spec.rollout_poll_s
        + spec.annotate_poll_s
        + spec.train_poll_s
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rollout_row_s=st.floats(0.001, 0.05),
    annotate_row_s=st.floats(0.001, 0.05),
    train_row_s=st.floats(0.001, 0.05),
    rollout_workers=st.integers(1, 4),
    annotate_workers=st.integers(1, 3),
    max_staleness=st.integers(0, 3),
    publish_every=st.integers(1, 3),
    batch=st.sampled_from([8, 12, 16]),
    seed=st.integers(0, 1000),
)
def test_no_admitted_row_expires_unless_a_call_outlasts_the_window_and_no_mutual_wait(
    rollout_row_s,
    annotate_row_s,
    train_row_s,
    rollout_workers,
    annotate_workers,
    max_staleness,
    publish_every,
    batch,
    seed,
):
    spec = replace(
        BASE,
        rollout=Service(per_row=rollout_row_s),
        annotate=Service(per_row=annotate_row_s),
        train=Service(per_row=train_row_s),
        rollout_workers=rollout_workers,
        annotate_workers=annotate_workers,
        max_staleness=max_staleness,
        publish_every=publish_every,
        batch_samples=batch,
        flush_rows=batch,
        batch_prompts=batch // 4,
        max_buffer_samples=10**6,
        steps=60,
        seed=seed,
    )
    result = simulate(spec, "schedule")
    assert result.finished and result.trained == 60 * batch
    # the trainer never waits while nothing that could end its wait is under way, beyond the polls' chain
    assert result.longest_mutual_wait_s <= 2 * POLLS + 1e-9
    window_s = (max_staleness + 1) * publish_every * spec.train.mean(batch)
    if chain_s(spec) <= window_s:
        assert result.expired == 0 and result.skipped_unscored == 0
    # rows beyond the trained ones: expired, skipped, or at most one batch per worker left over at the end
    leftover = result.generated - result.trained - result.expired - result.skipped_unscored
    assert 0 <= leftover <= rollout_workers * spec.batch_prompts * spec.n


# ---------------------------------------------------------------------- suggest
def test_suggest_adds_workers_to_the_slower_producer():
    # annotate at half the trainer's need; a window of 5 steps (0.8 s) holds a shard's scoring (0.32 s)
    spec = replace(BASE, steps=300, max_staleness=4, annotate=Service(per_row=0.02, cv=0.2))
    assert capacities(spec)["annotate"] < capacities(spec)["train"]
    found = suggest(spec)
    assert found.met, found.reason
    assert found.spec.annotate_workers >= 2
    assert found.summary.busy_share >= 0.95 and found.summary.expired_share <= 0.01


def test_suggest_says_why_when_the_window_is_shorter_than_the_latency():
    spec = replace(BASE, publish_latency_s=1.0, reload_latency_s=1.0)  # 2 s against a window of 3 × 0.16 s
    assert min_publish_every(spec) > 1
    found = suggest(spec)
    assert not found.met and "publish_every" in found.reason
    assert suggest(spec, publish_every=(2, 4, 8)).met
