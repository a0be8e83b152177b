"""`opd run` (all stages on one store, supervised) and `opd demo` (the CPU demo)."""

from __future__ import annotations

from pathlib import Path

import typer

from opd_cache.cli.common import SetOpt, app, user_errors
from opd_cache.cli.config_flags import ConfigArgs, config_flags


def default_logs_dir(store_uri: str) -> Path:
    return Path(store_uri).parent / "logs" if "://" not in store_uri else Path("opd-logs")


@app.command("run")
@user_errors
@config_flags(
    "run",
    sections=("store", "rollout", "annotate", "train", "eval", "run", "ray"),
    own_section="run",
    top_level=("max_staleness",),
)
def run_command(
    logs: Path | None = typer.Option(None, "--logs", help="Folder for the stages' logs and the resolved config."),
    quiet: bool = typer.Option(
        False, "--quiet", help="No live dashboard (on a terminal) or progress lines (otherwise: one every ~10 s)."
    ),
    launcher: str = typer.Option("local", "--launcher", help="local (processes here) or ray (docs/scale-out.md)."),
    address: str | None = typer.Option(None, "--address", help="Ray cluster to join (--launcher ray; ray.address)."),
    *,
    args: ConfigArgs,
) -> None:
    """Start rollout, annotate, train and an evaluator as processes on one store, until training finishes."""
    from opd_cache.launch.run import supervise, sync_overrides, write_resolved_config

    if launcher not in ("local", "ray"):
        raise ValueError(f"--launcher {launcher!r}: use local or ray")
    if address is not None:
        args.flags["ray.address"] = address
    cfg = args.resolve(adjust=lambda cfg: sync_overrides(cfg) if cfg.run.sync else cfg)
    logs = logs or default_logs_dir(cfg.store.uri)
    resolved = write_resolved_config(cfg, logs / "config.yaml")
    if launcher == "ray":
        from opd_cache.launch.ray_launcher import supervise_ray

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
    engine: str = typer.Option(
        "hf", "--engine", help="Engine for rollout and annotate: hf, or vllm (needs vLLM; docs/engines.md)."
    ),
    sets: list[str] | None = SetOpt,
) -> None:
    """On-policy distillation on the synthetic arithmetic task, on the CPU, in minutes."""
    from opd_cache.launch.demo import run_demo

    summary = run_demo(out, seed=seed, sets=sets or [], quiet=quiet, overwrite=overwrite, engine=engine)
    raise typer.Exit(0 if summary["passed"] else 1)
