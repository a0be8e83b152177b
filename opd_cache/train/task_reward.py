"""Task rewards for the optional GRPO term: score each response, normalise within its prompt group.

Rewards are computed on rank 0 while the global batch is planned (the planner
sees every row, so a group split across ranks is still normalised together).
Groups are the rows of the global batch with the same `prompt_index`; a group
with one row gets advantage 0.
"""

from __future__ import annotations

import numpy as np

from opd_cache.storage import layout
from opd_cache.storage.schema import ShardError
from opd_cache.tasks.rewards import compute_score
from opd_cache.train.shard_data import ShardCache, ragged_index
from opd_cache.train.stream import GlobalBatch, group_advantages


def score_batch(batch: GlobalBatch, cache: ShardCache, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(rewards, advantages) per row of `batch` (strict correctness of the decoded response, 0 or 1)."""
    rewards = np.zeros(batch.num_rows, dtype=np.float64)
    groups = np.zeros(batch.num_rows, dtype=np.int64)
    for s, shard_id in enumerate(batch.shard_ids):
        where = np.nonzero(batch.row_shard == s)[0]
        data = cache.get(shard_id)
        rows = batch.row_index[where]
        truths = data.ground_truth.take(rows).to_pylist()
        if any(t is None for t in truths):
            raise ShardError(
                f"{cache.store.path(layout.rollout_path(shard_id))}: rows without ground_truth; "
                f"the task reward (train.task_reward_weight > 0) needs it for every row"
            )
        sources = data.data_source.take(rows).to_pylist()
        tokens = data.response_values[ragged_index(data.response_offsets, rows)]
        split = np.split(tokens, np.cumsum(data.response_lengths[rows])[:-1])
        texts = tokenizer.batch_decode([t.tolist() for t in split], skip_special_tokens=True)
        rewards[where] = [compute_score(src, text, truth)["strict"] for src, text, truth in zip(sources, texts, truths)]
        groups[where] = data.prompt_index[rows]
    return rewards.astype(np.float32), group_advantages(rewards, groups)
