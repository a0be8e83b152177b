"""The trainer stage (`opd train`), one concept per module:

- `shard_data.py`  — a rollout shard joined with its annotated parts, as flat numpy arrays
- `stream.py`      — which rows train at which step: admission, staleness, order, batches, rank split
- `microbatch.py`  — rows -> padded tensors of one micro-batch (numpy, no per-row loops)
- `loader.py`      — the prefetch thread (rank 0 plans, every rank decodes its share)
- `objective.py`   — the loss of a micro-batch as a module forward (the FSDP2 root)
- `fsdp.py`        — FSDP2 sharding of the student
- `checkpoint.py`  — resume states, the sample ledger, policy publication, progress.json
- `trainer.py`     — the loop that ties them together
- `synthetic.py`   — synthetic annotated shards for tests and benchmarks
"""

from opd_cache.train.trainer import TrainResult, train

__all__ = ["train", "TrainResult"]
