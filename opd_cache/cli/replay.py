"""`opd replay --from SRC [--from SRC2 ...] --store DST`: train a new student on existing annotations."""

from __future__ import annotations

from pathlib import Path

import typer

from opd_cache.cli.common import ConfigOpt, SetOpt, app, console, stage_config, user_errors


@app.command("replay")
@user_errors
def replay_command(
    sources: list[str] = typer.Option(..., "--from", help="A store whose annotated shards to train on (repeatable)."),
    store: str | None = typer.Option(None, "--store", help="The replay's own store (new, or a replay to resume)."),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the selected rows."),
    seed: int = typer.Option(0, "--seed", help="Seed of the shard and row order."),
    shuffle: bool = typer.Option(True, "--shuffle/--no-shuffle", help="Shuffle shards and rows per epoch."),
    min_version: int | None = typer.Option(None, "--min-version", help="Only shards of policy version >= this."),
    max_version: int | None = typer.Option(None, "--max-version", help="Only shards of policy version <= this."),
    teacher: list[str] | None = typer.Option(None, "--teacher", help="Only this teacher's annotations (repeatable)."),
    data_source: list[str] | None = typer.Option(
        None, "--data-source", help="Only rows of this data source (repeatable)."
    ),
    student: str | None = typer.Option(None, "--student", help="Student to train (default: the first source's)."),
    loss: str | None = typer.Option(None, "--loss", help="forward_kl | reverse_kl | jsd | k2 | k3 | abs"),
    max_steps: int | None = typer.Option(
        None, "--max-steps", help="Stop after this many optimizer steps (default: what --epochs need)."
    ),
    global_batch_samples: int | None = typer.Option(None, "--global-batch-samples", help="Rows per optimizer step."),
    lr: float | None = typer.Option(None, "--lr", help="Peak learning rate."),
    publish_every: int | None = typer.Option(None, "--publish-every", help="Publish a policy version every N steps."),
    config: Path | None = ConfigOpt,
    sets: list[str] | None = SetOpt,
) -> None:
    """Train on the annotated shards of existing stores, which are only read: no rollout, no teacher.

    Off-policy for the new student, so no staleness bound; the run (policy versions, resume states, ledger)
    is written to --store and resumes from its last state when run again with the same selection.
    """
    from opd_cache.models import check_model_path
    from opd_cache.train.replay import ReplaySpec, replay

    if store is None:
        raise ValueError("opd replay needs --store DST: the replay's own store")
    from opd_cache.config import TrainConfig

    # No step limit anywhere (flag, --set, config file): the replay runs every epoch, as many steps as they need.
    steps_from_epochs = (
        max_steps is None
        and stage_config(config, sets).train.max_steps == TrainConfig().max_steps
        and not any(s.startswith("train.max_steps=") for s in sets or [])
    )
    cfg = stage_config(
        config,
        sets,
        **{
            "store.uri": store,
            "train.student": student,
            "train.loss": loss,
            "train.max_steps": max_steps,
            "train.global_batch_samples": global_batch_samples,
            "train.lr": lr,
            "train.publish_every": publish_every,
        },
    )
    check_model_path(cfg.train.student, "--student")
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
    replay(cfg, spec, console=console, steps_from_epochs=steps_from_epochs)
