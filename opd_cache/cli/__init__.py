"""The `opd` command line: a thin Typer layer over the stage modules.

Each command lives in its own module of this package and registers itself on
`app`; the stage logic lives in `opd_cache/` so it can be used without the CLI.
"""

from opd_cache.cli.common import app
from opd_cache.cli import annotate, evaluate, inspect, report, rollout, run, train  # noqa: F401  (register commands)


def main() -> None:
    app()
