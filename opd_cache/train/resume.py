"""Where training stands, and how a starting trainer resumes it.

`TrainPosition` is what a resume state's `trainer.json` records besides the weights and the optimizer: the step,
the policy version, the stream cursor, and the anchor that the versions of future steps count from. A trainer
starts from the newest resume state whose files pass their checksums (`load_newest_intact_state`), or from step 0
at version 0. Rank 0 then sweeps what the previous run may have left half done (`sweep_after_resume`).

Policy versions: the student at step s (1-based) has version
anchor_version + (s − 1 − anchor_step) // publish_every, where the anchor is (0, 0) for a run without a resume
state and moves when a run ends between publications. Knowing the version of every future step lets the stream
judge staleness while it prefetches.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from opd_cache.storage.retention import retention_pass
from opd_cache.storage.store import Store
from opd_cache.train.checkpoint import (
    CorruptStateError,
    clear_ledger_after,
    complete_states,
    drop_corrupt_state,
    load_state,
)
from opd_cache.train.stream import StreamCursor


@dataclass
class TrainPosition:
    """The trainer's place: step, policy version, stream cursor, and the anchor of the version schedule.

    Without a resume state the model is the student, version 0, even when LATEST is higher: a trainer killed after
    its first publication but before its first state starts over, re-deriving versions 1, 2, ... (publish_version
    keeps what exists, LATEST never moves back). Counting on from LATEST instead would number the student's
    weights as a later version.
    """

    step: int = 0  # optimizer steps done
    version: int = 0  # policy version of the weights being trained (the last one published)
    cursor: StreamCursor = field(default_factory=StreamCursor)
    anchor_step: int = 0  # the versions of later steps count from (anchor_step, anchor_version)
    anchor_version: int = 0
    published_step: int = 0  # the step whose weights the last publication holds

    def version_of_step(self, step: int, publish_every: int) -> int:
        """The policy version the student has while it trains step `step` (1-based)."""
        return self.anchor_version + (step - 1 - self.anchor_step) // publish_every

    def to_state(self, *, world_size: int, loss: str) -> dict:
        """trainer.json of a resume state (JSON: the storage boundary of the cursor)."""
        return {
            "step": self.step,
            "policy_version": self.version,
            "cursor": self.cursor.to_dict(),
            "anchor_step": self.anchor_step,
            "anchor_version": self.anchor_version,
            "published_step": self.published_step,
            "world_size": world_size,
            "loss": loss,
            "time": round(time.time(), 3),
        }

    @classmethod
    def from_state(cls, state: dict, cursor_type: type[StreamCursor] = StreamCursor) -> TrainPosition:
        """The position a resume state's trainer.json records; `cursor_type` is the stream's (replay: its own)."""
        return cls(
            step=state["step"],
            version=state["policy_version"],
            cursor=cursor_type.from_dict(state["cursor"]),
            anchor_step=state["anchor_step"],
            anchor_version=state["anchor_version"],
            published_step=state["published_step"],
        )


def load_newest_intact_state(
    store: Store, objective: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int
) -> dict | None:
    """trainer.json of the newest complete resume state whose files pass their checksums, loaded into `objective`
    and `optimizer`; None when there is none.

    A damaged state is quarantined (rank 0) and never loaded, not even in part; the previous one is tried.
    """
    for step in reversed(complete_states(store)):
        try:
            return load_state(store, step, objective, optimizer, rank=rank)
        except CorruptStateError as e:
            if rank == 0:
                drop_corrupt_state(store, e)
                print(
                    f"warning: resume state step {step} is damaged ({e}): quarantined; trying the previous "
                    f"complete state",
                    file=sys.stderr,
                )
    return None


def sweep_after_resume(
    store: Store, position: TrainPosition, *, keep_versions: int | None, keep_states: int
) -> list[str]:
    """Rank 0, before training: finish what a killed run left half done. Returns the temporary files removed.

    The ledger of steps after the resumed one is written again by this run; temporary files that killed writers
    of any stage left over an hour ago go; a retention pass that a kill cut short is finished.
    """
    clear_ledger_after(store, position.step, position.cursor.finished)
    swept = store.remove_stale_tmp()
    retention_pass(store, keep_versions, keep_states)
    return swept
