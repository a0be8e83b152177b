"""`opd annotate`: score rollout shards with a teacher and publish its top-k log-probs (opd_cache/annotate.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from opd_cache.cli.common import ConfigOpt, SetOpt, app, console, stage_config, user_errors


@app.command("annotate")
@user_errors
def annotate_command(
    store: str | None = typer.Option(None, "--store", help="Store directory or URI (s3://bucket/prefix)."),
    teacher: str | None = typer.Option(None, "--teacher", help="Teacher checkpoint folder or hub id."),
    teacher_name: str | None = typer.Option(
        None, "--teacher-name", help="Name of its parts: annotated/<shard>/<NAME>.arrow."
    ),
    top_k: int | None = typer.Option(None, "--top-k", help="Teacher log-probs kept per response token (default 32)."),
    dtype: str | None = typer.Option(None, "--dtype", help="Storage dtype of the top-k log-probs: float16 or float32."),
    max_tokens_per_batch: int | None = typer.Option(
        None, "--max-tokens-per-batch", help="Padded tokens per forward pass (hf engine)."
    ),
    max_shards: int | None = typer.Option(None, "--max-shards", help="Stop after annotating this many shards."),
    worker_index: int | None = typer.Option(None, "--worker-index", help="This worker's index i in 0..n-1."),
    num_workers: int | None = typer.Option(
        None, "--num-workers", help="Workers n sharing the shards (stable hash of the shard id)."
    ),
    engine: str | None = typer.Option(None, "--engine", help="Scoring engine: hf (default) or vllm."),
    follow: bool = typer.Option(
        False, "--follow", help="Keep annotating new shards until the trainer's train/DONE marker."
    ),
    config: Path | None = ConfigOpt,
    sets: list[str] | None = SetOpt,
) -> None:
    """Annotate rollout shards with a teacher's top-k log-probs (one part per shard and teacher)."""
    from opd_cache.annotate import annotate
    from opd_cache.models import check_model_path
    from opd_cache.store import Store

    cfg = stage_config(
        config,
        sets,
        **{
            "store.uri": store,
            "annotate.teacher": teacher,
            "annotate.teacher_name": teacher_name,
            "annotate.top_k": top_k,
            "annotate.dtype": dtype,
            "annotate.max_tokens_per_batch": max_tokens_per_batch,
            "annotate.max_shards": max_shards,
            "annotate.worker_index": worker_index,
            "annotate.num_workers": num_workers,
            "annotate.engine": engine,
            "annotate.follow": True if follow else None,  # absent flag: keep the config file's value
        },
    )
    check_model_path(cfg.annotate.teacher, "--teacher")  # before the hub client sees a missing folder
    stats = annotate(Store(cfg.store.uri, s3_endpoint=cfg.store.s3_endpoint), cfg.annotate)
    console.print(
        f"annotated {len(stats.annotated)} shards ({stats.rows} rows, {stats.tokens} tokens, "
        f"{stats.tokens_per_second:,.0f} tokens/s) with teacher {cfg.annotate.teacher_name}; "
        f"skipped {len(stats.skipped_stale)} stale, quarantined {len(stats.quarantined)}",
        highlight=False,
        soft_wrap=True,
    )
