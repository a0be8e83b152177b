"""`opd rollout`: not built yet."""

from opd_cache.cli.common import app, not_implemented


@app.command("rollout", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def rollout_command() -> None:
    """Not implemented yet."""
    not_implemented("rollout")
