"""The prompt stream of a rollout worker: infinite and deterministic.

Epoch e visits every prompt once, in a permutation drawn from (seed, worker id, e). The cursor is the
position in that stream; prompt `cursor` is epoch `cursor // len(prompts)`.
"""

from __future__ import annotations

import zlib

import numpy as np


def epoch_order(num_prompts: int, seed: int, worker_id: str, epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the prompts (positions into the PromptSet)."""
    rng = np.random.default_rng([seed, zlib.crc32(worker_id.encode()), epoch])
    return rng.permutation(num_prompts)


class PromptStream:
    """Positions `cursor, cursor+1, …` of the infinite, epoch-cycling prompt sequence."""

    def __init__(self, num_prompts: int, seed: int, worker_id: str):
        self.num_prompts, self.seed, self.worker_id = num_prompts, seed, worker_id
        self._orders: dict[int, np.ndarray] = {}

    def take(self, cursor: int, count: int) -> np.ndarray:
        positions = np.arange(cursor, cursor + count)
        epochs, offsets = np.divmod(positions, self.num_prompts)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            if epoch not in self._orders:
                self._orders = {epoch: epoch_order(self.num_prompts, self.seed, self.worker_id, int(epoch))}
            in_epoch = epochs == epoch
            out[in_epoch] = self._orders[epoch][offsets[in_epoch]]
        return out


def batch_seed(seed: int, worker_id: str, cursor: int) -> int:
    """Sampling seed of the batch starting at `cursor`: a restarted worker redraws the same samples."""
    return int(np.random.SeedSequence([seed, zlib.crc32(worker_id.encode()), cursor]).generate_state(1)[0])
