"""The staleness bound: how many policy versions a row may lag behind the policy it trains or is scored for.

One rule for the three stages (docs/design.md §5). A row sampled with policy version `v` is too stale at version `V`
(the trainer's step version, or the newest published policy LATEST) when `V - v > max_staleness`:

- rollout pauses while the policy it loaded is too stale against LATEST (what it would sample expires);
- annotate skips a shard that is too stale against LATEST (the trainer can no longer use it);
- the trainer expires a shard that is too stale against the version of the step it would train in.

The bound is the top-level `max_staleness` of the configuration (its default: `DEFAULT_MAX_STALENESS` in
opd_cache/config.py), the one key for the three stages; the per-stage keys of earlier versions are refused,
naming it.
"""

from __future__ import annotations


def is_too_stale(version: int, latest: int, max_staleness: int | None) -> bool:
    """Data of policy `version` cannot be used at version `latest` (None: no bound, nothing is too stale)."""
    return max_staleness is not None and latest - version > max_staleness


def staleness_window(latest: int, max_staleness: int) -> tuple[int, int]:
    """The policy versions [low, high] whose data can still be used at version `latest`."""
    return max(latest - max_staleness, 0), latest
