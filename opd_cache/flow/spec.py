"""What `opd plan`'s pipeline model (flow/simulate.py) takes and gives: each stage's service time, the run's
settings, and the simulated run's outcome."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Service:
    """Seconds one call of a stage takes: `fixed` + `per_row` × rows, times a random factor of mean 1: one of
    `factors` (measured: each call's time over the mean, `opd plan --from-store`), else a gamma factor of
    coefficient of variation `cv` (0: always the mean)."""

    per_row: float
    fixed: float = 0.0
    cv: float = 0.0
    factors: tuple[float, ...] = ()

    def mean(self, rows: float) -> float:
        return self.fixed + self.per_row * rows

    def draw(self, rows: float, rng: random.Random) -> float:
        mean = self.mean(rows)
        if self.factors:
            return mean * self.factors[rng.randrange(len(self.factors))]
        if self.cv <= 0 or mean <= 0:
            return mean
        shape = 1.0 / (self.cv * self.cv)
        return rng.gammavariate(shape, mean / shape)


@dataclass(frozen=True)
class PipelineSpec:
    """Everything the model needs: the run's configuration and each stage's speed (per worker)."""

    rollout: Service  # one generate() call of up to batch_prompts × n rows, per worker
    annotate: Service  # one shard, per worker
    train: Service  # one optimizer step's compute (the trainer's step_time_s)
    steps: int = 800
    batch_samples: int = 64
    n: int = 4
    batch_prompts: int = 16
    flush_rows: int = 64
    flush_seconds: float = 60.0
    max_buffer_samples: int = 128
    max_staleness: int = 2
    publish_every: int = 1
    prefetch_batches: int = 2
    save_every: int = 50
    rollout_workers: int = 1
    annotate_workers: int = 1
    train_overhead_s: float = 0.0  # after each step: ledger, publication snapshot, progress, metrics
    save_s: float = 0.0  # a resume state (every save_every steps)
    publish_latency_s: float = 0.0  # end of a step -> the version is LATEST
    reload_latency_s: float = 0.0  # a rollout worker loads a new version
    annotate_pickup_s: float = 0.0  # an idle annotate worker: a shard's landing -> its scoring (bell, list, claim)
    train_pickup_s: float = 0.0  # a shard the trainer waited for: its landing -> its rows ready (bell, list, read)
    rollout_poll_s: float = 1.0
    annotate_poll_s: float = 1.0
    train_poll_s: float = 1.0
    bells: bool = False  # a local store: a waiting stage wakes at the write it waits on (storage/bells.py)
    startup_s: float = 0.0  # launch -> every stage ready (added to the wall time)
    cores: float | None = None  # None: one core per process; else the processes share this many cores
    train_kept_cores: float = 1.0  # with cores: what the computing trainer keeps (its CPU over its compute time)
    eval_every: int = 0  # an evaluator (opd run's) scores every eval_every-th version; 0: none
    eval_s: float = 0.0  # one evaluation's CPU seconds (with cores) or wall seconds
    announce_in_flight: bool = True  # schedule pacing: workers see each other's unpublished rows
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first field that cannot be simulated."""
        positive = ("steps", "batch_samples", "n", "batch_prompts", "flush_rows", "max_buffer_samples")
        for name in (*positive, "publish_every", "prefetch_batches", "save_every", "rollout_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.annotate_workers < 1:
            raise ValueError(f"annotate_workers = {self.annotate_workers}: must be >= 1")
        for name in ("annotate_pickup_s", "train_pickup_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 0")
        for name in ("rollout_poll_s", "annotate_poll_s", "train_poll_s", "flush_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be > 0")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness = {self.max_staleness}: must be >= 0")
        if self.train_kept_cores <= 0:
            raise ValueError(f"train_kept_cores = {self.train_kept_cores}: must be > 0")
        if self.eval_every < 0 or self.eval_s < 0:
            raise ValueError(f"eval_every = {self.eval_every}, eval_s = {self.eval_s}: must be >= 0")
        for stage in ("rollout", "annotate", "train"):
            service = getattr(self, stage)
            if service.per_row < 0 or service.fixed < 0 or service.mean(1) <= 0:
                raise ValueError(f"{stage} service time must be > 0 (per_row {service.per_row}, fixed {service.fixed})")


@dataclass
class SimResult:
    pacing: str
    finished: bool  # the trainer reached `steps` (False: it stalled until the horizon)
    wall_s: float  # startup + the last step's end
    busy_share: float  # Σ compute / Σ (compute + waiting for data)
    compute_s: float
    wait_s: float
    trained: int
    generated: int
    scored: int
    expired: int  # rows the trainer expired (too stale)
    skipped_unscored: int  # rows annotate left unscored because they could no longer train
    mean_staleness: float
    last_step_wait_s: float
    longest_mutual_wait_s: float  # the longest time the trainer waited while no producer worked (nor a publish)
    events: int  # simulation events (its cost)

    @property
    def expired_share(self) -> float:
        """Expired rows per trained row (the issue's measure)."""
        return self.expired / self.trained if self.trained else 0.0

    @property
    def generated_per_trained(self) -> float:
        return self.generated / self.trained if self.trained else math.inf
