"""`opd rollout`: the student samples responses and publishes them as rollout shards.

- `worker.py`        — the worker (`RolloutWorker`, the entry point `run_rollout`) and its shard buffer
- `engines.py`       — which back-end `rollout.engine` names (`make_engine`)
- `prompt_stream.py` — the deterministic, infinite stream of prompts a worker walks
- `resume.py`        — where a restarted worker resumes (its last shard's metadata)
- `pacing.py`        — how far rollout may run ahead of the trainer
- `policy.py`        — published policy versions, checked and downloaded before they load
- `display.py`       — the progress bar / log lines
- `hf_generate.py`, `vllm_generate.py` — the generation back-ends (`opd_cache.engine.Generator`)
"""

from opd_cache.rollout.worker import RolloutResult, RolloutWorker, run_rollout

__all__ = ["RolloutResult", "RolloutWorker", "run_rollout"]
