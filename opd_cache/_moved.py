"""Old import paths of the modules that moved into packages (release 0.2), kept working for one release.

`import opd_cache.store` (or `from opd_cache import store`) still works and returns the module at its new home,
`opd_cache.storage.store`, with a DeprecationWarning naming the new path. The aliases go in the next release;
docs/design.md §1 lists where each module lives now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old name -> package it moved into (opd_cache.<old> is now opd_cache.<package>.<old>)
MOVED = {
    **dict.fromkeys(
        (
            "store",
            "filestore",
            "layout",
            "manifest",
            "listing",
            "integrity",
            "retention",
            "schema",
            "columns",
            "codec",
            "quantize",
        ),
        "storage",
    ),
    **dict.fromkeys(("run", "ray_launcher", "ray_actor", "demo", "demo_assets"), "launch"),
    **dict.fromkeys(("metrics", "tracking", "progress", "report"), "observe"),
    **dict.fromkeys(("staleness", "demand"), "flow"),
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new_name: str):
        self.new_name = new_name

    def create_module(self, spec):
        return importlib.import_module(self.new_name)  # the module itself: one object under both names

    def exec_module(self, module) -> None:
        pass  # already executed under its new name


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != "opd_cache" or old not in MOVED:
            return None
        new_name = f"opd_cache.{MOVED[old]}.{old}"
        warnings.warn(
            f"{fullname} moved to {new_name}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new_name))


def install() -> None:
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
