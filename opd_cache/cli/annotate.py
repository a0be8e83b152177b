"""`opd annotate`: score rollout shards with a teacher and publish its top-k log-probs (opd_cache/annotate.py)."""

from __future__ import annotations

from opd_cache.cli.common import app, console, user_errors
from opd_cache.cli.config_flags import ConfigArgs, config_flags


@app.command("annotate")
@user_errors
@config_flags("annotate", sections=("store", "annotate"), own_section="annotate")
def annotate_command(args: ConfigArgs) -> None:
    """Annotate rollout shards with a teacher's top-k log-probs (one part per shard and teacher)."""
    from opd_cache.annotate import annotate
    from opd_cache.storage.store import Store

    cfg = args.resolve()
    stats = annotate(Store(cfg.store.uri, s3_endpoint=cfg.store.s3_endpoint), cfg.annotate)
    console.print(
        f"annotated {len(stats.annotated)} shards ({stats.rows} rows, {stats.tokens} tokens, "
        f"{stats.tokens_per_second:,.0f} tokens/s) with teacher {cfg.annotate.teacher_name}; "
        f"skipped {len(stats.skipped_stale)} stale, quarantined {len(stats.quarantined)}",
        highlight=False,
        soft_wrap=True,
    )
