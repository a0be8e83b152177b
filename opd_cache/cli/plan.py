"""`opd plan`: the pipeline simulated (opd_cache/flow/simulate.py) — today's pacing vs admission by schedule,
the settings that would keep the trainer busy, and the workers an N-GPU trainer needs.

    opd plan --config examples/arithmetic_cpu/config.yaml --rollout-samples-per-s 550 \\
        --annotate-samples-per-s 600 --train-samples-per-s 400
    opd plan --from-store runs/demo/store          # rates measured from the run's metrics
    opd plan --gpus 1,8,64                          # the GPU case, at the rates assumed on paper
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer
from rich.table import Table

from opd_cache.cli.common import SetOpt, app, console, user_errors

WIDE = 130  # tables are printed at least this wide (a log file or a pipe would cut them at 80 columns)
STAGE_RATE_FLAGS = {
    "rollout": ("--rollout-samples-per-s", "--rollout-tokens-per-s"),
    "annotate": ("--annotate-samples-per-s", "--annotate-tokens-per-s"),
    "train": ("--train-samples-per-s", "--train-tokens-per-s"),
}


def spec_from_config(cfg, rollout, annotate, train):
    """The model's settings from a run configuration (`opd_cache.config.Config`) and three `Service`s."""
    from opd_cache.flow.simulate import PipelineSpec
    from opd_cache.storage.bells import rings

    t = cfg.train
    if t.global_batch_samples is None:
        raise ValueError(
            "train.global_batch_tokens: opd plan models a fixed number of samples per step (the admission rule "
            "assumes it too); give --batch-samples N, the samples a step takes on average"
        )
    return PipelineSpec(
        rollout=rollout,
        annotate=annotate,
        train=train,
        steps=t.max_steps,
        batch_samples=t.global_batch_samples,
        n=cfg.rollout.n,
        batch_prompts=cfg.rollout.batch_prompts,
        flush_rows=cfg.rollout.flush_rows,
        flush_seconds=cfg.rollout.flush_seconds,
        max_buffer_samples=cfg.rollout.max_buffer_samples,
        max_staleness=cfg.max_staleness,  # the one top-level bound (per-stage keys are retired)
        publish_every=t.publish_every,
        prefetch_batches=t.prefetch_batches,
        save_every=t.save_every,
        rollout_workers=cfg.run.rollout_workers,
        annotate_workers=cfg.run.annotate_workers,
        rollout_poll_s=cfg.rollout.poll_seconds,
        annotate_poll_s=cfg.annotate.poll_seconds,
        train_poll_s=t.poll_seconds,
        # a local store's bells wake a waiting stage at the write it waits on (storage/bells.py)
        bells=rings(cfg.store.uri),
    )


def run_config_of_store(store_uri: str) -> Path | None:
    """The resolved config `opd run` wrote for this store (logs/config.yaml beside it, or inside it)."""
    if "://" in store_uri:
        return None
    store = Path(store_uri.rstrip("/"))
    for candidate in (store.parent / "logs" / "config.yaml", store / "logs" / "config.yaml"):
        if candidate.exists():
            return candidate
    return None


def stage_services(rates: dict, tokens: dict, cv: float, measured: dict):
    """One `Service` per stage from the rate flags (samples/s or tokens/s) or, without a flag, the measured one.

    `rates`: stage -> (samples per second, tokens per second) as given; `tokens`: prompt and response tokens per
    sample (None: unknown). Raises a one-line ValueError naming the flag that is missing or contradicted."""
    from opd_cache.flow.simulate import Service

    services = {}
    for stage, (samples_flag, tokens_flag) in STAGE_RATE_FLAGS.items():
        per_sample, per_token = rates[stage]
        if per_sample is not None and per_token is not None:
            raise ValueError(f"{samples_flag} and {tokens_flag}: give one rate for {stage}, not both")
        if per_token is not None:
            # rollout makes response tokens; annotate and train read prompt + response
            needed = ("response",) if stage == "rollout" else ("prompt", "response")
            missing = [f"--{name}-tokens" for name in needed if tokens.get(name) is None]
            if missing:
                raise ValueError(f"{tokens_flag} needs {' and '.join(missing)} (tokens per sample) to count samples")
            per_sample = per_token / sum(tokens[name] for name in needed)
        if per_sample is not None:
            if per_sample <= 0:
                raise ValueError(f"{samples_flag if per_token is None else tokens_flag}: must be > 0")
            services[stage] = Service(per_row=1.0 / per_sample, cv=cv)
        elif stage in measured:
            services[stage] = measured[stage]
        else:
            raise ValueError(f"no {stage} rate: give {samples_flag} or {tokens_flag} (or --from-store STORE)")
    return services


def wide_console():
    """The console, at least WIDE columns wide: a pipe or a log file would cut the tables at 80 columns."""
    from rich.console import Console

    return console if console.width >= WIDE else Console(width=WIDE, highlight=False)


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _wall(summary) -> str:
    if not summary.finished:
        return "stalls"
    spread = (
        f" ({summary.wall_min_s:.0f}–{summary.wall_max_s:.0f})" if summary.wall_max_s - summary.wall_min_s >= 1 else ""
    )
    return f"{summary.wall_s:,.0f} s{spread}"


def prediction_table(rows: list[tuple[str, object]], title: str) -> Table:
    """One row per pacing (and the measured run): wall time, the trainer's busy share, expired rows per trained row,
    mean staleness, rows sampled per trained row, the last step's wait, the longest wait with nothing under way."""
    table = Table(title=title, title_justify="left")
    table.add_column("", no_wrap=True)
    for column in ("wall time", "busy", "expired", "staleness", "sampled/trained", "last step wait", "mutual wait"):
        table.add_column(column, justify="right", no_wrap=True)
    for label, r in rows:
        predicted = hasattr(r, "wall_min_s")
        table.add_row(
            label,
            _wall(r) if predicted else f"{r.span_s:,.0f} s",
            _pct(r.busy_share),
            _pct(r.expired_share),
            f"{r.mean_staleness:.2f}",
            f"{r.generated_per_trained:.2f}×",
            f"{r.last_step_wait_s:.1f} s",
            f"{r.longest_mutual_wait_s:.1f} s" if predicted else "—",
        )
    return table


def settings_line(spec) -> str:
    return (
        f"rollout workers {spec.rollout_workers}, annotate workers {spec.annotate_workers}, "
        f"flush_rows {spec.flush_rows}, batch_prompts {spec.batch_prompts}, max_buffer_samples "
        f"{spec.max_buffer_samples}, poll_seconds {spec.train_poll_s:g}"
        f"{' (a local store: its bells wake a waiting stage first)' if spec.bells else ''}, "
        f"publish_every {spec.publish_every}"
    )


@app.command("plan")
@user_errors
def plan_command(
    config: Path | None = typer.Option(
        None, "--config", help="A run configuration (YAML): batch, flush, buffer, polls."
    ),
    from_store: str | None = typer.Option(
        None, "--from-store", help="Measure the rates (and latencies) from this store's metrics."
    ),
    rollout_samples_per_s: float | None = typer.Option(None, "--rollout-samples-per-s", help="Per rollout worker."),
    annotate_samples_per_s: float | None = typer.Option(None, "--annotate-samples-per-s", help="Per annotate worker."),
    train_samples_per_s: float | None = typer.Option(None, "--train-samples-per-s", help="The trainer's compute."),
    rollout_tokens_per_s: float | None = typer.Option(None, "--rollout-tokens-per-s", help="Generated tokens/s."),
    annotate_tokens_per_s: float | None = typer.Option(None, "--annotate-tokens-per-s", help="Scored tokens/s."),
    train_tokens_per_s: float | None = typer.Option(
        None, "--train-tokens-per-s", help="Trained tokens/s (per GPU in the --gpus table)."
    ),
    prompt_tokens: int | None = typer.Option(None, "--prompt-tokens", min=0, help="Prompt tokens per sample."),
    response_tokens: int | None = typer.Option(None, "--response-tokens", min=1, help="Response tokens per sample."),
    cv: float = typer.Option(0.3, "--cv", min=0, help="Spread of the service times given by flags (std / mean)."),
    publish_latency: float | None = typer.Option(None, "--publish-latency", min=0, help="Seconds to write a version."),
    reload_latency: float | None = typer.Option(None, "--reload-latency", min=0, help="Seconds to load a version."),
    startup: float = typer.Option(0.0, "--startup", min=0, help="Seconds from launch to every stage ready."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Optimizer steps (train.max_steps)."),
    batch_samples: int | None = typer.Option(None, "--batch-samples", min=1, help="Samples per step."),
    rollout_workers: int | None = typer.Option(None, "--rollout-workers", min=1),
    annotate_workers: int | None = typer.Option(None, "--annotate-workers", min=1),
    cores: float | None = typer.Option(
        None,
        "--cores",
        min=0.1,
        help="CPU cores the stages share (else one each): the computing trainer keeps its cores (one; with "
        "--from-store, its measured CPU over its compute time) and the producers share the rest; with --from-store, "
        "each stage's measured CPU per row is what shares them.",
    ),
    seeds: int = typer.Option(3, "--seeds", min=1, help="Simulated runs averaged per prediction."),
    suggest_settings: bool = typer.Option(True, "--suggest/--no-suggest", help="Search for better settings."),
    gpus: str | None = typer.Option(None, "--gpus", help="Trainer GPU counts for the GPU table, e.g. 1,8,64."),
    sets: list[str] = SetOpt,
) -> None:
    """Predict wall time, trainer busy share, expired share and staleness for today's pacing and for admission by
    schedule; suggest settings; size rollout and annotate for an N-GPU trainer."""
    from opd_cache.config import load_config
    from opd_cache.flow.suggest import Target, predict, suggest

    gpu_counts = _gpu_counts(gpus)
    rates = {
        "rollout": (rollout_samples_per_s, rollout_tokens_per_s),
        "annotate": (annotate_samples_per_s, annotate_tokens_per_s),
        "train": (train_samples_per_s, train_tokens_per_s),
    }
    tokens = {"prompt": prompt_tokens, "response": response_tokens}
    any_rate = any(v is not None for pair in rates.values() for v in pair)
    if gpu_counts and not any_rate and from_store is None:
        _print_gpu_table(gpu_counts, config, sets, tokens, batch_samples, steps)
        return

    calibration = None
    if from_store is not None:
        config = config or run_config_of_store(from_store)
    cfg = load_config(config, sets=sets)
    measured = {}
    if from_store is not None:
        calibration = _calibrate(from_store, cfg, configured=config is not None, cores=cores)
        measured = {s: getattr(calibration.spec, s) for s in ("rollout", "annotate", "train")}
        if tokens["response"] is None:
            tokens["response"] = round(calibration.tokens_per_row) or None
    services = stage_services(rates, tokens, cv, measured)
    if batch_samples is not None:
        cfg.train.global_batch_tokens, cfg.train.global_batch_samples = None, batch_samples
    spec = calibration.spec if calibration is not None else spec_from_config(cfg, **services)
    changes = {k: v for k, v in services.items()}
    for name, value in (
        ("steps", steps),
        ("batch_samples", batch_samples),
        ("rollout_workers", rollout_workers),
        ("annotate_workers", annotate_workers),
        ("publish_latency_s", publish_latency),
        ("reload_latency_s", reload_latency),
        ("cores", cores),
    ):
        if value is not None:
            changes[name] = value
    spec = replace(spec, startup_s=startup, **changes)
    spec.check()

    count, schedule = predict(spec, "count", seeds), predict(spec, "schedule", seeds)
    rows = [("today's pacing (count)", count), ("admission by schedule", schedule)]
    if calibration is not None:
        rows.insert(0, ("measured (this store)", calibration.measured))
    title = f"opd plan: {spec.steps} steps × {spec.batch_samples} samples; predictions average {seeds} simulated runs"
    wide_console().print(prediction_table(rows, title))
    console.print(f"settings: {settings_line(spec)}", highlight=False, soft_wrap=True)
    for note in calibration.notes if calibration is not None else ():
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if suggest_settings:
        target = Target()
        found = suggest(spec, target=target, seeds=min(seeds, 2), publish_every=(2 * spec.publish_every,))
        verdict = "meets" if found.met else "misses"
        console.print(
            f"suggested (admission by schedule; {verdict} ≥ {target.busy_share:.0%} busy, ≤ "
            f"{target.expired_share:.0%} expired): {settings_line(found.spec)} → {_wall(found.summary)}, "
            f"busy {_pct(found.summary.busy_share)}, expired {_pct(found.summary.expired_share)} "
            f"[{found.reason}; {found.tried} candidates]",
            highlight=False,
            soft_wrap=True,
        )
    if gpu_counts:
        _print_gpu_table(gpu_counts, config, sets, tokens, batch_samples, steps, rates=rates)


def _gpu_counts(gpus: str | None) -> list[int]:
    if gpus is None:
        return []
    try:
        counts = [int(x) for x in gpus.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--gpus {gpus!r}: expected GPU counts separated by commas, e.g. 1,8,64") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--gpus {gpus!r}: expected GPU counts >= 1, e.g. 1,8,64")
    return counts


def _calibrate(store_uri: str, cfg, configured: bool, cores: float | None = None):
    """The store's measurements; without a run configuration, n and flush_rows are read from the shards too."""
    from opd_cache.flow.calibrate import calibrate
    from opd_cache.flow.simulate import Service
    from opd_cache.observe.metrics import read_metrics
    from opd_cache.storage.store import Store

    store = Store(store_uri)
    store.manifest.require()
    placeholder = Service(per_row=1.0)
    base = spec_from_config(cfg, placeholder, placeholder, placeholder)
    calibration = calibrate(read_metrics(store), base, where=f"--from-store {store_uri}", cores=cores)
    if configured:
        return calibration
    n = calibration.samples_per_prompt or base.n
    spec = replace(
        calibration.spec, n=n, flush_rows=calibration.shard_rows, batch_prompts=max(1, calibration.shard_rows // n)
    )
    note = (
        "no run configuration found (give --config): n and flush_rows read from the shards; max_buffer_samples, "
        "poll intervals and max_staleness are the defaults"
    )
    return replace(calibration, spec=spec, notes=(*calibration.notes, note))


def _print_gpu_table(counts, config, sets, tokens, batch_samples, steps, rates=None) -> None:
    """Rollout and annotate workers (one GPU each) per trainer size, at the paper rates or the given tokens/s."""
    from opd_cache.config import load_config
    from opd_cache.flow.simulate import Service
    from opd_cache.flow.suggest import PAPER_RATES, gpu_plan

    given = {stage: (rates or {}).get(stage, (None, None))[1] for stage in STAGE_RATE_FLAGS}
    gpu_rates = replace(
        PAPER_RATES,
        **{f"{stage}_tokens_per_s": v for stage, v in given.items() if v is not None},
        **{f"{k}_tokens": v for k, v in tokens.items() if v is not None},
    )
    cfg = load_config(config, sets=sets)
    if batch_samples is not None:
        cfg.train.global_batch_tokens, cfg.train.global_batch_samples = None, batch_samples
    placeholder = Service(per_row=1.0)
    base = spec_from_config(cfg, placeholder, placeholder, placeholder)
    # GPU workers span machines: their stages meet in an object store or a shared filesystem, where no bell rings
    # from one machine to another (storage/bells.py), so they wait their polls
    base = replace(base, steps=steps or base.steps, bells=False)
    source = "given" if any(v is not None for v in given.values()) else "assumed on paper (docs/flow-control.md)"
    table = Table(
        title=(
            f"GPU case ({source}): rollout {gpu_rates.rollout_tokens_per_s:,.0f} tok/s and annotate "
            f"{gpu_rates.annotate_tokens_per_s:,.0f} tok/s per worker GPU, train {gpu_rates.train_tokens_per_s:,.0f} "
            f"tok/s per GPU; {gpu_rates.prompt_tokens}+{gpu_rates.response_tokens} tokens per sample, "
            f"{base.batch_samples} samples per step, publish {gpu_rates.publish_latency_s:g} s + reload "
            f"{gpu_rates.reload_latency_s:g} s"
        ),
        title_justify="left",
    )
    for column in ("trainer GPUs", "rollout GPUs", "annotate GPUs", "publish_every", "step", "trainer busy", "expired"):
        table.add_column(column, justify="right")
    for i, n in enumerate(counts, 1):
        # a search of simulated runs per trainer size (seconds each): say which one a terminal is waiting on
        with console.status(f"sizing rollout and annotate for the trainer on {n} GPUs ({i} of {len(counts)})"):
            found = gpu_plan(gpu_rates, n, base)
        step_s = found.spec.train.mean(found.spec.batch_samples)
        table.add_row(
            str(n),
            str(found.spec.rollout_workers),
            str(found.spec.annotate_workers),
            str(found.spec.publish_every),
            f"{step_s:.2f} s",
            _pct(found.summary.busy_share) + ("" if found.met else " (target missed)"),
            _pct(found.summary.expired_share),
        )
    wide_console().print(table)
