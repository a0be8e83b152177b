"""The `opd` command line: a thin Typer layer over the stage modules.

Each command lives in its own module of this package and registers itself on
`app`; the stage logic lives in `opd_cache/` so it can be used without the CLI.
"""

from opd_cache.cli.common import app
from opd_cache.cli import annotate, evaluate, inspect, report, rollout, run, train  # noqa: F401  (register commands)
from opd_cache.cli import verify  # noqa: F401  (register `opd verify`)
from opd_cache.cli import check_engines  # noqa: F401  (registers `opd check-engines`)
from opd_cache.cli import migrate  # noqa: F401,E402  (registers `opd migrate`)
from opd_cache.cli import export  # noqa: F401,E402  (registers `opd export`)
from opd_cache.cli import replay  # noqa: F401,E402  (registers `opd replay`)


def main() -> None:
    app()
