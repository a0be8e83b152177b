"""The `opd` command line: a thin Typer layer over the stage modules.

Each command lives in its own module of this package and registers itself on `app` when imported; the stage
logic lives in `opd_cache/` so it can be used without the CLI. The stage commands' flags are generated from
the typed config (config_flags.py).
"""

from opd_cache.cli import (  # noqa: F401  (importing a command's module registers it)
    annotate,
    check_engines,
    evaluate,
    export,
    ingest,
    inspect,
    migrate,
    plan,  # `opd plan`: the pipeline simulated (opd_cache/flow/simulate.py)
    replay,
    report,
    rollout,
    run,
    scale,  # noqa: F401  (registers `opd scale`)
    train,
    verify,
)
from opd_cache.cli.common import app
from opd_cache.launch.heap import keep_freed_memory


def main() -> None:
    keep_freed_memory()  # every stage reuses its step's memory instead of faulting it in again (launch/heap.py)
    app(prog_name="opd")  # also as `python -m opd_cache.cli` (torchrun's entry point): the usage lines say `opd`
