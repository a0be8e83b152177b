"""`opd report`: plots and a markdown summary of a run, from its metrics files alone."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from opd_cache.cli.common import app, console, user_errors


@app.command("report")
@user_errors
def report_command(
    store: str = typer.Option(..., "--store", help="Store directory or URI."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default: <store>/../report)."),
) -> None:
    """Write PNG plots (loss, masses/overlap, accuracy, staleness, throughput) and report.md."""
    from opd_cache.report import write_report
    from opd_cache.store import Store

    s = Store(store)
    s.require_run()
    out = out or (Path(store).parent / "report" if "://" not in store else Path("opd-report"))
    summary = write_report(s, out)
    console.print(f"wrote {out / 'report.md'} and {len(summary['plots'])} plots: {', '.join(summary['plots'])}")
