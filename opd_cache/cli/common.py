"""What every command shares: the Typer app, the consoles, --set, one-line user errors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from opd_cache.config import Config
    from opd_cache.storage.store import Store

app = typer.Typer(
    name="opd",
    help="On-policy distillation with the teacher's outputs as a dataset: rollout -> annotate -> train.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

# --set: every stage command (through config_flags.py) and `opd demo`
SetOpt = typer.Option(None, "--set", help="Override any config key: --set train.lr=3e-4 (repeatable).")


def open_store(cfg: Config) -> Store:
    """The store a resolved config names (`store.uri`, `store.s3_endpoint`): what a stage command hands its stage."""
    from opd_cache.storage.store import Store

    return Store(cfg.store.uri, s3_endpoint=cfg.store.s3_endpoint)


def user_errors(fn: Callable) -> Callable:
    """Turn the errors a user can fix (bad flags, files, stores) into one red line and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from opd_cache.storage.store import StoreError

        try:
            return fn(*args, **kwargs)
        except (ValueError, StoreError, OSError) as e:
            # OSError: disk full, read-only or unreachable storage, missing files: the user's to fix.
            # Messages of other libraries may span lines; the user sees one.
            message = escape(" ".join(str(e).split()))  # escape: "[errno 30]" is not rich markup
            err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper
