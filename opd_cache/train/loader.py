"""The prefetch thread: plan global batches on rank 0, decode each rank's micro-batches ahead of the step.

Per step, in a background thread on every rank:

    rank 0: stream.next_batch(step, version) -> assign_ranks -> (task rewards)
            -> broadcast the plan (small: row ids and lengths, no tensors)
    every rank: decode its own rows into micro-batches -> queue

The plan is broadcast over a separate gloo process group, so the thread's
collectives never interleave with the training collectives of the main
thread. While rank 0 waits for admissible data it broadcasts a "wait"
heartbeat every poll, so the other ranks never sit in one collective long
enough to time out. The queue holds at most `prefetch` decoded steps; with
data on disk the step never waits on I/O.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from opd_cache.train.microbatch import MicroBatch, decode_rows, empty_micro_batch
from opd_cache.train.shard_data import ShardCache
from opd_cache.train.stream import GlobalBatch, ShardStream, StreamEnd, assign_ranks


@dataclass
class LoadedStep:
    batch: GlobalBatch
    micro_batches: list[MicroBatch]  # this rank's, the same count on every rank
    decode_seconds: float


@dataclass
class _Failure:
    error: BaseException


class BatchLoader:
    def __init__(
        self,
        *,
        cache: ShardCache,
        stream: ShardStream | None,
        rank: int,
        world_size: int,
        group=None,
        first_step: int,
        max_steps: int,
        version_of_step: Callable[[int], int],
        micro_batch_tokens: int,
        aggregation: str,
        scorer: Callable[[GlobalBatch], tuple[np.ndarray, np.ndarray]] | None = None,
        pad_id: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
    ):
        self.cache, self.stream = cache, stream
        self.rank, self.world_size, self.group = rank, world_size, group
        self.first_step, self.max_steps = first_step, max_steps
        self.version_of_step = version_of_step
        self.micro_batch_tokens, self.aggregation = micro_batch_tokens, aggregation
        self.scorer, self.pad_id = scorer, pad_id
        self.pin_memory = pin_memory  # page-locked host tensors: the copy to the GPU overlaps the step
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="opd-train-loader", daemon=True)
        if stream is not None and world_size > 1:
            stream.on_wait = lambda: self._broadcast(("wait",))

    def start(self) -> BatchLoader:
        self._thread.start()
        return self

    def get(self) -> LoadedStep | StreamEnd:
        """The next step's data (blocks); re-raises an error of the loader thread."""
        item = self.queue.get()
        if isinstance(item, _Failure):
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------ thread
    def _broadcast(self, message):
        if self.world_size == 1:
            return message
        import torch.distributed as dist

        box = [message if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _plan(self, step: int):
        """Rank 0: the next global batch (or the end). Other ranks: receive it."""
        if self.rank == 0:
            try:
                result = self.stream.next_batch(step, self.version_of_step(step))
                if isinstance(result, GlobalBatch):
                    assign_ranks(result, self.world_size, self.micro_batch_tokens)
                    if self.scorer is not None:
                        result.rewards, result.advantages = self.scorer(result)
            except BaseException as e:
                self._broadcast(("error", f"{type(e).__name__}: {e}"))
                raise
            return self._broadcast(("end", result) if isinstance(result, StreamEnd) else ("batch", result))[1]
        while True:
            message = self._broadcast(None)
            if message[0] == "wait":
                continue
            if message[0] == "error":
                raise ValueError(f"rank 0's data loader failed: {message[1]}")
            return message[1]

    def _decode(self, batch: GlobalBatch) -> list[MicroBatch]:
        if not self.cache.teachers:
            self.cache.refresh_run()
        mine = batch.rank_of_row == self.rank
        task = batch.advantages is not None
        first = self.cache.get(batch.shard_ids[0])  # k and k_s for padding micro-batches
        top_k = first.topk_ids.shape[1]
        support_k = first.support_logprobs.shape[1] if first.support_logprobs is not None else 0
        micro_batches = []
        for m in range(batch.num_micro):
            sel = np.nonzero(mine & (batch.micro_of_row == m))[0]
            if len(sel) == 0:
                micro_batches.append(empty_micro_batch(top_k, support_k, task))
                continue
            micro_batches.append(
                decode_rows(
                    self.cache,
                    batch.shard_ids,
                    batch.row_shard[sel],
                    batch.row_index[sel],
                    aggregation=self.aggregation,
                    global_tokens=batch.response_tokens,
                    global_seqs=batch.global_seqs,
                    advantages=batch.advantages[sel] if task else None,
                    pad_id=self.pad_id,
                )
            )
        if self.pin_memory:
            micro_batches = [mb.pin_memory() for mb in micro_batches]
        return micro_batches

    def _run(self) -> None:
        try:
            for step in range(self.first_step, self.max_steps + 1):
                if self._stop.is_set():
                    return
                result = self._plan(step)
                if isinstance(result, StreamEnd):
                    self._put(result)
                    return
                t0 = time.perf_counter()
                micro_batches = self._decode(result)
                self._put(LoadedStep(result, micro_batches, time.perf_counter() - t0))
        except BaseException as e:  # handed to the main thread, which raises it
            self._put(_Failure(e))
