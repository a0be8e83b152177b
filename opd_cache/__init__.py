"""opd_cache: on-policy distillation with the teacher's outputs as a dataset.

Packages: `rollout/`, `annotate/`, `train/` (the three stages), `storage/` (the store and its files), `flow/`
(staleness and pacing), `losses/`, `tasks/`, `observe/` (metrics, trackers, progress, report), `launch/`
(`opd run`, Ray, `opd demo`), `cli/`; core modules beside them (docs/design.md §1).
"""

from opd_cache import _moved

__version__ = "0.1.0"

_moved.install()  # old flat import paths (opd_cache.store, ...) still work for one release, with a warning
