"""Kill anything under `opd run --launcher ray` (-m chaos: ~7 min here): the chaos test's invariants, Ray restarting.

tests/chaos/ray_driver.py runs the chaos driver's seeded schedule (kill points, tmp watch, random kills, damaged
files, the LATEST watch) against one `opd run --launcher ray` on a local store, with fewer kills than the local
chaos test (12, at least 3 per stage, instead of 30 and 5) to keep the run short. Ray (rollout, annotate) or the
launcher (the trainer) restarts every killed stage. Then tests/chaos/invariants.py checks the store and retrains
the consumed ledger in one uninterrupted `opd train`, which must give the same policy versions; and every stage
started once plus once per kill (no stage died on its own).
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.ray_driver import run_ray_chaos
from tests.chaos.test_chaos import SEEDS, check_and_replay

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
    stats = check_and_replay(tmp_path, config, report, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert stats["max_weight_difference"] <= 1e-5
