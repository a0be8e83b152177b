"""Writes tests/data/release_1d611de/: a store as the release before the layout refactor and schema version 2
(commit 1d611de) wrote it. Run from a checkout of that commit (its opd_cache on PYTHONPATH):

    git worktree add ../opd-1d611de 1d611de
    PYTHONPATH=../opd-1d611de python tests/data/make_release_store.py tests/data/release_1d611de

Two rollout shards of version 0 (the second with the student's top-2 support) with their teacher's float32 parts
and run.json; tests/test_release_store.py reads it with today's code (tests/data/codec_v*: packed parts).
"""

import sys

from opd_cache.store import Store
from opd_cache.testing import write_synthetic_shard

store = Store(sys.argv[1])
run = store.ensure_run(student="student", tokenizer_fingerprint="fp-release", vocab_size=64, top_k=4)
write_synthetic_shard(store, run, "v000000-w00-000000", num_rows=6, vocab_size=64, top_k=4, seed=0)
write_synthetic_shard(store, run, "v000000-w00-000001", num_rows=6, vocab_size=64, top_k=4, seed=1, student_topk=2)
