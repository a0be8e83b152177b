"""`opd run`: not built yet."""

from opd_cache.cli.common import app, not_implemented


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_command() -> None:
    """Not implemented yet."""
    not_implemented("run")


@app.command("demo", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def demo_command() -> None:
    """Not implemented yet."""
    not_implemented("demo")
