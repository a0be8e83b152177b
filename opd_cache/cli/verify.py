"""`opd verify STORE`: check every stored file against its checksum; exit status 1 when any is damaged."""

from __future__ import annotations

import json

import typer
from rich.markup import escape

from opd_cache.cli.common import app, console, err_console, user_errors


@app.command("verify")
@user_errors
def verify_command(
    store: str = typer.Argument(
        ...,
        metavar="STORE",
        help="Store directory or URI (s3://bucket/prefix: set AWS_ENDPOINT_URL for S3-compatible servers).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check every rollout shard, annotated part, policy version and resume state against its checksum.

    Prints each damaged or missing file with the reason, what quarantine/ holds, and a summary
    (ok / corrupt / missing / without checksum). Exit status 0 when nothing is damaged, 1 otherwise.
    """
    from opd_cache.storage.integrity import verify_store
    from opd_cache.storage.store import Store

    s = Store(store)
    s.manifest.require()
    checked = 0

    def progress(rel: str) -> None:
        nonlocal checked
        checked += 1
        if checked % 100 == 0 and err_console.is_terminal:
            err_console.print(f"checked {checked} files ...", highlight=False)

    report = verify_store(s, on_file=progress)
    if as_json:
        console.print_json(json.dumps(report.to_dict()))
    else:
        for rel, status, reason in report.problems:
            console.print(f"[bold red]{status}[/] {escape(rel)}: {escape(reason)}", highlight=False, soft_wrap=True)
        for name, reason in sorted(report.quarantined.items()):
            console.print(f"[yellow]quarantined[/] {escape(name)}: {escape(reason)}", highlight=False, soft_wrap=True)
        console.print(
            f"{s.path('')}: {report.ok} ok, {report.count('corrupt')} corrupt, {report.count('missing')} "
            f"missing, {report.unchecked} without checksum (written before checksums); "
            f"{len(report.quarantined)} in quarantine/",
            highlight=False,
            soft_wrap=True,
        )
    if report.damaged:
        raise typer.Exit(1)
