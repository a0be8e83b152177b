"""`opd train`: train the student on annotated shards (single process, or under torchrun).

opd train --store runs/demo --max-steps 200 --lr 2e-3
torchrun --nproc_per_node 2 -m opd_cache.cli train --store runs/demo ...
"""

from __future__ import annotations

from pathlib import Path

import typer

from opd_cache.cli.common import ConfigOpt, SetOpt, app, console, stage_config, user_errors


@app.command("train")
@user_errors
def train_command(
    store: str | None = typer.Option(None, "--store", help="Store directory or URI (s3://bucket/prefix)."),
    student: str | None = typer.Option(None, "--student", help="Student model (version 0); default: run.json's."),
    loss: str | None = typer.Option(None, "--loss", help="forward_kl | reverse_kl | jsd | k2 | k3 | abs | pg"),
    tail: str | None = typer.Option(None, "--tail", help="bucket | renorm | none"),
    support: str | None = typer.Option(None, "--support", help="teacher | union"),
    beta: float | None = typer.Option(None, "--beta", help="JSD mixture weight (0 = forward KL, 1 = reverse KL)."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Optimizer steps to train in total."),
    max_staleness: int | None = typer.Option(
        None, "--max-staleness", help="Versions a row may lag behind the student (0 = synchronous)."
    ),
    publish_every: int | None = typer.Option(None, "--publish-every", help="Publish a policy version every N steps."),
    global_batch_samples: int | None = typer.Option(None, "--global-batch-samples", help="Rows per optimizer step."),
    global_batch_tokens: int | None = typer.Option(
        None, "--global-batch-tokens", help="Prompt+response tokens per optimizer step."
    ),
    micro_batch_tokens: int | None = typer.Option(
        None, "--micro-batch-tokens", help="Padded tokens per micro-batch and rank."
    ),
    lr: float | None = typer.Option(None, "--lr", help="Peak learning rate."),
    follow: bool | None = typer.Option(
        None, "--follow/--no-follow", help="Wait for new shards until --max-steps (else train what is there)."
    ),
    config: Path | None = ConfigOpt,
    sets: list[str] | None = SetOpt,
) -> None:
    """Train the student on annotated shards; publish policy versions; resume from the last state."""
    if global_batch_samples is not None and global_batch_tokens is not None:
        raise ValueError("--global-batch-samples and --global-batch-tokens: give only one of them")
    cfg = stage_config(
        config,
        sets,
        **{
            "store.uri": store,
            "train.student": student,
            "train.loss": loss,
            "train.tail": tail,
            "train.support": support,
            "train.beta": beta,
            "train.max_steps": max_steps,
            "train.max_staleness": max_staleness,
            "train.publish_every": publish_every,
            "train.global_batch_samples": global_batch_samples,
            "train.global_batch_tokens": global_batch_tokens,
            "train.micro_batch_tokens": micro_batch_tokens,
            "train.lr": lr,
            "train.follow": follow,
        },
    )
    from opd_cache.models import check_model_path
    from opd_cache.train import train

    check_model_path(cfg.train.student, "--student")  # before the hub client sees a missing folder
    train(cfg, console=console)
