"""`opd annotate`: score rollout shards with a teacher and publish its top-k log-probs (opd_cache/annotate/)."""

from __future__ import annotations

from opd_cache.cli.common import app, console, err_console, open_store, user_errors
from opd_cache.cli.config_flags import ConfigArgs, config_flags


@app.command("annotate")
@user_errors
@config_flags("annotate", sections=("store", "annotate"), own_section="annotate", top_level=("max_staleness",))
def annotate_command(args: ConfigArgs) -> None:
    """Annotate rollout shards with a teacher's top-k log-probs (one part per shard and teacher)."""
    from opd_cache.annotate import run_annotate

    cfg = args.resolve()
    # progress on stderr: a bar on a terminal, else a plain line every ~10 s (the log files of `opd run`)
    stats = run_annotate(cfg, open_store(cfg), console=err_console)
    console.print(
        f"annotated {len(stats.annotated)} shards ({stats.rows} rows, {stats.tokens} tokens, "
        f"{stats.tokens_per_second:,.0f} tokens/s) with teacher {cfg.annotate.teacher_name}; "
        f"skipped {len(stats.skipped_stale)} stale, quarantined {len(stats.quarantined)}",
        highlight=False,
        soft_wrap=True,
    )
