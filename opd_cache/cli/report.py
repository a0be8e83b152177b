"""`opd report`: plots and a markdown summary of a run, from its metrics files alone."""

from __future__ import annotations

from pathlib import Path

import typer

from opd_cache.cli.common import StoreAliasOpt, app, console, one_store, store_arg, user_errors


def default_report_dir(store: str) -> Path:
    """`plots/` beside the store, where `opd demo` writes its plots (runs/demo/store → runs/demo/plots)."""
    if "://" in store:
        return Path("plots")  # a remote store: the current folder
    return Path(store.rstrip("/")).parent / "plots"


@app.command("report")
@user_errors
def report_command(
    store: str | None = store_arg(),
    store_option: str | None = StoreAliasOpt,
    out: Path | None = typer.Option(
        None, "--out", help="Output folder (default: plots/ beside the store, as opd demo; ./plots for a remote store)."
    ),
) -> None:
    """Write PNG plots (loss, masses/overlap, accuracy, staleness, throughput) and report.md."""
    from opd_cache.observe.report import summary_lines, write_report
    from opd_cache.storage.store import Store

    store = one_store("report", store, store_option)
    s = Store(store)
    s.manifest.require()
    out = out or default_report_dir(store)
    summary = write_report(s, out)
    for line in summary_lines(summary):
        console.print(line, highlight=False, soft_wrap=True)
    for r in summary["eval"][-1:]:
        kl = "" if r["kl"] is None else f", KL {r['kl']:.4g}"
        console.print(
            f"- latest eval (v{r['version']}): strict {r['strict']:.3f}, lenient {r['lenient']:.3f}{kl}",
            highlight=False,
        )
    console.print(
        f"wrote {out / 'report.md'} and {len(summary['plots'])} plots: {', '.join(summary['plots'])}",
        highlight=False,
        soft_wrap=True,
    )
