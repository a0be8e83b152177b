"""What every command shares: the Typer app, the consoles, --set, the STORE argument, one-line user errors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

if TYPE_CHECKING:
    from opd_cache.config import Config
    from opd_cache.storage.store import Store


class OpdCommand(TyperCommand):
    """Plain help text (click's layout, not Rich's boxes): every flag's full name at any width (at 80 columns a
    long name goes on its own line, its help below it), and the options in sections: the command's own, then the
    generated config flags one section per config section (`rich_help_panel`, config_flags.py)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        """click's usage line, `opd verify [OPTIONS] STORE`, not typer's `{store}`: an argument by its metavar (its
        name in capitals), in brackets when it may be left out."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                continue
            name = param.metavar or (param.name or "").upper()
            if param.nargs != 1 and not name.endswith("..."):
                name += "..."
            pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            default = "Arguments" if param.param_type_name == "argument" else "Options"
            sections.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(record)
        for title in sorted(sections, key=lambda t: (t != "Arguments", t != "Options")):  # stable otherwise
            with formatter.section(title[0].upper() + title[1:]):
                formatter.write_dl(sections[title])


class OpdTyper(typer.Typer):
    """The `opd` app: every command gets OpdCommand's help layout."""

    def command(self, *args, cls: type[TyperCommand] | None = None, **kwargs):
        return super().command(*args, cls=cls or OpdCommand, **kwargs)


def _version(value: bool) -> None:
    if value:
        from opd_cache import __version__

        print(f"opd {__version__}")
        raise typer.Exit(0)


app = OpdTyper(
    name="opd",
    help="On-policy distillation with the teacher's outputs as a dataset: rollout -> annotate -> train.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help and usage errors: readable at 80 columns and in a log
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _opd(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the opd version and exit."
    ),
) -> None:
    """On-policy distillation with the teacher's outputs as a dataset: rollout -> annotate -> train."""


def _console(stderr: bool = False) -> Console:
    """A Rich console; in a log or a pipe (no terminal) lines are not wrapped at Rich's default 80 columns."""
    out = Console(stderr=stderr)
    if not out.is_terminal:
        out.soft_wrap = True
    return out


console = _console()
err_console = _console(stderr=True)

# --set: every stage command (through config_flags.py) and `opd demo`
SetOpt = typer.Option(
    None, "--set", metavar="KEY=VALUE", help="Override any config key: --set train.lr=3e-4 (repeatable)."
)


# The store is the first argument of every command (`opd report STORE`, `opd scale STORE`, as inspect, verify and
# export); `--store` still names it, hidden from the help, so that scripts written before keep working.
STORE_HELP = "Store directory or URI (s3://bucket/prefix)."
StoreAliasOpt = typer.Option(None, "--store", hidden=True, help="The same as STORE (the older spelling).")


def store_arg(help: str = STORE_HELP):
    return typer.Argument(None, metavar="STORE", show_default=False, help=help)


def one_store(command: str, positional: str | None, option: str | None) -> str:
    """The store a command was given as STORE or as --store: one of them, and one store."""
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"STORE {positional} and --store {option} name two stores: give one of them")
    store = positional if positional is not None else option
    if store is None:
        raise ValueError(f"opd {command} needs a store: opd {command} STORE")
    return store


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
