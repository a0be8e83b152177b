"""`opd export STORE --to DIR`: the teacher cache as parquet or Arrow tables, one per teacher."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from opd_cache.cli.common import app, console, err_console, user_errors
from opd_cache.observe.progress import Every, duration


@app.command("export")
@user_errors
def export_command(
    store: str = typer.Argument(..., metavar="STORE", help="Store directory or URI with annotated shards."),
    to: str = typer.Option(..., "--to", help="Output folder (path or URI); must be new or empty."),
    fmt: str = typer.Option("parquet", "--format", help="parquet (zstd) or arrow (an Arrow IPC stream per teacher)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier `opd export` in --to."),
    tokenizer_path: str | None = typer.Option(
        None, "--tokenizer", help="Local tokenizer folder to decode text (default: the run's student)."
    ),
    no_text: bool = typer.Option(False, "--no-text", help="Skip decoding: prompt/response text columns stay null."),
    teacher: list[str] | None = typer.Option(None, "--teacher", help="Export only this teacher (repeatable)."),
    skip_damaged: bool = typer.Option(
        False, "--skip-damaged", help="Leave damaged shards and parts out (counted) instead of stopping."
    ),
) -> None:
    """Join every rollout shard with its teachers' parts and write one table per teacher under --to.

    Columns: sample_id, shard_id, policy_version, prompt_index, sample_index, data_source, ground_truth,
    finish_reason, prompt, response (decoded text), prompt_ids, response_ids, behavior_logprobs,
    teacher_token_logprob, teacher_topk_ids, teacher_topk_logprobs. Read them with
    datasets.load_dataset("parquet", data_files="DIR/<teacher>.parquet"), polars or duckdb.
    """
    from opd_cache.export import export_store
    from opd_cache.storage.store import Store

    if no_text and tokenizer_path is not None:
        raise ValueError(
            "--tokenizer and --no-text contradict each other: --tokenizer decodes text, --no-text skips it"
        )
    source = Store(store)
    plain = Every() if not err_console.is_terminal else None
    columns = [
        TextColumn("[bold]export[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("shards"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=err_console, disable=plain is not None) as progress:
        task = progress.add_task("export", total=None)

        def on_shard(done: int, total: int, shard_id: str) -> None:
            progress.update(task, completed=done, total=total)
            if plain is not None and (plain.due() or done == total):
                err_console.print(f"export: {done}/{total} shards ({shard_id})", highlight=False)

        result = export_store(
            source,
            to,
            fmt=fmt,
            overwrite=overwrite,
            tokenizer_path=tokenizer_path,
            text=not no_text,
            teachers=teacher or None,
            on_shard=on_shard,
            skip_damaged=skip_damaged,
        )
    for name, totals in result.teachers.items():
        console.print(
            f"{result.files[name]}: {totals.rows} rows, {totals.tokens} response tokens, "
            f"top-{totals.top_k} ({totals.topk_logprob_dtype} in the store)"
            + (
                f"; {totals.shards_without_part} rollout shards not annotated by {name}, left out"
                if totals.shards_without_part
                else ""
            ),
            highlight=False,
            soft_wrap=True,
        )
    console.print(
        f"exported {result.shards} shards in {duration(result.seconds)} to {result.to}", highlight=False, soft_wrap=True
    )
    if result.damaged:
        n = len(result.damaged)
        console.print(
            f"skipped {n} damaged shard part{'s' if n != 1 else ''} (--skip-damaged): {', '.join(result.damaged)}; "
            f"`opd verify {store}` says what is wrong with each",
            highlight=False,
            soft_wrap=True,
        )
