"""`opd replay --from SRC [--from SRC2 ...] --store DST`: train a new student on existing annotations."""

from __future__ import annotations

import typer

from opd_cache.cli.common import app, console, open_store, user_errors
from opd_cache.cli.config_flags import ConfigArgs, config_flags


@app.command("replay")
@user_errors
# train.seed: --seed here is the replay's own (the order of shards and rows); --set train.seed=N seeds the trainer
@config_flags("replay", sections=("store", "train"), own_section="train", exclude=("train.seed",))
def replay_command(
    sources: list[str] = typer.Option(..., "--from", help="A store whose annotated shards to train on (repeatable)."),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the selected rows."),
    seed: int = typer.Option(0, "--seed", help="Seed of the shard and row order."),
    shuffle: bool = typer.Option(True, "--shuffle/--no-shuffle", help="Shuffle shards and rows per epoch."),
    min_version: int | None = typer.Option(None, "--min-version", help="Only shards of policy version >= this."),
    max_version: int | None = typer.Option(None, "--max-version", help="Only shards of policy version <= this."),
    teacher: list[str] | None = typer.Option(None, "--teacher", help="Only this teacher's annotations (repeatable)."),
    data_source: list[str] | None = typer.Option(
        None, "--data-source", help="Only rows of this data source (repeatable)."
    ),
    *,
    args: ConfigArgs,
) -> None:
    """Train on the annotated shards of existing stores, which are only read: no rollout, no teacher.

    Off-policy for the new student, so no staleness bound; the run (policy versions, resume states, ledger)
    is written to --store and resumes from its last state when run again with the same selection. Without
    --max-steps (or train.max_steps in --config or --set) it trains as many steps as the epochs need.
    """
    from opd_cache.config import TrainConfig, load_config
    from opd_cache.train.replay import ReplaySpec, run_replay

    if "store.uri" not in args.flags:
        raise ValueError("opd replay needs --store DST: the replay's own store")
    cfg = args.resolve()
    # No step limit anywhere (flag, --set, config file): the replay runs every epoch, as many steps as they need.
    steps_from_epochs = (
        "train.max_steps" not in args.flags
        and load_config(args.file).train.max_steps == TrainConfig().max_steps
        and not any(s.startswith("train.max_steps=") for s in args.sets)
    )
    spec = ReplaySpec(
        sources=list(sources),
        epochs=epochs,
        seed=seed,
        shuffle=shuffle,
        min_version=min_version,
        max_version=max_version,
        teachers=list(teacher) if teacher else None,
        data_sources=list(data_source) if data_source else None,
    )
    run_replay(cfg, open_store(cfg), spec, console=console, steps_from_epochs=steps_from_epochs)
