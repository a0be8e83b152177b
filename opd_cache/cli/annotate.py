"""`opd annotate`: not built yet."""

from opd_cache.cli.common import app, not_implemented


@app.command("annotate", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def annotate_command() -> None:
    """Not implemented yet."""
    not_implemented("annotate")
