"""Settings that keep the trainer busy without wasting samples, found with the pipeline model (flow/simulate.py).

`suggest` answers "how many workers, and which buffer, flush and poll settings?" for a target (by default the
trainer ≥ 95% busy with ≤ 1% of the trained count expired), in two moves:

1. **Throughput**: while the target is missed, add a worker to the producer with the smaller capacity relative to
   the trainer's consumption (rows per second), until both have `headroom` over it (or `max_workers`).
2. **Latency**: if throughput is not what is missing, the pipeline's latency is (a row must be sampled, scored
   and listed within the window of (S + 1)·P steps): try smaller shards (sooner to score), shorter polls and a
   larger buffer bound, and keep the best.

Every candidate is simulated on `seeds` seeds over at most `search_steps` steps (the mean is judged), so a
search costs seconds. `gpu_plan` builds the model of an N-GPU trainer from per-GPU rates and asks `suggest`
for the rollout and annotate workers it needs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from opd_cache.flow.simulate import PipelineSpec, Service, SimResult, simulate


@dataclass(frozen=True)
class Target:
    busy_share: float = 0.95
    expired_share: float = 0.01

    def met(self, result: Summary) -> bool:
        return result.finished and result.busy_share >= self.busy_share and result.expired_share <= self.expired_share


@dataclass(frozen=True)
class Summary:
    """The mean of several seeds' `SimResult`s (and the range of the wall time)."""

    pacing: str
    finished: bool
    wall_s: float
    wall_min_s: float
    wall_max_s: float
    busy_share: float
    expired_share: float
    mean_staleness: float
    generated_per_trained: float
    last_step_wait_s: float
    longest_mutual_wait_s: float
    events: int

    @classmethod
    def of(cls, results: list[SimResult]) -> Summary:
        walls = [r.wall_s for r in results]
        return cls(
            pacing=results[0].pacing,
            finished=all(r.finished for r in results),
            wall_s=statistics.fmean(walls),
            wall_min_s=min(walls),
            wall_max_s=max(walls),
            busy_share=statistics.fmean(r.busy_share for r in results),
            expired_share=statistics.fmean(r.expired_share for r in results),
            mean_staleness=statistics.fmean(r.mean_staleness for r in results),
            generated_per_trained=statistics.fmean(r.generated_per_trained for r in results),
            last_step_wait_s=statistics.fmean(r.last_step_wait_s for r in results),
            longest_mutual_wait_s=max(r.longest_mutual_wait_s for r in results),
            events=sum(r.events for r in results),
        )


def predict(spec: PipelineSpec, pacing: str, seeds: int = 3) -> Summary:
    """The model's prediction: `seeds` runs (seeds spec.seed, spec.seed + 1, ...), averaged."""
    return Summary.of([simulate(replace(spec, seed=spec.seed + i), pacing) for i in range(seeds)])


@dataclass(frozen=True)
class Suggestion:
    spec: PipelineSpec  # the suggested settings (full length)
    summary: Summary  # their prediction over the full run
    met: bool
    tried: int  # candidates simulated
    reason: str  # why the search stopped where it did


def capacities(spec: PipelineSpec) -> dict[str, float]:
    """Rows per second each stage can sustain (producers: all workers; the trainer: compute + what follows)."""
    batch_rows = spec.batch_prompts * spec.n
    shard_rows = math.ceil(spec.flush_rows / spec.n) * spec.n
    step_s = spec.train.mean(spec.batch_samples) + spec.train_overhead_s + spec.save_s / spec.save_every
    return {
        "rollout": spec.rollout_workers * batch_rows / (spec.rollout.mean(batch_rows) + spec.reload_latency_s / 2),
        "annotate": spec.annotate_workers * shard_rows / spec.annotate.mean(shard_rows),
        "train": spec.batch_samples / step_s,
    }


def suggest(
    spec: PipelineSpec,
    *,
    pacing: str = "schedule",
    target: Target = Target(),
    max_workers: int = 64,
    headroom: float = 1.3,
    seeds: int = 2,
    search_steps: int = 300,
    publish_every: tuple[int, ...] = (),
) -> Suggestion:
    """Worker counts and buffer/flush/poll settings that meet `target` under `pacing` (see the module doc).

    `publish_every`: other values to try, smallest first, when the spec's own cannot meet the target (a
    version every P steps widens the window to (S + 1)·P steps: the remedy when publishing and reloading a
    version take longer than S + 1 steps). A value whose window is shorter than the pipeline's latency
    (`min_publish_every`) is judged once, not searched."""
    search = _Search(pacing, target, max_workers, headroom, seeds, min(spec.steps, search_steps))
    shortest = min_publish_every(spec)
    choices = [spec.publish_every, *sorted(p for p in publish_every if p > spec.publish_every)]
    choices = [p for i, p in enumerate(choices) if i == 0 or p >= shortest or p == choices[-1]]
    best = None
    for every in choices:
        quick = every < shortest and every != choices[-1]
        found = search.run(replace(spec, publish_every=every), quick)
        if best is None or _better(found[1], best[1], target):
            best = found
        if target.met(found[1]):
            break
    full = replace(best[0], steps=spec.steps)
    summary = predict(full, pacing, seeds)
    return Suggestion(full, summary, target.met(summary), search.tried + 1, best[2])


@dataclass
class _Search:
    pacing: str
    target: Target
    max_workers: int
    headroom: float
    seeds: int
    steps: int
    tried: int = 0

    def judge(self, candidate: PipelineSpec) -> Summary:
        self.tried += 1
        return predict(candidate, self.pacing, self.seeds)

    def run(self, spec: PipelineSpec, quick: bool) -> tuple[PipelineSpec, Summary, str]:
        """The best settings found for `spec` (its publish_every fixed), their summary and why the search ended."""
        target, max_workers = self.target, self.max_workers
        short = replace(spec, steps=self.steps)
        # 1. throughput: start where both producers match the trainer, then grow the weaker one by 10%
        cap = capacities(short)
        parity = {}
        for stage in ("rollout", "annotate"):
            workers = getattr(short, f"{stage}_workers")
            per_worker = cap[stage] / workers
            parity[f"{stage}_workers"] = min(max_workers, max(workers, math.ceil(cap["train"] / per_worker)))
        best = replace(short, **parity)
        summary = self.judge(best)
        if quick:
            return best, summary, f"publish_every {spec.publish_every}: its window is shorter than the latency"
        reason = "the producers' throughput matches the trainer's"
        while not target.met(summary):
            cap = capacities(best)
            ratios = {stage: cap[stage] / cap["train"] for stage in ("rollout", "annotate")}
            weaker = min(ratios, key=ratios.get)
            field = f"{weaker}_workers"
            if ratios[weaker] >= self.headroom:
                reason = "throughput suffices; the pipeline's latency limits it"
                break
            if getattr(best, field) >= max_workers:
                reason = f"{weaker} would need more than {max_workers} workers"
                break
            grown = getattr(best, field) + max(1, getattr(best, field) // 10)
            best = replace(best, **{field: min(grown, max_workers)})
            summary = self.judge(best)
            reason = "workers added until the target was met"
        if target.met(summary):
            return best, summary, reason
        # 2. latency: half-size shards, shorter polls, a buffer bound as large as the window
        window_rows = (spec.max_staleness + 1) * spec.publish_every * spec.batch_samples
        for flush in sorted({best.flush_rows, max(spec.n, best.flush_rows // 2)}):
            for poll in sorted({best.train_poll_s, min(best.train_poll_s, 0.1)}):
                for buffer in sorted({best.max_buffer_samples, max(best.max_buffer_samples, window_rows)}):
                    candidate = replace(
                        best,
                        flush_rows=flush,
                        batch_prompts=min(best.batch_prompts, math.ceil(flush / spec.n)),
                        rollout_poll_s=min(best.rollout_poll_s, poll),
                        annotate_poll_s=min(best.annotate_poll_s, poll),
                        train_poll_s=poll,
                        max_buffer_samples=buffer,
                    )
                    if candidate == best:
                        continue
                    found = self.judge(candidate)
                    if _better(found, summary, target):
                        best, summary = candidate, found
        if target.met(summary):
            return best, summary, "half-size shards / shorter polls / a larger buffer bound met the target"
        return (
            best,
            summary,
            (
                f"not met with publish_every {spec.publish_every}: at best {summary.busy_share:.0%} busy, "
                f"{summary.expired_share:.1%} expired ({reason}); a larger publish_every or max_staleness widens "
                f"the window"
            ),
        )


def pipeline_latency(spec: PipelineSpec) -> float:
    """Seconds from a version's publication to the first batch of its rows being listed by the trainer: the
    write, the reload, a generate() call, scoring a shard, and half a poll of each stage (with bells: the
    annotate worker's and the trainer's pickups instead)."""
    batch_rows = spec.batch_prompts * spec.n
    polls = (
        spec.annotate_pickup_s + spec.train_pickup_s
        if spec.bells
        else (spec.rollout_poll_s + spec.annotate_poll_s + spec.train_poll_s) / 2
    )
    return (
        spec.publish_latency_s
        + spec.reload_latency_s
        + spec.rollout.mean(batch_rows)
        + spec.annotate.mean(spec.flush_rows)
        + polls
    )


def min_publish_every(spec: PipelineSpec, margin: float = 1.2) -> int:
    """The smallest publish_every whose window, (S + 1)·P steps, outlasts the pipeline's latency (× margin)."""
    step_s = spec.train.mean(spec.batch_samples) + spec.train_overhead_s
    return max(1, math.ceil(margin * pipeline_latency(spec) / ((spec.max_staleness + 1) * step_s)))


def _better(a: Summary, b: Summary, target: Target) -> bool:
    """Meeting the target beats missing it; then fewer expired rows within the bound, then a busier trainer."""
    if target.met(a) != target.met(b):
        return target.met(a)
    if (a.expired_share <= target.expired_share) != (b.expired_share <= target.expired_share):
        return a.expired_share <= target.expired_share
    return (a.busy_share, -a.wall_s) > (b.busy_share, -b.wall_s)


# ---------------------------------------------------------------------- the GPU case
@dataclass(frozen=True)
class GpuRates:
    """Per-GPU throughput of each stage and the workload's shape (tokens per sample)."""

    rollout_tokens_per_s: float  # generated (response) tokens per second, one rollout worker
    annotate_tokens_per_s: float  # scored (prompt + response) tokens per second, one annotate worker
    train_tokens_per_s: float  # trained (prompt + response) tokens per second, per trainer GPU
    prompt_tokens: int
    response_tokens: int
    publish_latency_s: float  # a version written and LATEST moved
    reload_latency_s: float  # a rollout worker loads it


# Assumed on paper, not measured (docs/flow-control.md, "Scale on paper"): a ~1.5B-parameter student and a
# ~7B teacher on H100-class GPUs, 256-token prompts, 1024-token responses, bf16, vLLM for rollout and scoring.
PAPER_RATES = GpuRates(
    rollout_tokens_per_s=20_000,
    annotate_tokens_per_s=30_000,
    train_tokens_per_s=30_000,
    prompt_tokens=256,
    response_tokens=1024,
    publish_latency_s=5.0,
    reload_latency_s=5.0,
)


def gpu_spec(rates: GpuRates, gpus: int, base: PipelineSpec, cv: float = 0.1) -> PipelineSpec:
    """The model of a trainer on `gpus` GPUs fed by one-GPU rollout and annotate workers, at `rates`."""
    row_tokens = rates.prompt_tokens + rates.response_tokens
    return replace(
        base,
        rollout=Service(per_row=rates.response_tokens / rates.rollout_tokens_per_s, cv=cv),
        annotate=Service(per_row=row_tokens / rates.annotate_tokens_per_s, cv=cv),
        train=Service(per_row=row_tokens / (gpus * rates.train_tokens_per_s), cv=cv),
        publish_latency_s=rates.publish_latency_s,
        reload_latency_s=rates.reload_latency_s,
        rollout_workers=1,
        annotate_workers=1,
    )


def gpu_plan(rates: GpuRates, gpus: int, base: PipelineSpec, target: Target = Target()) -> Suggestion:
    """How many rollout and annotate workers (one GPU each) keep a `gpus`-GPU trainer at the target; publish_every
    is searched too (1, 2, 4, ... 64): a version every step rarely survives a publish and reload of seconds."""
    return suggest(
        gpu_spec(rates, gpus, base),
        target=target,
        max_workers=max(64, 8 * gpus),
        publish_every=(1, 2, 4, 8, 16, 32, 64),
    )
