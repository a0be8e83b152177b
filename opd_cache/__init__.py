"""opd_cache: on-policy distillation with the teacher's outputs as a dataset.

Packages: `rollout/`, `annotate/`, `train/` (the three stages), `storage/` (the store and its files), `flow/`
(staleness and pacing), `losses/`, `tasks/`, `observe/` (metrics, trackers, progress, report), `launch/`
(`opd run`, Ray, `opd demo`), `cli/`; core modules beside them (docs/design.md §1).

`opd_cache.RolloutWriter` (opd_cache/rollout/writer.py) is the public API for producers that write rollouts
themselves (docs/agents.md); it is imported on first use, so `import opd_cache` stays light.
"""

from opd_cache import _moved

__version__ = "0.1.0"

_moved.install()  # old flat import paths (opd_cache.store, ...) still work for one release, with a warning


def __getattr__(name: str):
    if name == "RolloutWriter":
        from opd_cache.rollout.writer import RolloutWriter

        return RolloutWriter
    raise AttributeError(f"module 'opd_cache' has no attribute {name!r}")
