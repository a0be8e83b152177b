"""Stage flags generated from the typed config: every key of the sections a command reads is one of its flags.

    max_staleness                 opd rollout --max-staleness        a top-level key the command reads
    rollout.flush_rows            opd rollout --flush-rows           a key of the command's own section
    rollout.sampling.top_p        opd rollout --sampling-top-p       (dots and underscores become dashes)
    store.s3_endpoint             opd rollout --store-s3-endpoint    a key of another section keeps the section
    train.lr                      opd run --train-lr

The help of a flag is the key's `description` in opd_cache/config.py, so adding a key there adds its flag.
FLAG_ALIASES keeps the short flags the commands had before they were generated (`--store`, `--temperature`).
A command with a store section also takes the store as its first argument (`opd train STORE`, STORE_ARGUMENT).
`opd COMMAND --print-config` prints the config the flags resolve to.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import typer
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from opd_cache.cli.common import SetOpt
from opd_cache.config import Config, load_config, parse_set

# Per command: config key -> more names of its flag (click declarations; " /--sample" is one more off switch).
FLAG_ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "rollout": {
        "store.uri": ("--store",),
        "rollout.sampling.temperature": ("--temperature",),
        "rollout.sampling.top_p": ("--top-p",),
        "rollout.sampling.max_new_tokens": ("--max-new-tokens",),
    },
    "annotate": {"store.uri": ("--store",)},
    "train": {"store.uri": ("--store",)},
    "replay": {"store.uri": ("--store",)},
    "run": {"store.uri": ("--store",)},
    "eval": {"eval.greedy": (" /--sample",)},
}


@dataclass(frozen=True)
class ConfigFlag:
    key: str  # dotted config key, e.g. rollout.sampling.top_p
    parameter: inspect.Parameter  # what typer sees: the option, its help and type
    from_yaml: bool  # lists, tuples and mappings: the flag's text is parsed as YAML, as --set does

    def value(self, given: Any) -> Any:
        return parse_set(f"{self.key}={given}")[1] if self.from_yaml else given


def config_keys(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf key below a section, nested sections (rollout.sampling) flattened into dotted keys."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from config_keys(field.annotation, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}", field


def flag_name(key: str, own_section: str) -> str:
    path = key.removeprefix(f"{own_section}.")
    return "--" + path.replace(".", "-").replace("_", "-")


def command_line_type(annotation: Any) -> tuple[type, tuple[str, ...] | None, bool]:
    """(type typer parses, the Literal's choices, parse as YAML) of a config annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        [annotation] = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if annotation in (bool, int, float, str):
        return annotation, None, False
    if typing.get_origin(annotation) is Literal:
        return str, tuple(typing.get_args(annotation)), False  # the config's own check names the choices
    return str, None, True


def default_text(default: Any) -> str:
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, (list, tuple, dict)):
        return str(list(default) if isinstance(default, tuple) else default)
    return str(default)


def config_flag(key: str, field: FieldInfo, command: str, own_section: str) -> ConfigFlag:
    kind, choices, from_yaml = command_line_type(field.annotation)
    name = flag_name(key, own_section)
    decls = (f"{name}/--no-{name[2:]}",) if kind is bool else (name,)
    decls += FLAG_ALIASES.get(command, {}).get(key, ())
    help_text = (field.description or key).rstrip(".")
    if choices:
        help_text += f"; one of {', '.join(choices)}"
    if from_yaml:
        help_text += "; a YAML value, as --set takes"
    if field.default is not None:
        help_text += f" (default {default_text(field.default)})"
    panel = f"{key.split('.')[0]} config keys" if "." in key else "top-level config keys"
    option = typer.Option(None, *decls, help=help_text, show_default=False, rich_help_panel=panel)
    python_name = "cfg__" + key.replace(".", "__")  # typer passes the value in as this keyword
    parameter = inspect.Parameter(python_name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind | None)
    return ConfigFlag(key, parameter, from_yaml)


def option_names(parameter: inspect.Parameter) -> set[str]:
    decls = getattr(parameter.default, "param_decls", None) or ()
    return {name.strip() for decl in decls for name in decl.split("/") if name.strip()}


# Options every stage command gets besides its config-key flags (`opd demo` takes --set alone: common.SetOpt).
CONFIG_OPTIONS = [
    inspect.Parameter(
        "config_file",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, "--config", help="YAML file with store/rollout/annotate/train/... sections."),
        annotation=Path | None,
    ),
    inspect.Parameter("sets", inspect.Parameter.KEYWORD_ONLY, default=SetOpt, annotation=list[str] | None),
    inspect.Parameter(
        "print_only",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(
            False,
            "--print-config",
            help="Print the resolved configuration (defaults < --config < flags < --set), exit.",
        ),
        annotation=bool,
    ),
]


# The store as the first argument of every command with a store section (`opd train runs/x/store`), as `opd
# inspect`, `verify`, `export` and `report` take it; `--store` (the store.uri flag) names it too, for old scripts.
STORE_ARGUMENT = inspect.Parameter(
    "store_argument",
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    default=typer.Argument(
        None, metavar="STORE", show_default=False, help="The run's store: a directory or URI (store.uri; or --store)."
    ),
    annotation=str | None,
)


@dataclass
class ConfigArgs:
    """What a stage command was given for its config: --config, its config-key flags, --set, --print-config."""

    file: Path | None
    flags: dict[str, Any]  # dotted key -> value, only the flags given (the config file's value stays otherwise)
    sets: list[str]
    print_only: bool
    own_section: str

    def resolve(self, adjust: Callable[[Config], Config] | None = None) -> Config:
        """defaults < --config < flags < --set; with --print-config, print it as YAML (a valid --config) and exit.

        Then the command's own model folders (its section's `student` / `teacher`) are checked, so a missing local
        folder is one clear line before any tokenizer or model loads, in every command the same way.
        """
        flag_names = {key: flag_name(key, self.own_section) for key in self.flags}  # to name them in an error
        cfg = load_config(self.file, overrides=self.flags, sets=self.sets, flag_names=flag_names)
        if adjust is not None:
            cfg = adjust(cfg)
        if self.print_only:
            print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
            raise typer.Exit(0)
        section = getattr(cfg, self.own_section)
        for key in ("student", "teacher"):
            if getattr(section, key, None) is not None:
                from opd_cache.models import check_model_path  # torch: only for the commands that load a model

                check_model_path(getattr(section, key), f"--{key}")
        return cfg


def config_flags(
    command: str,
    sections: tuple[str, ...],
    own_section: str,
    exclude: tuple[str, ...] = (),
    top_level: tuple[str, ...] = (),
) -> Callable:
    """Give a command --config, --set, --print-config and a flag for every key of `sections` (but `exclude`) and
    for the `top_level` keys it reads (`max_staleness`: `--max-staleness`).

    The command takes its own options and `args: ConfigArgs`; `args.resolve()` builds the config.
    """

    def decorate(command_fn: Callable) -> Callable:
        signature = inspect.signature(command_fn)
        own = [p for p in signature.parameters.values() if p.name != "args"]
        generated = [config_flag(key, Config.model_fields[key], command, own_section) for key in top_level]
        generated += [
            config_flag(key, field, command, own_section)
            for section in sections
            for key, field in config_keys(Config.model_fields[section].annotation, section)
            if key not in exclude
        ]
        taken = {name: parameter.name for parameter in own + CONFIG_OPTIONS for name in option_names(parameter)}
        for flag in generated:
            for name in option_names(flag.parameter):
                if name in taken:  # a programming error: fail at import, in every test
                    raise TypeError(f"opd {command}: {name} would set both {flag.key} and {taken[name]}")
                taken[name] = flag.key

        store_argument = [STORE_ARGUMENT] if "store" in sections else []  # `opd train STORE`, as inspect/verify

        @functools.wraps(command_fn)
        def with_config_flags(*, config_file, sets, print_only, **kwargs):
            flags = {}
            for flag in generated:
                given = kwargs.pop(flag.parameter.name)
                if given is not None:
                    flags[flag.key] = flag.value(given)
            positional = kwargs.pop(STORE_ARGUMENT.name, None)
            if positional is not None:
                if flags.get("store.uri", positional) != positional:
                    raise ValueError(
                        f"STORE {positional} and --store {flags['store.uri']} name two stores: give one of them"
                    )
                flags["store.uri"] = positional
            args = ConfigArgs(config_file, flags, list(sets or []), print_only, own_section)
            return command_fn(**kwargs, args=args)

        parameters = store_argument + own + CONFIG_OPTIONS + [flag.parameter for flag in generated]
        with_config_flags.__signature__ = signature.replace(parameters=parameters)
        return with_config_flags

    return decorate
