"""`opd rollout`: sample student responses to prompts and publish them as rollout shards."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import typer

from opd_cache.cli.common import ConfigOpt, SetOpt, app, console, stage_config, user_errors


@app.command("rollout")
@user_errors
def rollout_command(
    store: str | None = typer.Option(None, "--store", help="Store directory or URI (s3://bucket/prefix)."),
    student: str | None = typer.Option(None, "--student", help="Student model folder or hub id (policy version 0)."),
    prompts: str | None = typer.Option(None, "--prompts", help="Prompt file: parquet, JSONL or a datasets folder."),
    n: int | None = typer.Option(None, "--n", help="Samples per prompt (default 4)."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="Response length limit (default 256)."),
    temperature: float | None = typer.Option(None, "--temperature", help="Sampling temperature (default 1.0)."),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling mass (default 1.0)."),
    flush_rows: int | None = typer.Option(None, "--flush-rows", help="Publish a shard every N rows (default 256)."),
    flush_seconds: float | None = typer.Option(None, "--flush-seconds", help="...or every S seconds (default 60)."),
    max_samples: int | None = typer.Option(None, "--max-samples", help="Stop when this worker has N rows in all."),
    max_shards: int | None = typer.Option(None, "--max-shards", help="Stop when this worker has N shards in all."),
    worker_id: str | None = typer.Option(None, "--worker-id", help="Worker name in shard ids (default w00)."),
    engine: str | None = typer.Option(None, "--engine", help="hf (default, CPU or GPU) or vllm."),
    follow: bool | None = typer.Option(None, "--follow/--no-follow", help="Run until the trainer's DONE marker."),
    truncate_prompts: bool | None = typer.Option(
        None, "--truncate-prompts/--no-truncate-prompts", help="Skip (and count) over-long prompts instead of failing."
    ),
    max_prompt_tokens: int | None = typer.Option(
        None, "--max-prompt-tokens", help="Prompt length limit (default 1024)."
    ),
    student_topk: int | None = typer.Option(
        None, "--student-topk", help="Record the student's top-k ids per token (union support)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the prompt order and of sampling (default 0)."),
    config: Path | None = ConfigOpt,
    sets: list[str] | None = SetOpt,
) -> None:
    """Sample student responses to prompts and publish them as rollout shards."""
    from opd_cache.models import check_model_path
    from opd_cache.rollout import run_rollout
    from opd_cache.store import Store
    from opd_cache.tasks.prompts import check_prompts_path

    cfg = stage_config(
        config,
        sets,
        **{
            "store.uri": store,
            "rollout.student": student,
            "rollout.prompts": prompts,
            "rollout.n": n,
            "rollout.sampling.max_new_tokens": max_new_tokens,
            "rollout.sampling.temperature": temperature,
            "rollout.sampling.top_p": top_p,
            "rollout.flush_rows": flush_rows,
            "rollout.flush_seconds": flush_seconds,
            "rollout.max_samples": max_samples,
            "rollout.max_shards": max_shards,
            "rollout.worker_id": worker_id,
            "rollout.engine": engine,
            "rollout.follow": follow,
            "rollout.truncate_prompts": truncate_prompts,
            "rollout.max_prompt_tokens": max_prompt_tokens,
            "rollout.student_topk": student_topk,
            "rollout.seed": seed,
        },
    )
    if store is None and cfg.store.uri == "store" and config is None:
        raise ValueError("--store is required (a directory or URI for the run's shared storage)")
    # missing local inputs: one clear line before the tokenizer, the prompts or the model load
    check_model_path(cfg.rollout.student, "--student")
    if cfg.rollout.prompts is not None:
        check_prompts_path(cfg.rollout.prompts)

    # SIGINT/SIGTERM: finish the current batch, flush what is buffered, exit. A second signal aborts.
    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        console.print(f"{signal.Signals(signum).name}: flushing buffered rows, then stopping", highlight=False)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = run_rollout(
            cfg.rollout, Store(cfg.store.uri, s3_endpoint=cfg.store.s3_endpoint), stop=stop, show_progress=True
        )
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

    skipped = (
        f"; skipped {result.skipped_prompts} prompts over {cfg.rollout.max_prompt_tokens} tokens"
        if result.skipped_prompts
        else ""
    )
    rate = result.tokens / result.generate_seconds if result.generate_seconds else 0.0
    console.print(
        f"rollout {cfg.rollout.worker_id}: wrote {len(result.shards)} shards, {result.samples} samples, "
        f"{result.tokens} tokens ({rate:.0f} tok/s sampling) at policy v{result.policy_version}; "
        f"{result.total_samples} samples in all, prompt cursor {result.cursor}{skipped}",
        highlight=False,
    )
