"""Keep the teacher's scores at the positions the student trains on (docs/design.md §3, "Schema version 2").

The teacher scores every response token of a row: a multi-turn row's tool results and template text are context
it must see to judge the next assistant turn. The annotated part holds one entry per *trained* position only
(loss_mask = 1; every position of a single-turn row), in order, so a part is as long as what trains and the
trainer scatters it back with the same mask (`storage.columns.trained_mask`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from opd_cache.engine import TeacherScores
from opd_cache.storage.schema import trained_lengths, trained_mask


def keep_trained_positions(scores: TeacherScores, rows: pa.Table) -> TeacherScores:
    """`scores` of the rollout `rows` (every response token, row after row) restricted to their trained positions.

    Single-turn rows (no `loss_mask`) are returned as they are: their every position trains."""
    trained = trained_mask(rows)
    if trained.all():
        return scores
    if len(trained) != scores.num_tokens:
        raise ValueError(f"the teacher returned {scores.num_tokens} positions for {len(trained)} response tokens")
    return TeacherScores(
        lengths=trained_lengths(rows),
        topk_ids=np.ascontiguousarray(scores.topk_ids[trained]),
        topk_logprobs=np.ascontiguousarray(scores.topk_logprobs[trained]),
        token_logprob=np.ascontiguousarray(scores.token_logprob[trained]),
        support_logprobs=(
            np.ascontiguousarray(scores.support_logprobs[trained]) if scores.support_logprobs is not None else None
        ),
    )
