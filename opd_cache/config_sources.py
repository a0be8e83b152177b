"""Where each configuration value came from (--config, a flag, --set), and the one-line errors that name it.

config.py builds the configuration; this module has no opd_cache imports, so it stays below everything.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    """A configuration the user must fix; the message says which key and what was expected."""


def parse_set(assignment: str) -> tuple[str, Any]:
    """`train.lr=3e-4` -> ("train.lr", 0.0003); the value is parsed as YAML (numbers, bools, lists)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected dotted.key=value, e.g. --set train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def leaf_keys(tree: dict, prefix: tuple[str, ...] = ()):
    """Every leaf key of a nested mapping, as a tuple of names (an empty mapping is a leaf)."""
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            yield from leaf_keys(value, (*prefix, str(name)))
        else:
            yield (*prefix, str(name))


KeySources = list[tuple[tuple[str, ...], str, bool]]  # (key, where it was given, is it a command-line flag)


def key_sources(path, file_keys, overrides, sets, flag_names) -> KeySources:
    """Where each given key came from, the one that wins first: --set (the last one first), flags, --config."""
    sources: KeySources = []
    for assignment in reversed(sets or []):
        key, _ = parse_set(assignment)
        sources.append((tuple(key.split(".")), f"--set {assignment}", False))
    for key, value in (overrides or {}).items():
        if value is not None:
            sources.append((tuple(key.split(".")), (flag_names or {}).get(key, f"the flag of {key}"), True))
    sources += [(key, f"--config {path}", False) for key in file_keys]
    return sources


def _given_by(sources: KeySources, loc: tuple[str, ...], message: str, section: bool) -> list[str]:
    """Where a reported key was given: the winning source of the key (or of a key above it: --set
    train.report_to=[...] for train.report_to.0); for a section's own check (loc is the section), the winning
    sources of the keys its message names, unless the message names them already (its flags)."""
    if not section:
        winning = [where for key, where, _ in sources if loc[: len(key)] == key or key[: len(loc)] == loc]
        return winning[:1]
    winning: dict[tuple[str, ...], str] = {}
    for key, where, _ in sources:
        if key[: len(loc)] == loc and len(key) > len(loc) and re.search(rf"\b{re.escape(key[-1])}\b", message):
            winning.setdefault(key, where)
    return [where for where in dict.fromkeys(winning.values()) if where not in message]


def format_validation_error(error: ValidationError, sources: KeySources | None = None) -> str:
    """One line: each problem with its key, its value, what was expected, and where the value was given."""
    lines = []
    for item in error.errors():
        loc = tuple(str(p) for p in item["loc"])
        key = ".".join(loc) or "(config)"
        value = item.get("input")
        section_check = item["type"] == "value_error" and isinstance(value, dict)
        given = _given_by(sources or [], loc, item["msg"], section=section_check)
        origin = f"from {' and '.join(given)}" if given else ""
        if item["type"] == "extra_forbidden":
            lines.append(
                f"unknown config key {key!r} (value {value!r}{', ' + origin if origin else ''}); "
                f"check the spelling against `docs/configuration.md`"
            )
        elif section_check:
            # a section's own check (model validator): its message names the keys; the section's dict adds nothing
            lines.append(f"{key}: {item['msg'].removeprefix('Value error, ')}" + (f" ({origin})" if origin else ""))
        else:
            lines.append(f"config key {key!r} = {value!r}" + (f" ({origin})" if origin else "") + f": {item['msg']}")
    return "invalid configuration: " + "; ".join(lines)
