"""`opd ingest STORE FILE...`: rollouts from another producer (JSONL) into rollout shards."""

from __future__ import annotations

import typer
from rich.markup import escape

from opd_cache.cli.common import StoreAliasOpt, app, console, err_console, user_errors


@app.command("ingest")
@user_errors
def ingest_command(
    paths: list[str] = typer.Argument(
        ...,
        metavar="STORE FILE...",
        help="Store directory or URI to write rollout shards into, then JSONL files, one row per line "
        "(shapes: docs/agents.md).",
    ),
    store_option: str | None = StoreAliasOpt,
    student: str | None = typer.Option(
        None, "--student", help="Student model folder (its tokenizer and chat template); default: run.json's."
    ),
    policy_version: int | None = typer.Option(
        None, "--policy-version", min=0, help="Policy version that sampled the rows (rows may carry their own)."
    ),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip (and count) bad rows instead of stopping."),
    worker_id: str = typer.Option("ingest", "--worker-id", help="Writer id in shard names; one per concurrent ingest."),
    chat_template: str | None = typer.Option(
        None, "--chat-template", help="Jinja chat template file (default: the student tokenizer's own)."
    ),
    tools: str | None = typer.Option(
        None, "--tools", help="Comma-separated tool names rows may call when they carry no 'tools' list."
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=1, help="Longest row, prompt + response (default: the tokenizer's model_max_length)."
    ),
    temperature: float = typer.Option(
        1.0, "--temperature", min=1e-6, help="Temperature of the behavior log-probs computed for rows without them."
    ),
    flush_rows: int = typer.Option(256, "--flush-rows", min=1, help="Rows per shard."),
    device: str = typer.Option("cpu", "--device", help="Device of the forward pass that computes log-probs."),
) -> None:
    """Convert JSONL rollouts (OpenAI messages with tool calls, token ids, TRL or verl dumps) into rollout shards.

    Every row is checked before anything is written; a bad row stops the ingest with one line naming its file
    and line, or is skipped and counted with --skip-bad. Rows without behavior log-probs get them from a forward
    pass of the student at the row's policy version. The shards are those `opd rollout` writes.
    """
    from opd_cache.rollout.ingest import IngestOptions, ingest
    from opd_cache.storage.store import Store

    # `opd ingest STORE FILE...`, as every command names its store first; with --store (older scripts) every
    # argument is a file
    store, files = (store_option, paths) if store_option is not None else (paths[0], paths[1:])
    if not files:
        raise ValueError("opd ingest needs a store and at least one file: opd ingest STORE FILE...")

    options = IngestOptions(
        policy_version=policy_version,
        skip_bad=skip_bad,
        worker_id=worker_id,
        chat_template=chat_template,
        tools=[t.strip() for t in tools.split(",") if t.strip()] if tools is not None else None,
        max_tokens=max_tokens,
        temperature=temperature,
        flush_rows=flush_rows,
        device=device,
    )
    result = ingest(
        list(files),
        Store(store),
        options,
        student=student,
        say=lambda message: err_console.print(escape(message), highlight=False, soft_wrap=True),
    )
    console.print(
        f"ingested {result.rows} rows into {len(result.shards)} shards ({result.computed} with computed "
        f"behavior log-probs), skipped {result.skipped} bad rows",
        highlight=False,
        soft_wrap=True,
    )
