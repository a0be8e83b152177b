"""The `opd` command line: a thin Typer layer over the stage modules.

Each command lives in its own module of this package and registers itself on
`app`; the stage logic lives in `opd_cache/` so it can be used without the CLI.
"""

from opd_cache.cli import (  # noqa: F401  (register commands)
    annotate,
    check_engines,  # noqa: F401  (registers `opd check-engines`)
    evaluate,
    export,  # noqa: F401,E402  (registers `opd export`)
    inspect,
    migrate,  # noqa: F401,E402  (registers `opd migrate`)
    replay,  # noqa: F401,E402  (registers `opd replay`)
    report,
    rollout,
    run,
    scale,  # noqa: F401  (registers `opd scale`)
    train,
    verify,  # noqa: F401  (register `opd verify`)
)
from opd_cache.cli.common import app


def main() -> None:
    app()
