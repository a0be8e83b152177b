"""`opd eval`: not built yet."""

from opd_cache.cli.common import app, not_implemented


@app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def evaluate_command() -> None:
    """Not implemented yet."""
    not_implemented("eval")
