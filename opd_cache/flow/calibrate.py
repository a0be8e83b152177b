"""`opd plan --from-store`: the pipeline model's inputs measured from a run's metrics, and what that run measured.

The stages log one record per unit of work (observe/metrics.py), which is all the model needs:

- rollout, `metrics/rollout-<worker>.jsonl`: per shard `rows`, `tokens` and `tokens_per_s` (the worker's
  tokens over its seconds inside generate(), cumulative), so each shard's generate seconds are the differences of
  tokens / tokens_per_s; `reload` events after each policy load;
- annotate, `metrics/annotate-<worker>.jsonl`: per shard `rows` and `seconds` (read, score, write);
- each of these unit records also has `cpu_s`, the process's CPU since its previous one (`--cores`);
- train, `metrics/train-0.jsonl`: per step `step_time_s` (compute), `data_wait_s` (waiting for the next batch),
  the record's `time` (so what the step spent after its compute: ledger, publication, progress, state saves;
  and, against annotate's records, how long after a shard landed a step that waited for it went on),
  `samples`, `policy_version`, `staleness` and `expired_total`.

The settings the metrics do not hold (n, the flush and buffer sizes, poll intervals, max_staleness) come from
the run's configuration: the caller passes it (`opd plan --config`, or the `config.yaml` that `opd run` writes
into the logs folder). This module takes the records as plain dicts (`read_metrics(store)`), so it reads no
store itself.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, replace

from opd_cache.flow.simulate import PipelineSpec, Service

STAGES = ("rollout", "annotate", "train")


class MissingMetricsError(ValueError):
    """A store without the metrics of some stage; the message names the stages and the files."""


@dataclass(frozen=True)
class Measured:
    """What a finished (or running) run measured, in the model's terms."""

    span_s: float  # the first rollout batch's start -> the last step's end
    steps: int
    trained: int
    generated: int
    scored: int
    expired: int
    busy_share: float
    mean_staleness: float
    last_step_wait_s: float

    @property
    def expired_share(self) -> float:
        return self.expired / self.trained if self.trained else 0.0

    @property
    def generated_per_trained(self) -> float:
        return self.generated / self.trained if self.trained else 0.0


@dataclass(frozen=True)
class Calibration:
    spec: PipelineSpec
    measured: Measured
    tokens_per_row: float  # response tokens per generated row (rollout's tokens / rows)
    notes: tuple[str, ...] = ()  # what was assumed rather than measured
    shard_rows: int = 0  # the median rows per rollout shard (flush_rows, when no configuration says)
    samples_per_prompt: int = 0  # rows per prompt, from the workers' prompt cursors (n, likewise)


def _records(metrics: dict[str, list[dict]], stage: str) -> dict[str, list[dict]]:
    return {name: records for name, records in metrics.items() if name.startswith(f"{stage}-") and records}


def _service(per_row_seconds: list[float], per_call_rows: float = 1.0) -> Service:
    """A Service drawing from the measured spread: each call's seconds per row over their mean."""
    mean = statistics.fmean(per_row_seconds)
    cv = statistics.pstdev(per_row_seconds) / mean if len(per_row_seconds) > 1 and mean > 0 else 0.0
    factors = tuple(round(x / mean, 4) for x in per_row_seconds) if mean > 0 else ()
    return Service(per_row=mean / per_call_rows, cv=cv, factors=factors)


def check_metrics(metrics: dict[str, list[dict]], where: str = "the store") -> None:
    """Raise MissingMetricsError naming every stage without records (rollout shards, annotated shards, steps)."""
    missing = []
    if not any("shard" in r for recs in _records(metrics, "rollout").values() for r in recs):
        missing.append("rollout (metrics/rollout-*.jsonl: no shard records)")
    if not any(r.get("event") == "annotated" for recs in _records(metrics, "annotate").values() for r in recs):
        missing.append("annotate (metrics/annotate-*.jsonl: no annotated records)")
    if not any("step_time_s" in r for r in metrics.get("train-0", [])):
        missing.append("train (metrics/train-0.jsonl: no step records)")
    if missing:
        raise MissingMetricsError(f"{where} has no metrics of {'; '.join(missing)}: run the pipeline on it first")


def _cpu_per_row(records: list[dict], rows_key: str = "rows") -> list[float] | None:
    """Each unit's CPU seconds per row (`cpu_s`, observe/metrics.py's lap), None when the records lack it (a run
    of an older release); the first unit is left out (it carries the stage's start-up)."""
    if not records or any("cpu_s" not in r for r in records):
        return None
    values = [r["cpu_s"] / r[rows_key] for r in records if r[rows_key]]
    return values[1:] or values


def _reload_gaps(reloads: list[tuple[float, dict]], train: list[dict]) -> list[float]:
    """Each reload's seconds from the later of its worker's flush and the version's publication (the first step
    record at that policy version: written once the weights are handed to the publisher) to the reload record:
    the write, the bell and the load. A worker that flushed before the version was out waited for it, and that
    wait is the window's, not the reload's."""
    published_at = {}
    for r in sorted(train, key=lambda r: r["time"]):
        published_at.setdefault(r["policy_version"], r["time"])
    versions = sorted(published_at)
    gaps = []
    for flushed, r in reloads:
        i = bisect.bisect_left(versions, r["policy_version"])  # that version, or the first one after it
        if i < len(versions):
            gaps.append(r["time"] - max(flushed, published_at[versions[i]]))
    return gaps


def _annotate_pickup_lags(shards: list[dict], workers: dict[str, list[dict]]) -> list[float]:
    """For each shard that landed while its annotate worker was idle: the start of its scoring (the record's
    `time` less its `seconds`) minus its landing (the rollout record's `time`)."""
    landed = {r["shard"]: r["time"] for r in shards}
    lags = []
    for records in workers.values():
        idle_since = None  # the end of the worker's previous shard
        for r in records:
            if r.get("event") != "annotated":
                continue
            landing = landed.get(r.get("shard_id"))
            if landing is not None and idle_since is not None and landing > idle_since:
                lags.append(r["time"] - r["seconds"] - landing)
            idle_since = r["time"]
    return lags


def _train_pickup_lags(train: list[dict], annotated: list[dict]) -> list[float]:
    """For each step that waited for a shard which landed during its wait: the wait's end minus the landing.

    A step's record is written after its compute and bookkeeping, so its wait began at the previous record's
    `time` and ended `data_wait_s` later; the landing is the newest annotated record before that end."""
    landed = sorted(r["time"] for r in annotated)
    lags = []
    for prev, r in zip(train, train[1:]):
        if r["step"] != prev["step"] + 1 or r["data_wait_s"] <= 0.001:
            continue
        end = prev["time"] + r["data_wait_s"]
        i = bisect.bisect_right(landed, end) - 1
        if i >= 0 and end - landed[i] < r["data_wait_s"]:
            lags.append(end - landed[i])
    return lags


def calibrate(
    metrics: dict[str, list[dict]], base: PipelineSpec, where: str = "the store", cores: float | None = None
) -> Calibration:
    """The model's inputs measured from `metrics` (`read_metrics(store)`); the rest from `base` (the config).

    `cores`: the run's stages shared that many cores. Each stage's service time is then the CPU it took per unit
    (its records' `cpu_s`: compute, waiting loops and background threads), and the model shares the cores among
    the stages that compute at once, as the machine did; without it, each unit's wall time, a core per stage
    (GPU stages, or a core each)."""
    check_metrics(metrics, where)
    notes = []

    # rollout: per-shard generate seconds, per row
    rollout_workers = _records(metrics, "rollout")
    per_row, gen_rows, gen_tokens, first_start, reloads = [], 0, 0, None, []
    for records in rollout_workers.values():
        tokens_before = seconds_before = 0.0
        previous = None
        for r in records:
            if r.get("event") == "reload" and previous is not None and "shard" in previous:
                reloads.append((previous["time"], r))  # flush, then load (once the version is out: below)
            previous = r
            if "shard" not in r:
                continue
            # tokens_per_s is this incarnation's tokens over its generate() seconds (a restart starts both
            # again: its first shard then shows a negative difference, and is left out)
            tokens = tokens_before + r["tokens"]
            seconds = tokens / r["tokens_per_s"] if r.get("tokens_per_s") else seconds_before
            shard_seconds = seconds - seconds_before
            if shard_seconds > 0 and r["rows"] > 0:
                per_row.append(shard_seconds / r["rows"])
                start = r["time"] - shard_seconds
                first_start = start if first_start is None else min(first_start, start)
            gen_rows += r["rows"]
            gen_tokens += r["tokens"]
            tokens_before, seconds_before = tokens, seconds
    rollout = _service(per_row[1:] or per_row)  # the first batch warms the engine up
    shards = [r for recs in rollout_workers.values() for r in recs if "shard" in r]

    # annotate: per-shard seconds, per row
    annotated = [
        r
        for recs in _records(metrics, "annotate").values()
        for r in recs
        if r.get("event") == "annotated" and r["rows"]
    ]
    annotate = _service([r["seconds"] / r["rows"] for r in annotated[1:] or annotated])

    # train: compute per step, what follows it, state saves
    train = sorted((r for r in metrics["train-0"] if "step_time_s" in r), key=lambda r: r["step"])
    batch = round(statistics.median(r["samples"] for r in train))
    trainer = _service([r["step_time_s"] for r in train[1:] or train], per_call_rows=batch)
    after = {}
    for prev, r in zip(train, train[1:]):
        if r["step"] == prev["step"] + 1:
            after[r["step"]] = max(0.0, r["time"] - prev["time"] - r["step_time_s"] - r["data_wait_s"])
    save_every = base.save_every
    ordinary = [s for step, s in after.items() if step % save_every]
    overhead = statistics.median(ordinary) if ordinary else 0.0
    saves = [s - overhead for step, s in after.items() if step % save_every == 0]
    save_s = max(0.0, statistics.fmean(saves)) if saves else 0.0
    versions = [r["policy_version"] for r in train]
    if len(train) >= 2 and train[-1]["step"] > train[0]["step"]:
        publish_every = max(1, round((train[-1]["step"] - train[0]["step"]) / max(1, versions[-1] - versions[0])))
        if publish_every != base.publish_every:
            notes.append(
                f"publish_every {publish_every} from the policy versions (the config says {base.publish_every})"
            )
    else:
        publish_every = base.publish_every
    # how long after a shard lands an idle stage starts on it (bells only: without them the model waits out the
    # polls itself, and they are not part of the pickup)
    annotate_pickup_s, train_pickup_s = base.annotate_pickup_s, base.train_pickup_s
    if base.bells:
        annotate_lags = _annotate_pickup_lags(shards, _records(metrics, "annotate"))
        train_lags = _train_pickup_lags(train, annotated)
        if annotate_lags:
            annotate_pickup_s = statistics.median(annotate_lags)
        if train_lags:
            train_pickup_s = statistics.median(train_lags)
        if not annotate_lags or not train_lags:
            notes.append("a stage never waited for a shard: its pickup latency is not measured")
    reload_gaps = _reload_gaps(reloads, train)
    reload_s = statistics.median(reload_gaps) if reload_gaps else base.reload_latency_s
    if not reload_gaps:
        notes.append("no reload records: reload latency from the configuration's default")

    if cores is not None:
        cpu = {
            "rollout": _cpu_per_row(shards),
            "annotate": _cpu_per_row(annotated),
            "train": _cpu_per_row(train, rows_key="samples"),
        }
        missing = [stage for stage, values in cpu.items() if values is None]
        if missing:
            raise MissingMetricsError(
                f"{where}: the {', '.join(missing)} records have no cpu_s (written by an older release): "
                "shared cores cannot be modelled from them; leave out --cores"
            )
        rollout, annotate, trainer = (_service(cpu[stage]) for stage in ("rollout", "annotate", "train"))
        # the trainer's step kept this many cores (its main thread, and its loader and publisher beside it): its
        # CPU over its compute time; the producers computed on what was left
        train_kept_cores = min(cores, sum(r["cpu_s"] for r in train) / max(sum(r["step_time_s"] for r in train), 1e-9))
        notes.append(
            f"{cores:g} cores shared: each stage's CPU per row (cpu_s), not its wall time; the trainer's step kept "
            f"{train_kept_cores:.2f} of them"
        )
    else:
        train_kept_cores = base.train_kept_cores

    # opd run's evaluator: every eval_every-th version, an evaluation of the CPU (or seconds) it measured; the
    # first carries the evaluator's start-up and is left out
    evaluations = sorted((r for recs in _records(metrics, "eval").values() for r in recs), key=lambda r: r["version"])
    key = "cpu_s" if cores is not None else "seconds"
    timed = [r[key] for r in evaluations[1:] if key in r]
    steps_between = [b["version"] - a["version"] for a, b in zip(evaluations, evaluations[1:])]
    eval_every, eval_s = base.eval_every, base.eval_s
    if timed and steps_between:
        eval_every, eval_s = max(1, round(statistics.median(steps_between))), statistics.fmean(timed)
        notes.append(f"an evaluator every {eval_every} versions, {eval_s:.2f} s ({key}) each")
    elif evaluations:
        notes.append(
            "evaluator records without their CPU and seconds (an older release): the evaluator is not modelled"
        )

    spec = replace(
        base,
        rollout=rollout,
        annotate=annotate,
        train=trainer,
        batch_samples=batch,
        steps=train[-1]["step"],
        publish_every=publish_every,
        rollout_workers=len(rollout_workers),
        annotate_workers=len(_records(metrics, "annotate")),
        train_overhead_s=overhead,
        save_s=save_s,
        reload_latency_s=reload_s,
        annotate_pickup_s=annotate_pickup_s,
        train_pickup_s=train_pickup_s,
        startup_s=0.0,
        cores=cores if cores is not None else base.cores,
        train_kept_cores=train_kept_cores,
        eval_every=eval_every,
        eval_s=eval_s,
    )

    trained = sum(r["samples"] for r in train)
    staleness = sum(int(k) * v for r in train for k, v in (r.get("staleness") or {}).items())
    compute = sum(r["step_time_s"] for r in train)
    wait = sum(r["data_wait_s"] for r in train)
    measured = Measured(
        span_s=train[-1]["time"] - (first_start if first_start is not None else train[0]["time"]),
        steps=len(train),
        trained=trained,
        generated=gen_rows,
        scored=sum(r["rows"] for r in annotated),
        expired=int(train[-1].get("expired_total", 0)),
        busy_share=compute / (compute + wait) if compute + wait else 0.0,
        mean_staleness=staleness / trained if trained else 0.0,
        last_step_wait_s=train[-1]["data_wait_s"],
    )
    per_prompt = [
        (b["total_samples"] - a["total_samples"]) / (b["cursor"] - a["cursor"])
        for recs in rollout_workers.values()
        for a, b in zip([r for r in recs if "shard" in r], [r for r in recs if "shard" in r][1:])
        if b.get("cursor", 0) > a.get("cursor", 0)
    ]
    return Calibration(
        spec,
        measured,
        gen_tokens / gen_rows if gen_rows else 0.0,
        tuple(notes),
        shard_rows=round(statistics.median(r["rows"] for r in shards)),
        samples_per_prompt=round(statistics.median(per_prompt)) if per_prompt else 0,
    )
