"""`opd annotate`: the batch teacher job.

- `worker.py`         — the worker (`Annotator`, the entry point `run_annotate`): score shards, publish parts
- `selection.py`      — which shards a worker takes (static split, staleness window) and demand-aware pacing
- `leases.py`         — shard claiming through leases in the store (workers join and leave at any time)
- `teacher_checks.py` — is the teacher compatible with the run (tokenizer, vocabulary, embedding)
- `engines.py`        — which back-end `annotate.engine` names (`make_scorer`)
- `hf_score.py`, `vllm_score.py` — the scoring back-ends (`opd_cache.engine.Scorer`)
"""

from opd_cache.annotate.worker import AnnotateStats, Annotator, run_annotate, shard_owner

__all__ = ["AnnotateStats", "Annotator", "run_annotate", "shard_owner"]
