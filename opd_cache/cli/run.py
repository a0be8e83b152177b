"""`opd run` (all stages on one store, supervised) and `opd demo` (the CPU demo)."""

from __future__ import annotations

from pathlib import Path

import typer

from opd_cache.cli.common import ConfigOpt, SetOpt, app, stage_config, user_errors


def default_logs_dir(store_uri: str) -> Path:
    return Path(store_uri).parent / "logs" if "://" not in store_uri else Path("opd-logs")


@app.command("run")
@user_errors
def run_command(
    store: str | None = typer.Option(
        None, "--store", help="Store directory or URI (default: store.uri of the config)."
    ),
    sync: bool = typer.Option(False, "--sync", help="Lockstep generate -> annotate -> train (max_staleness 0)."),
    logs: Path | None = typer.Option(None, "--logs", help="Folder for the stages' logs and the resolved config."),
    quiet: bool = typer.Option(
        False, "--quiet", help="No live dashboard (on a terminal) or progress lines (otherwise: one every ~10 s)."
    ),
    launcher: str = typer.Option("local", "--launcher", help="local (processes here) or ray (docs/scale-out.md)."),
    address: str | None = typer.Option(None, "--address", help="Ray cluster to join (--launcher ray; ray.address)."),
    config: Path | None = ConfigOpt,
    sets: list[str] | None = SetOpt,
) -> None:
    """Start rollout, annotate, train and an evaluator as processes on one store, until training finishes."""
    from opd_cache.run import supervise, sync_overrides, write_resolved_config

    if launcher not in ("local", "ray"):
        raise ValueError(f"--launcher {launcher!r}: use local or ray")
    cfg = stage_config(config, sets, **{"store.uri": store, "run.sync": sync or None, "ray.address": address})
    if cfg.run.sync:
        cfg = sync_overrides(cfg)
    logs = logs or default_logs_dir(cfg.store.uri)
    resolved = write_resolved_config(cfg, logs / "config.yaml")
    if launcher == "ray":
        from opd_cache.ray_launcher import supervise_ray

        raise typer.Exit(supervise_ray(cfg, resolved, logs, quiet=quiet))
    raise typer.Exit(supervise(cfg, resolved, logs, quiet=quiet))


@app.command("demo")
@user_errors
def demo_command(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Run directory (store, logs, plots, summary.json)."),
    seed: int = typer.Option(0, "--seed"),
    quiet: bool = typer.Option(False, "--quiet", help="No live dashboard or progress lines."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the previous demo in --out (its store, logs, plots and summary.json)."
    ),
    sets: list[str] | None = SetOpt,
) -> None:
    """On-policy distillation on the synthetic arithmetic task, on the CPU, in minutes."""
    from opd_cache.demo import run_demo

    summary = run_demo(out, seed=seed, sets=sets or [], quiet=quiet, overwrite=overwrite)
    raise typer.Exit(0 if summary["passed"] else 1)
