"""`opd scale`: change the number of rollout / annotate workers of a running `opd run --launcher ray`."""

from __future__ import annotations

import typer

from opd_cache.cli.common import StoreAliasOpt, app, console, one_store, store_arg, user_errors


@app.command("scale")
@user_errors
def scale_command(
    store: str | None = store_arg("The run's store directory or URI."),
    rollout: int | None = typer.Option(
        None, "--rollout-workers", min=1, help="Rollout workers wanted (as opd run --rollout-workers)."
    ),
    annotate: int | None = typer.Option(
        None, "--annotate-workers", min=1, help="Annotate workers wanted, per teacher (as opd run --annotate-workers)."
    ),
    s3_endpoint: str | None = typer.Option(None, "--s3-endpoint", help="S3-compatible server (store.s3_endpoint)."),
    # the names before the worker counts were named as `opd run` names them, for old scripts
    store_option: str | None = StoreAliasOpt,
    rollout_alias: int | None = typer.Option(None, "--rollout", min=1, hidden=True),
    annotate_alias: int | None = typer.Option(None, "--annotate", min=1, hidden=True),
) -> None:
    """Write the wanted worker counts to the store; the Ray launcher adds or removes workers within seconds."""
    from opd_cache.launch.ray_launcher import SCALE_FILE
    from opd_cache.storage.layout import TRAIN_DONE
    from opd_cache.storage.store import Store

    store = one_store("scale", store, store_option)
    rollout = rollout if rollout is not None else rollout_alias
    annotate = annotate if annotate is not None else annotate_alias
    if rollout is None and annotate is None:
        raise ValueError("opd scale: give --rollout-workers N and/or --annotate-workers N")
    target = Store(store, s3_endpoint=s3_endpoint)
    target.manifest.require()  # a run's store, not a typo
    if target.is_done():  # no launcher reads scale.json any more: the change would be silently ignored
        raise ValueError(
            f"opd scale: the run in {target.path('')} is finished ({target.path(TRAIN_DONE)} exists); "
            f"nothing changed (worker counts apply to a running `opd run --launcher ray`)"
        )
    desired = dict(target.read_json(SCALE_FILE, default={}) or {})
    desired.update({k: v for k, v in (("rollout", rollout), ("annotate", annotate)) if v is not None})
    target.write_json(SCALE_FILE, desired)
    console.print(f"{target.path(SCALE_FILE)}: {desired}", highlight=False, soft_wrap=True)
