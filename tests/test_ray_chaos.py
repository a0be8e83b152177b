"""Kill anything under `opd run --launcher ray`: the chaos test's invariants, Ray restarting (-m chaos, 2.5 min).

2.5 min on a quiet machine, 4.6 min at load average 8.

tests/chaos/ray_driver.py runs the chaos driver's seeded schedule (kill points, tmp watch, random kills, damaged
files, the LATEST watch) against one `opd run --launcher ray` on a local store, with fewer kills than the local
chaos test (12, at least 3 per stage, instead of 30 and 5) to keep the run short. Ray (rollout, annotate) or the
launcher (the trainer) restarts every killed stage. Then tests/chaos/invariants.py checks the store and retrains
the consumed ledger in one uninterrupted `opd train`, which must give the same policy versions; and every stage
started once plus once per kill (no stage died on its own). Damaged files are checked (check_store: each one
quarantined or reported by verify) when the run damaged any: 3 in two runs here, 0 in two others
(unlike test_chaos.check_and_replay, none is required).
"""

from __future__ import annotations

import os
import shutil

import pytest

from opd_cache.config import load_config
from opd_cache.storage.store import Store
from tests.chaos.invariants import check_store, compare_policies, replay, scratch_dir
from tests.chaos.ray_driver import run_ray_chaos
from tests.chaos.test_chaos import SEEDS

pytest.importorskip("ray")

KEY_POINTS = {"rollout-shard:before-rename": 1, "annotated-part:before-rename": 1, "policy:before-rename": 1}


@pytest.mark.chaos
def test_kill_anything_under_the_ray_launcher(tmp_path):
    config, report = run_ray_chaos(
        tmp_path / "chaos",
        SEEDS[0],
        max_steps=20,  # the local chaos run's length: time for the kills before train/DONE
        kills=12,
        min_kills_per_stage=3,
        key_points=dict(KEY_POINTS),
        random_interval_s=3.0,
        corrupt_interval_s=3.0,  # the training is the run's last minutes (Ray's starts come first): damage then
    )
    assert len(report.kills) >= 12, report.summary()
    assert all(report.per_stage()[kind] >= 3 for kind in ("rollout", "annotate", "train")), report.summary()
    assert all(report.per_point()[p] >= n for p, n in KEY_POINTS.items()), report.summary()
    per_stage = report.per_stage()
    for name, starts in report.starts.items():
        assert starts == 1 + per_stage[name.split("-")[0]], report.summary()
    # test_chaos.check_and_replay, except that a damaged file is not required: the damage needs a complete
    # resume state to exist while the stages run, which a fast run (the training is its last ~40 s) can miss
    cfg = load_config(config)
    store, scratch = Store(cfg.store.uri), scratch_dir()
    try:
        stats = check_store(store, cfg, scratch, corrupted=report.corrupted, pristine=tmp_path / "chaos" / "pristine")
        replayed = replay(store, config, tmp_path / "replay", env={**os.environ, "OMP_NUM_THREADS": "1"})
        stats["max_weight_difference"] = compare_policies(store, replayed, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{report.summary()}\n  store: {stats}")
    assert stats["trained"] == cfg.train.max_steps * cfg.train.global_batch_samples
    assert report.latest_seen[-1] == cfg.train.max_steps // cfg.train.publish_every  # it only ever grew
    assert stats["max_weight_difference"] <= 1e-5
