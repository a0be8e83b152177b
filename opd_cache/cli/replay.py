"""`opd replay DST --from SRC [--from SRC2 ...]`: train a new student on existing annotations."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from opd_cache.cli.common import app, console, err_console, open_store, user_errors
from opd_cache.cli.config_flags import ConfigArgs, config_flags
from opd_cache.config import Config


@app.command("replay")
@user_errors
# train.seed: --seed here is the replay's own (the order of shards and rows); --set train.seed=N seeds the trainer
@config_flags("replay", sections=("store", "train"), own_section="train", exclude=("train.seed",))
def replay_command(
    sources: list[str] = typer.Option(
        ..., "--from", metavar="STORE", help="A store whose annotated shards to train on (repeatable)."
    ),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the selected rows."),
    seed: int = typer.Option(0, "--seed", help="Seed of the shard and row order."),
    shuffle: bool = typer.Option(True, "--shuffle/--no-shuffle", help="Shuffle shards and rows per epoch."),
    min_version: int | None = typer.Option(None, "--min-version", help="Only shards of policy version >= this."),
    max_version: int | None = typer.Option(None, "--max-version", help="Only shards of policy version <= this."),
    teacher: list[str] | None = typer.Option(
        None, "--teacher", metavar="NAME", help="Only this teacher's annotations (repeatable)."
    ),
    data_source: list[str] | None = typer.Option(
        None, "--data-source", metavar="NAME", help="Only rows of this data source (repeatable)."
    ),
    skip_damaged: bool = typer.Option(
        False, "--skip-damaged", help="Leave damaged source shards out (counted) instead of stopping."
    ),
    *,
    args: ConfigArgs,
) -> None:
    """Train on the annotated shards of existing stores, which are only read: no rollout, no teacher.

    Off-policy for the new student, so no staleness bound; the run (policy versions, resume states, ledger)
    is written to STORE (or --store) and resumes from its last state when run again with the same selection. Without
    --max-steps (or train.max_steps in --config or --set) it trains as many steps as the epochs need.
    """
    from opd_cache.config import TrainConfig, load_config
    from opd_cache.train.replay import ReplaySpec, run_replay

    if "store.uri" not in args.flags:
        raise ValueError("opd replay needs its own store: opd replay STORE --from SOURCE (or --store STORE)")
    cfg = args.resolve(adjust=lambda c: _source_lr_unless_given(c, args, sources[0]))
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
        skip_damaged=skip_damaged,
    )
    run_replay(cfg, open_store(cfg), spec, console=console, steps_from_epochs=steps_from_epochs)


def _source_lr_unless_given(cfg: Config, args: ConfigArgs, source: str) -> Config:
    """Without --lr (or train.lr in --config or --set) a replay trains at its source run's learning rate, not at
    the trainer's default, which suits another model size."""
    from opd_cache.train.replay import source_lr

    in_file = args.file is not None and "lr" in ((yaml.safe_load(Path(args.file).read_text()) or {}).get("train") or {})
    if "train.lr" in args.flags or in_file or any(s.split("=", 1)[0].strip() == "train.lr" for s in args.sets):
        return cfg
    lr = source_lr(source)
    if lr is not None:
        cfg.train.lr = lr
        err_console.print(f"lr {lr:g}: the learning rate of the run in {source} (--lr sets another)", highlight=False)
    return cfg
