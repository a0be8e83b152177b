"""The trainer's known schedule, and admission by schedule (issue #25, DESIGN.md §9).

The version of every optimizer step is known in advance. With the anchor (step s_a, version a), P =
`publish_every` and S = `max_staleness`, step s trains at version

    V(s) = a + ⌊(s − 1 − s_a) / P⌋

and a row sampled with version v can be trained only at steps with V(s) ≤ v + S, the last of which is

    s_max(v) = s_a + (v + S − a + 1)·P.

The trainer takes B rows per step, oldest version first, so through step s_max(v) it trains
B·min(s_max(v), max_steps) rows in all. Hence **the admission rule**: a producer may add k rows at version v only
while

    trained + pending(≤ v) + k ≤ B·min(s_max(v), max_steps)

where `trained` counts every row the trainer has handed to a step so far (whatever its version: each took a slot
of a step ≤ s_max(v) or is past it) and `pending(≤ v)` the rows at versions ≤ v that exist or are being made and
that the trainer is not done with yet: published (scored or not), in a worker's buffer or batch; rows of versions
the next step can no longer train are left out (they are dead: they will expire, they take no slot), and so are
quarantined ones. Every row beyond the bound expires whatever the timing; a row within it is trained provided it
is scored before the trainer passes s_max(v) — the latency that `opd plan` (flow/simulate.py) sizes.

Two differences from DESIGN.md §9's first statement ("cumulative rows at versions ≤ v, consumed ones included,
stay below B·s_max(v)"): expired rows leave the count (counted, they would keep their slot for ever, and after
any expiry the last steps would wait on rows nobody may make), and the trained count is every trained row, not
only those at versions ≤ v (a newer row trained first still used up a slot before s_max(v)).

Where the schedule lives: in `train/progress.json`, under the key "schedule" (`TrainSchedule.to_json`). The
trainer writes progress after each step and while it waits for data, atomically, and rollout and annotate read it
on every poll already; one object keeps the counters and the anchor of one snapshot together (two files could be
read half-updated), costs no extra request per poll on an object store, and old readers ignore the key.
`opd run` announces the static part before it starts the stages (as it announces the demand today), so a
producer never runs unpaced while the trainer loads its model. The stage-side reader is `read_schedule(store)`:
None without a schedule (a trainer older than #25, or a token budget per step before its first batch), and the
stages then pace as before (rollout/pacing.py).

Token budgets (`global_batch_tokens`): the rule assumes a fixed number of rows per step. With a token budget the
trainer publishes its measured mean rows per step (`rows_per_step`), and the producers admit by that estimate:
no longer exact (a run of long rows takes fewer rows per step than the mean, and the rows beyond expire), and
before the first batch nothing is known, so nothing is admitted by schedule (`open_slots` is None).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from opd_cache.storage import layout

SCHEDULE_KEY = "schedule"  # its key in train/progress.json
SCHEDULE_FORMAT = 1  # bumped when a field changes meaning; a reader refuses a newer one


class ScheduleError(ValueError):
    """A schedule that cannot be used; the message names the field."""


@dataclass(frozen=True)
class TrainSchedule:
    """What the trainer will do, and where its stream is: everything a producer needs to apply the rule.

    The counters are one snapshot of the trainer's stream (which plans batches ahead of the optimizer, in a
    prefetch thread): `assembled_steps` global batches are complete, `partial_rows` rows are in the one being
    assembled, `trained_samples` rows were handed to steps in all. `done_rows` holds, per version the next step
    can still train (`oldest_live_version` and newer), the rows the trainer is done with: trained, routed to no
    teacher, expired or lost.
    """

    max_steps: int
    publish_every: int = 1
    max_staleness: int = 2
    batch_samples: int | None = 64  # B; None with a token budget per step
    batch_tokens: int | None = None
    anchor_step: int = 0
    anchor_version: int = 0
    step: int = 0  # optimizer steps done (the stream may be ahead: assembled_steps)
    assembled_steps: int = 0
    partial_rows: int = 0
    trained_samples: int = 0
    rows_per_step: float | None = None  # token budgets: the measured mean rows per step (None: no step yet)
    done_rows: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.max_steps < 0:
            raise ScheduleError(f"schedule max_steps {self.max_steps}: must be >= 0")
        if self.publish_every < 1:
            raise ScheduleError(f"schedule publish_every {self.publish_every}: must be >= 1")
        if self.max_staleness < 0:
            raise ScheduleError(f"schedule max_staleness {self.max_staleness}: must be >= 0")
        if (self.batch_samples is None) == (self.batch_tokens is None):
            raise ScheduleError("schedule: exactly one of batch_samples and batch_tokens must be set")
        if self.batch_samples is not None and self.batch_samples < 1:
            raise ScheduleError(f"schedule batch_samples {self.batch_samples}: must be >= 1")

    # ------------------------------------------------------------ the step ↔ version arithmetic
    def version_of_step(self, step: int) -> int:
        """V(s): the policy version optimizer step `step` (1-based) trains at."""
        return self.anchor_version + (step - 1 - self.anchor_step) // self.publish_every

    def last_step_for_version(self, version: int) -> int:
        """s_max(v): the last step that may train a row of `version` (V(s) ≤ v + S), not capped by max_steps."""
        return self.anchor_step + (version + self.max_staleness - self.anchor_version + 1) * self.publish_every

    def deadline_step(self, version: int) -> int:
        """The step by which rows of `version` must be trained: s_max(v), or the run's last step if sooner."""
        return min(self.last_step_for_version(version), self.max_steps)

    @property
    def next_step(self) -> int:
        """The step the stream assembles next (the one with `partial_rows`)."""
        return self.assembled_steps + 1

    @property
    def oldest_live_version(self) -> int:
        """The oldest version the next step can still train: rows of older versions will expire."""
        return self.version_of_step(self.next_step) - self.max_staleness

    def deadline_passed(self, version: int) -> bool:
        """Rows of `version` can no longer be trained (annotate skips them as expired, without scoring them)."""
        return self.next_step > self.deadline_step(version)

    # ------------------------------------------------------------ the admission rule
    @property
    def batch_rows(self) -> float | None:
        """B: rows per step (the measured mean with a token budget; None before its first batch)."""
        return self.batch_samples if self.batch_samples is not None else self.rows_per_step

    def admissible_rows(self, version: int) -> float | None:
        """B·min(s_max(v), max_steps): the rows the trainer trains in all through the last step that can use
        rows of `version` (None: unknown, a token budget before the first batch)."""
        rows = self.batch_rows
        return None if rows is None else rows * self.deadline_step(version)

    def open_slots(self, version: int) -> int | None:
        """Rows the trainer will still take at steps that can train `version`: B·min(s_max(v), max_steps) less
        what it has handed out (≥ 0; None: unknown)."""
        rows = self.batch_rows
        if rows is None:
            return None
        if self.batch_samples is not None:
            return max(0, self.batch_samples * self.deadline_step(version) - self.trained_samples)
        # a token budget: whole steps at the estimated rows per step, less the batch in assembly
        steps_left = self.deadline_step(version) - self.assembled_steps
        return max(0, math.floor(rows * steps_left) - self.partial_rows)

    def pending_at_or_below(
        self, version: int, published: Mapping[int, int], in_flight: Mapping[int, int] | None = None
    ) -> int:
        """pending(≤ v): rows of live versions ≤ `version`, published (`published`: version -> rows, quarantined
        shards left out) or in flight (a worker's buffer or batch), less those the trainer is done with."""
        in_flight = in_flight or {}
        total = 0
        for v in range(self.oldest_live_version, version + 1):
            # ≥ 0 per version: a quarantined shard's trained rows are in done_rows but not in `published`
            total += max(0, published.get(v, 0) + in_flight.get(v, 0) - self.done_rows.get(v, 0))
        return total

    def allowance(self, version: int, pending_at_or_below: int) -> int | None:
        """How many more rows may be made at `version` (≥ 0; None: unknown, no admission by schedule)."""
        slots = self.open_slots(version)
        return None if slots is None else max(0, slots - pending_at_or_below)

    def may_emit(self, version: int, pending_at_or_below: int, rows: int = 1) -> bool:
        """The rule: `rows` more rows of `version` will all be trainable by count. True when unknown (the stages
        then pace by `max_buffer_samples` alone, as before #25)."""
        allowed = self.allowance(version, pending_at_or_below)
        return allowed is None or rows <= allowed

    def prompts_allowed(self, version: int, pending_at_or_below: int, n: int) -> int | None:
        """Whole prompts (n samples each) rollout may sample now at `version`.

        Rounded down, so that no row beyond the bound is made: the steps that lack the remainder can take rows of
        the next version (with S ≥ 1 the last S·P steps of v's window come after version v + 1 is published).
        Rounded up where nothing else can fill them: for the run's last rows (the cap binds: at most n − 1 rows
        are left over, never trained) and with max_staleness 0 (a version's rows are its P steps' only
        source: at most n − 1 rows of each version expire unless B·P is a multiple of n). None: unknown.
        """
        allowed = self.allowance(version, pending_at_or_below)
        if allowed is None:
            return None
        only_source = self.deadline_step(version) == self.max_steps or self.max_staleness == 0
        return math.ceil(allowed / n) if only_source else allowed // n

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        data = asdict(self)
        data["done_rows"] = {str(v): rows for v, rows in sorted(self.done_rows.items())}
        return {"format": SCHEDULE_FORMAT, **data}

    @classmethod
    def from_json(cls, data: Mapping, where: str = "schedule") -> TrainSchedule:
        """Parse `to_json`'s output; a wrong field raises ScheduleError naming it (`where`: the file)."""
        if not isinstance(data, Mapping):
            raise ScheduleError(f"{where}: expected an object, got {type(data).__name__}")
        fmt = data.get("format", SCHEDULE_FORMAT)
        if fmt != SCHEDULE_FORMAT:
            raise ScheduleError(f"{where}: format {fmt!r} is not {SCHEDULE_FORMAT} (written by a newer opd-cache?)")
        known = {f for f in cls.__dataclass_fields__}
        fields = {k: v for k, v in data.items() if k in known}
        if "max_steps" not in fields:
            raise ScheduleError(f"{where}: field max_steps is missing")
        for name in ("max_steps", "publish_every", "max_staleness", "anchor_step", "anchor_version", "step"):
            if name in fields and (not isinstance(fields[name], int) or isinstance(fields[name], bool)):
                raise ScheduleError(f"{where}: field {name} = {fields[name]!r}, expected an integer")
        try:
            fields["done_rows"] = {int(v): int(rows) for v, rows in (fields.get("done_rows") or {}).items()}
        except (TypeError, ValueError, AttributeError):
            raise ScheduleError(f"{where}: field done_rows must map versions to row counts") from None
        return cls(**fields)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def schedule_from_config(train_cfg, max_staleness: int, **counters) -> TrainSchedule:
    """The schedule a TrainConfig implies before the trainer has run (the announcement of `opd run`): anchor
    (0, 0) unless given in `counters`, no rows trained."""
    return TrainSchedule(
        max_steps=train_cfg.max_steps,
        publish_every=train_cfg.publish_every,
        max_staleness=max_staleness,  # the top-level key of Config (TrainConfig has none)
        batch_samples=train_cfg.global_batch_samples,
        batch_tokens=train_cfg.global_batch_tokens,
        **counters,
    )


def read_schedule(store) -> TrainSchedule | None:
    """The trainer's schedule from `train/progress.json` (None: none published yet; the stages then pace as
    before). A malformed one raises ScheduleError naming the file."""
    return schedule_in(store.read_progress(), store)


def schedule_in(progress: Mapping, store) -> TrainSchedule | None:
    """The schedule of a progress record already read from `store` (None: none in it)."""
    data = progress.get(SCHEDULE_KEY)
    if data is None:
        return None
    return TrainSchedule.from_json(data, where=f"{store.path(layout.TRAIN_PROGRESS)} {SCHEDULE_KEY!r}")


def schedule_progress(schedule: TrainSchedule) -> dict:
    """The entry the trainer merges into its progress record: `{**progress, **schedule_progress(s)}`."""
    return {SCHEDULE_KEY: schedule.to_json()}
