"""The trainer stage (`opd train`), one concept per module:

- `trainer.py`     — the loop that ties them together (`Trainer`, `run_train`), and `check_inputs`
- `stream.py`      — which rows train at which step: admission, staleness, order, batches, rank split
- `shard_data.py`  — a rollout shard joined with its annotated parts, as flat numpy arrays
- `loader.py`      — the prefetch thread (rank 0 plans, every rank decodes its share)
- `microbatch.py`  — rows -> padded tensors of one micro-batch (numpy, no per-row loops)
- `objective.py`   — the loss of a micro-batch as a module forward (the FSDP2 root)
- `fsdp.py`        — FSDP2 sharding of the student
- `distributed.py` — one process, or one per rank under torchrun (process groups, the device)
- `optim.py`       — AdamW, the learning-rate schedule, the mixed-precision dtype
- `resume.py`      — where training stands (`TrainPosition`, the version schedule) and how it resumes
- `checkpoint.py`  — resume states, the sample ledger, progress.json
- `publish.py`     — policy versions, written in a background thread
- `step_stats.py`  — the loss statistics of a step, summed over micro-batches and ranks
- `step_log.py`    — what each step reports: metrics record, trackers, console line
- `task_reward.py` — task rewards and GRPO advantages of a batch (train.task_reward_weight)
- `replay.py`      — `opd replay`: a trainer whose data are the annotations of other stores
"""

from opd_cache.train.trainer import TrainResult, run_train

__all__ = ["TrainResult", "run_train"]
