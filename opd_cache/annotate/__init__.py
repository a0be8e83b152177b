"""`opd annotate`: the batch teacher job.

- `worker.py`   — the worker (`Annotator`, `annotate`): find unannotated shards, score, publish parts
- `hf_score.py`, `vllm_score.py` — the scoring back-ends (`opd_cache.engine.Scorer`)
"""

from opd_cache.annotate.worker import AnnotateStats, Annotator, annotate, shard_owner

__all__ = ["AnnotateStats", "Annotator", "annotate", "shard_owner"]
