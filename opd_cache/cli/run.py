"""`opd run` (all stages on one store, supervised) and `opd demo` (the CPU demo)."""

from __future__ import annotations

from pathlib import Path

import typer

from opd_cache.cli.common import SetOpt, app, err_console, open_store, user_errors
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
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the store's run, finished or of another config (e.g. to a higher --train-max-steps).",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Delete the store's run (and its stage logs) and start afresh."
    ),
    *,
    args: ConfigArgs,
) -> None:
    """Start rollout, annotate, train and an evaluator as processes on one store, until training finishes.

    A store that holds a finished run, or a run of another config, is refused unless --resume or --overwrite
    says what to do with it (README, "Other commands"); an unfinished run of the same config is continued.
    """
    from opd_cache.launch.attach import check_logs_folder, check_store_run, overwrite_run, record_run_config
    from opd_cache.launch.run import supervise, sync_overrides, write_resolved_config

    if launcher not in ("local", "ray"):
        raise ValueError(f"--launcher {launcher!r}: use local or ray")
    if address is not None:
        args.flags["ray.address"] = address
    cfg = args.resolve(adjust=lambda cfg: sync_overrides(cfg) if cfg.run.sync else cfg)
    logs = logs or default_logs_dir(cfg.store.uri)
    store = open_store(cfg)
    check_logs_folder(logs, cfg)  # another store's logs are never overwritten
    found = check_store_run(store, cfg, resume=resume, overwrite=overwrite)
    if found.message:
        err_console.print(found.message, highlight=False, soft_wrap=True)
    if found.action == "overwrite":
        overwrite_run(store, logs)
    elif store.is_done():  # --resume of a finished run: the stages must not stop at its old DONE
        store.clear_done()
    resolved = write_resolved_config(cfg, logs / "config.yaml")
    record_run_config(store, cfg)
    err_console.print(f"opd run: store {store.uri}, logs {logs}", highlight=False, soft_wrap=True)
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
