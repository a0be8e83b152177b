"""`opd plan`'s model of the pipeline: rollout workers, annotate workers and the trainer, simulated.

The three stages meet only in the store, and each finds out what changed by polling it, so the model is a set
of polling loops over one shared state (`SimStore`), run on a simulated clock (flow/events.py). Each loop does
what its stage's code does, in the same order, with two pacings:

- `"count"`, today's (rollout/pacing.py, flow/demand.py, annotate's `demand_covered`): rollout waits while the
  backlog (rows published − consumed − expired, as of the trainer's last progress) exceeds
  `max_buffer_samples`, or while it covers the trainer's remaining demand; it samples no more prompts than that
  demand lacks and publishes a waiting buffer only when the demand is covered or `flush_seconds` passed.
  Annotate scores the shards of the window [LATEST − S, LATEST] oldest first, one listing at a time, skips the
  too-stale ones (against LATEST) and stops while the scored rows cover the demand.
- `"schedule"`, admission by schedule (flow/schedule.py): rollout samples at version v only the prompts the rule
  allows (pending rows at versions ≤ v, other workers' batches included, against the open slots up to s_max(v))
  and publishes its buffer as soon as it stops; annotate scores by deadline (smallest s_max first), looks again
  after every shard, and skips a shard whose deadline has passed.

The trainer is the same in both: a prefetch thread assembles batches oldest version first from what its last
listing showed (a listing covers the window [V − S, V] of the step's version, the partitions that just left it,
and one older partition in turn, ShardWatch's sweep: a shard published late into an old version is expired only
when the sweep reaches it), expires too-stale shards, waits `poll` when short of rows and then publishes its
counters (a shard it waited for is ready `train_pickup_s` after it lands: the bell, the listing, the read); the
optimizer takes batches from a queue of `prefetch_batches`, computes, publishes a version every `publish_every`
steps (visible after `publish_latency_s`; at most one write in flight), writes progress, and saves a state every
`save_every` steps.

With `eval_every`, opd run's evaluator runs beside them (version 0, then every eval_every-th version, `eval_s`
each): it only takes CPU, so it matters when the processes share `cores`; the trainer's step then keeps
`train_kept_cores` of them (flow/events.py).

Service times are `Service`s: fixed + per-row seconds, times a gamma factor (mean 1, coefficient of variation
`cv`). Outputs (`SimResult`): wall time, the trainer's busy share Σ compute / Σ (compute + waiting for data),
samples generated, scored, trained and expired, the mean staleness of trained rows, and how long the last step
waited. With `bells` (a local store, storage/bells.py) a waiting loop also wakes at the store's next change,
after its pickup latency (`annotate_pickup_s`, `train_pickup_s`: a bell checked every 5 ms, a listing, a read).
"""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter
from dataclasses import dataclass, field, replace

from opd_cache.flow.events import Signal, Simulation, Wait, Work
from opd_cache.flow.schedule import TrainSchedule
from opd_cache.flow.spec import PipelineSpec, Service, SimResult

__all__ = ["PACINGS", "PipelineModel", "PipelineSpec", "Service", "SimResult", "simulate"]

PACINGS = ("count", "schedule")


# ---------------------------------------------------------------------- the store's state
@dataclass(eq=False)
class SimShard:
    version: int
    worker: int
    seq: int
    rows: int
    published_at: float
    scored_at: float | None = None
    claimed: bool = False
    skipped: bool = False  # annotate will never score it
    taken: int = 0  # rows the trainer handed out
    done: bool = False  # trained through or expired
    listed: bool = False  # some trainer listing held it

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.version, self.worker, self.seq)

    def __lt__(self, other: SimShard) -> bool:
        return self.key < other.key


@dataclass
class Progress:
    """train/progress.json as the trainer last wrote it."""

    consumed: int = 0
    expired: int = 0
    trained: int = 0
    schedule: TrainSchedule | None = None


@dataclass
class SimStore:
    latest: int = 0
    done: bool = False
    unfinished: list[SimShard] = field(default_factory=list)  # sorted; shards the trainer is not done with
    published_rows: int = 0
    published_by_version: Counter = field(default_factory=Counter)
    scored_rows: int = 0
    skipped_rows: int = 0
    in_flight: dict[int, tuple[int, int]] = field(default_factory=dict)  # worker -> (version, rows)
    progress: Progress = field(default_factory=Progress)
    unscored: list[SimShard] = field(default_factory=list)  # published, not scored, not skipped

    def publish(self, shard: SimShard) -> None:
        bisect.insort(self.unfinished, shard)
        bisect.insort(self.unscored, shard)
        self.published_rows += shard.rows
        self.published_by_version[shard.version] += shard.rows


# ---------------------------------------------------------------------- the model
class PipelineModel:
    def __init__(self, spec: PipelineSpec, pacing: str):
        if pacing not in PACINGS:
            raise ValueError(f"pacing {pacing!r}: expected one of {', '.join(PACINGS)}")
        spec.check()
        self.spec, self.pacing = spec, pacing
        self.sim = Simulation(cores=spec.cores)
        self.store = SimStore()
        self.rng = random.Random(spec.seed)
        self.needed = spec.steps * spec.batch_samples  # samples_needed_total, announced before the stages start
        # the run's schedule with its counters at zero; each snapshot fills them in from the stream's cursor
        self.run_schedule = TrainSchedule(
            max_steps=spec.steps,
            publish_every=spec.publish_every,
            max_staleness=spec.max_staleness,
            batch_samples=spec.batch_samples,
        )
        # the trainer's stream (its cursor) and the queue between its prefetch thread and the optimizer
        self.trained = self.expired = self.assembled = self.partial = 0
        self.done_by_version: Counter = Counter()
        self.current: SimShard | None = None
        self.listing: list[SimShard] = []
        self.listed_at = -math.inf
        self.listed_below: int | None = None
        self.sweep = 0
        self.queue: list[dict] = []
        self.queue_item, self.queue_space = Signal(self.sim), Signal(self.sim)
        # what the optimizer measured
        self.compute_s = self.wait_s = self.last_wait = 0.0
        self.annotate_busy_until = [-math.inf] * spec.annotate_workers  # each worker's last shard's end
        self.staleness_sum = 0
        self.finished_at: float | None = None
        self.publisher_free_at = 0.0
        self.working = 0  # producers generating, reloading or scoring now
        self.optimizer_waiting = False
        self.mutual_wait = self.longest_mutual_wait = 0.0
        self.store.progress = self.snapshot()
        # a local store's bells (storage/bells.py), one per top folder a stage waits on
        self.bells = {topic: Signal(self.sim) for topic in ("rollouts", "annotated", "train", "policy")}

    # ------------------------------------------------------------ waiting: a poll, or the bells
    def wait(self, poll_s: float, *topics: str):
        """What a waiting loop yields: its poll interval; with bells, also the next write under `topics`."""
        return Wait(tuple(self.bells[t] for t in topics), poll_s) if self.spec.bells else poll_s

    def rang(self, topic: str) -> None:
        """A write under `topic` (rollouts: a shard; annotated: a part; train: progress, DONE; policy: LATEST)."""
        if self.spec.bells:
            self.bells[topic].fire()

    # ------------------------------------------------------------ shared arithmetic
    def version_of_step(self, step: int) -> int:
        return (step - 1) // self.spec.publish_every

    def too_stale(self, version: int, latest: int) -> bool:
        return latest - version > self.spec.max_staleness

    def snapshot(self) -> Progress:
        """What the trainer writes to progress.json from its stream's cursor now."""
        schedule = replace(
            self.run_schedule, assembled_steps=self.assembled, partial_rows=self.partial, trained_samples=self.trained
        )
        live = schedule.oldest_live_version
        for version in [v for v in self.done_by_version if v < live]:
            del self.done_by_version[version]  # dead versions: no producer counts them any more
        done = dict(self.done_by_version)
        return Progress(self.trained, self.expired, self.trained, replace(schedule, done_rows=done))

    # ------------------------------------------------------------ rollout
    def rollout_worker(self, worker: int):
        spec, store = self.spec, self.store
        version, seq = store.latest, 0
        buffer, started = 0, 0.0
        prompts_per_shard = math.ceil(spec.flush_rows / spec.n)

        def flush():
            nonlocal buffer, seq
            if buffer:
                store.publish(SimShard(version, worker, seq, buffer, self.sim.now))
                seq += 1
                buffer = 0
                store.in_flight.pop(worker, None)
                if spec.annotate_pickup_s:  # an idle annotate worker starts on it that much later
                    self.sim.call_at(self.sim.now + spec.annotate_pickup_s, lambda: self.rang("rollouts"))
                else:
                    self.rang("rollouts")

        while not store.done:
            if store.latest > version:  # a newer policy: publish what the old one sampled, then reload
                flush()
                self.working += 1
                yield spec.reload_latency_s
                self.working -= 1
                version = max(version, store.latest)
                continue
            progress = store.progress
            backlog = store.published_rows - progress.consumed - progress.expired
            prompts = min(spec.batch_prompts, prompts_per_shard - buffer // spec.n)
            if self.pacing == "count":
                demand = self.needed - progress.trained - backlog
                covered = demand - buffer <= 0
                wait = backlog > spec.max_buffer_samples or self.too_stale(version, store.latest) or covered
                if wait:
                    if buffer and (covered or self.sim.now - started >= spec.flush_seconds):
                        flush()
                else:
                    prompts = min(prompts, math.ceil((demand - buffer) / spec.n))
            else:
                schedule = progress.schedule
                others = {}
                if spec.announce_in_flight:
                    for other, (v, rows) in store.in_flight.items():
                        if other != worker:
                            others[v] = others.get(v, 0) + rows
                others[version] = others.get(version, 0) + buffer
                pending = schedule.pending_at_or_below(version, store.published_by_version, others)
                prompts = min(prompts, schedule.prompts_allowed(version, pending, spec.n))
                wait = prompts <= 0 or backlog > spec.max_buffer_samples
                if wait:
                    flush()  # nothing more comes at this version for now: let annotate have it
            if wait:
                yield self.wait(spec.rollout_poll_s, "train", "policy")  # as rollout/worker.py's bell
                continue
            rows = prompts * spec.n
            if not buffer:
                started = self.sim.now
            store.in_flight[worker] = (version, buffer + rows)
            self.working += 1
            yield Work(spec.rollout.draw(rows, self.rng))
            self.working -= 1
            buffer += rows
            store.in_flight[worker] = (version, buffer)
            if buffer >= spec.flush_rows or self.sim.now - started >= spec.flush_seconds:
                flush()
        flush()

    # ------------------------------------------------------------ annotate
    def annotate_worker(self, worker: int):
        spec, store = self.spec, self.store
        while not store.done:
            if self.pacing == "count":
                worked = yield from self._annotate_pass_count(worker)
            else:
                worked = yield from self._annotate_next_by_deadline(worker)
            if not worked:
                yield self.wait(spec.annotate_poll_s, "rollouts", "train")

    def _visible(self, shard: SimShard, worker: int) -> bool:
        """Whether `worker` sees `shard` now: at once if it landed while the worker was busy (its next listing
        holds it), else `annotate_pickup_s` after it landed (the idle worker's bell poll, listing and claim)."""
        landed = shard.published_at
        return landed <= self.annotate_busy_until[worker] or self.sim.now >= landed + self.spec.annotate_pickup_s

    def _score(self, shard: SimShard, worker: int):
        shard.claimed = True
        self.working += 1
        yield Work(self.spec.annotate.draw(shard.rows, self.rng))
        self.working -= 1
        self.annotate_busy_until[worker] = self.sim.now
        shard.scored_at = self.sim.now
        self.store.unscored.remove(shard)
        self.store.scored_rows += shard.rows
        self.rang("annotated")

    def _skip(self, shard: SimShard) -> None:
        shard.skipped = True
        self.store.unscored.remove(shard)
        self.store.skipped_rows += shard.rows

    def _annotate_pass_count(self, worker: int):
        """One listing of the window [LATEST − S, LATEST], scored oldest first (annotate/worker.py `_loop`)."""
        store = self.store
        low = store.latest - self.spec.max_staleness
        pending = [s for s in store.unscored if s.version >= low and not s.claimed and self._visible(s, worker)]
        worked = False
        for shard in pending:
            if store.done:
                break
            if shard.claimed or shard.scored_at is not None or shard.skipped:
                continue  # another worker took it since the listing
            if self.too_stale(shard.version, store.latest):
                self._skip(shard)
                continue
            progress = store.progress
            used = progress.consumed + progress.expired
            if store.scored_rows - used >= self.needed - progress.trained:
                break  # the trainer's remaining demand is covered
            yield from self._score(shard, worker)
            worked = True
        return worked

    def _annotate_next_by_deadline(self, worker: int):
        """The unscored shard that expires first; one whose deadline has passed is skipped unscored."""
        store = self.store
        schedule = store.progress.schedule
        for shard in sorted(
            (s for s in store.unscored if not s.claimed and self._visible(s, worker)),
            key=lambda s: (schedule.deadline_step(s.version), s.key),
        ):
            if schedule.deadline_passed(shard.version):
                self._skip(shard)
                continue
            yield from self._score(shard, worker)
            return True
        return False

    # ------------------------------------------------------------ trainer: the stream (prefetch thread)
    def _refresh(self, version: int) -> None:
        """A listing for a step at `version` (ShardWatch.poll over [version − S, version] and the sweep)."""
        low = max(version - self.spec.max_staleness, 0)
        if self.listed_below is None:
            below = 0  # the first poll lists everything
        else:
            below = min(self.listed_below, low)
        sweep_version = None
        if self.listed_below is not None and below > 0:
            sweep_version = self.sweep % below
            self.sweep = sweep_version + 1
        for shard in self.store.unfinished:
            if not shard.listed and (shard.version >= below or shard.version == sweep_version):
                shard.listed = True
        self.listed_below = low if self.listed_below is None else max(self.listed_below, low)
        self.listing = [s for s in self.store.unfinished if s.listed]
        self.listing_scored = {id(s) for s in self.listing if s.scored_at is not None}
        self.listed_at = self.sim.now

    def _next_shard(self, version: int) -> SimShard | None:
        for shard in self.listing:
            if shard.done:
                continue
            if self.too_stale(shard.version, version):
                self._finish(shard, expired=shard.rows - shard.taken)
                continue
            if id(shard) in self.listing_scored:
                return shard
        return None

    def _finish(self, shard: SimShard, expired: int = 0) -> None:
        shard.done = True
        self.store.unfinished.remove(shard)
        if expired:
            self.expired += expired
            self.done_by_version[shard.version] += expired
        if self.current is shard:
            self.current = None

    def stream(self):
        spec = self.spec
        for step in range(1, spec.steps + 1):
            version = self.version_of_step(step)
            need, staleness, waited = spec.batch_samples, 0, False
            while need:
                if self.current is None:
                    fresh = self.sim.now - self.listed_at <= spec.train_poll_s
                    shard = self._next_shard(version) if fresh else None
                    if shard is None:
                        self._refresh(version)
                        shard = self._next_shard(version)
                    if shard is None:
                        progress = self.snapshot()  # the wait hook: publish what expired or was taken
                        if (progress.trained, progress.expired) != (
                            self.store.progress.trained,
                            self.store.progress.expired,
                        ):
                            self.store.progress = progress
                            self.rang("train")
                        # the optimizer waits too, and nothing that could end the wait is under way
                        idle = self.optimizer_waiting and not self.working and self.publisher_free_at <= self.sim.now
                        waited_from = self.sim.now
                        yield self.wait(spec.train_poll_s, "annotated")
                        self.mutual_wait = self.mutual_wait + (self.sim.now - waited_from) if idle else 0.0
                        self.longest_mutual_wait = max(self.longest_mutual_wait, self.mutual_wait)
                        waited = True
                        continue
                    if waited and spec.train_pickup_s:  # the shard it waited for: found, listed and read
                        yield spec.train_pickup_s
                        waited = False
                    self.current = shard
                self.mutual_wait = 0.0
                shard = self.current
                if self.too_stale(shard.version, version):
                    self._finish(shard, expired=shard.rows - shard.taken)
                    continue
                take = min(need, shard.rows - shard.taken)
                shard.taken += take
                need -= take
                self.trained += take
                self.partial += take
                self.done_by_version[shard.version] += take
                staleness += take * (version - shard.version)
                if shard.taken == shard.rows:
                    self._finish(shard)
            self.assembled, self.partial = step, 0
            batch = {"step": step, "staleness": staleness, "progress": self.snapshot()}
            while len(self.queue) >= spec.prefetch_batches:  # the loader holds this batch until there is room
                yield self.queue_space
            self.queue.append(batch)
            self.queue_item.fire()

    # ------------------------------------------------------------ trainer: the optimizer
    def optimizer(self):
        spec, store = self.spec, self.store
        for step in range(1, spec.steps + 1):
            asked = self.sim.now
            self.optimizer_waiting = True
            while not self.queue:
                yield self.queue_item
            self.optimizer_waiting = False
            batch = self.queue.pop(0)
            self.queue_space.fire()
            self.last_wait = self.sim.now - asked
            self.wait_s += self.last_wait
            compute = spec.train.draw(spec.batch_samples, self.rng)
            started = self.sim.now
            yield Work(compute, kept_cores=spec.train_kept_cores)  # measured: docs/flow-control.md
            self.compute_s += self.sim.now - started  # the step's elapsed time, as step_time_s (not its CPU)
            self.staleness_sum += batch["staleness"]
            overhead = spec.train_overhead_s
            if step % spec.publish_every == 0 or step == spec.steps:
                if self.publisher_free_at > self.sim.now:  # at most one write in flight
                    yield self.publisher_free_at - self.sim.now
                version = self.version_of_step(step) + 1
                self.publisher_free_at = self.sim.now + spec.publish_latency_s
                self.sim.call_at(self.publisher_free_at, lambda v=version: self._set_latest(v))
            store.progress = batch["progress"]
            self.rang("train")
            if step % spec.save_every == 0 or step == spec.steps:
                if self.publisher_free_at > self.sim.now:  # a state counts every version up to its own
                    yield self.publisher_free_at - self.sim.now
                overhead += spec.save_s
            if overhead:
                yield overhead
        store.done = True
        self.rang("train")
        self.finished_at = self.sim.now

    def _set_latest(self, version: int) -> None:
        self.store.latest = max(self.store.latest, version)
        self.rang("policy")

    # ------------------------------------------------------------ opd run's evaluator
    def evaluator(self):
        """Version 0, then every `eval_every`-th version once published, each in turn (evaluate_store): it only
        takes CPU from the stages, which matters when they share cores."""
        spec, store = self.spec, self.store
        version = 0
        while not store.done:
            if store.latest < version:
                yield self.wait(spec.train_poll_s, "policy", "train")
                continue
            yield Work(spec.eval_s)
            version += spec.eval_every

    # ------------------------------------------------------------ the run
    def run(self, horizon_s: float | None = None) -> SimResult:
        spec = self.spec
        if spec.eval_every and spec.eval_s > 0:
            self.sim.spawn(self.evaluator())
        for worker in range(spec.rollout_workers):
            self.sim.spawn(self.rollout_worker(worker))
        for worker in range(spec.annotate_workers):
            self.sim.spawn(self.annotate_worker(worker))
        self.sim.spawn(self.stream())
        self.sim.spawn(self.optimizer())
        if horizon_s is None:  # a stalled run is stopped: 20× the slowest stage's time for the whole run
            per_row = max(spec.rollout.mean(1), spec.annotate.mean(1), spec.train.mean(1) / spec.batch_samples)
            horizon_s = 20 * (spec.steps * spec.batch_samples * per_row + spec.steps * spec.train_overhead_s) + 60
        self.sim.run(until=horizon_s)
        finished = self.finished_at is not None
        end = self.finished_at if finished else self.sim.now
        return SimResult(
            pacing=self.pacing,
            finished=finished,
            wall_s=spec.startup_s + end,
            busy_share=self.compute_s / (self.compute_s + self.wait_s) if self.compute_s + self.wait_s else 0.0,
            compute_s=self.compute_s,
            wait_s=self.wait_s,
            trained=self.trained,
            generated=self.store.published_rows,
            scored=self.store.scored_rows,
            expired=self.expired,
            skipped_unscored=self.store.skipped_rows,
            mean_staleness=self.staleness_sum / self.trained if self.trained else 0.0,
            last_step_wait_s=self.last_wait,
            longest_mutual_wait_s=self.longest_mutual_wait,
            events=self.sim.events,
        )


def simulate(spec: PipelineSpec, pacing: str = "count", horizon_s: float | None = None) -> SimResult:
    """Run the pipeline model once (deterministic for a given `spec.seed`)."""
    return PipelineModel(spec, pacing).run(horizon_s)
