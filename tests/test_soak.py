"""Soak: a long tiny `opd run` with a version every step stays bounded (issue #14): `pytest -m soak tests/test_soak.py`.

2,000 steps (OPD_SOAK_STEPS overrides) of the tiny models, 4 samples per step,
`publish_every: 1`, retention keeping K = 3 versions and N = 2 resume states.
While it runs, every second: the size of `policy/` and `train/state/`, and the
RSS of each stage process. Then:

- `policy/` + `train/state/` never exceeded the bound of K + 2 versions (K
  kept, one being written, one a rollout worker may still hold) and N + 1
  states (N kept, one being written); the dataset (rollout and annotated
  shards) grows with the samples, by design;
- each stage's RSS grew by at most 10% over the second half of the run;
- the trainer's step time (wall time between steps) is flat: the median of
  the second half within 10% of the first half's;
- no `*.tmp-*` file in the store and no temporary folder of the stages left
  (they get a private TMPDIR).

Figures: docs/reliability.md, "Soak".
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from opd_cache.storage import layout
from opd_cache.storage.store import Store
from opd_cache.train.checkpoint import verify_ledger
from tests.helpers import tiny_run_config, write_config

pytestmark = pytest.mark.soak

REPO = Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("OPD_SOAK_STEPS", "2000"))
BATCH, KEEP_VERSIONS, KEEP_STATES = 4, 3, 2


def soak_config(tmp_path: Path) -> Path:
    config = tiny_run_config(
        str(tmp_path / "store"),
        steps=STEPS,
        batch=BATCH,
        poll_seconds=0.05,
        # one shard per step, two steps ahead: rows rarely expire
        max_staleness=4,
        rollout={"batch_prompts": 1, "max_buffer_samples": 2 * BATCH},
        train={
            "publish_every": 1,
            "save_every": 100,
            "keep_versions": KEEP_VERSIONS,
            "keep_states": KEEP_STATES,
        },
    )
    return write_config(tmp_path, config)


def folder_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass  # deleted by retention meanwhile
    return total


def stage_of(proc: psutil.Process) -> str | None:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    for stage in ("rollout", "annotate", "train"):
        if f" {stage} " in f" {cmd} " or cmd.endswith(f" {stage}"):
            return stage
    return None


class Sampler(threading.Thread):
    """Every second: sizes of policy/ and train/state/, and each stage's RSS."""

    def __init__(self, root: Path, pid: int):
        super().__init__(daemon=True)
        self.root, self.parent = root, psutil.Process(pid)
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            sample = {
                "time": time.time(),
                "policy": folder_bytes(self.root / "policy"),
                "state": folder_bytes(self.root / "train" / "state"),
                "rss": {},
            }
            try:
                children = self.parent.children(recursive=True)
            except psutil.Error:
                children = []
            for proc in children:
                stage = stage_of(proc)
                if stage:
                    try:
                        sample["rss"][stage] = (proc.pid, proc.memory_info().rss)
                    except psutil.Error:
                        pass
            self.samples.append(sample)


def test_long_run_stays_bounded(tmp_path):
    config = soak_config(tmp_path)
    private_tmp = tmp_path / "tmpdir"
    private_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(private_tmp), "OMP_NUM_THREADS": "1"}
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(config)],
        stdout=open(tmp_path / "run.out", "w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
    )
    sampler = Sampler(tmp_path / "store", proc.pid)
    sampler.start()
    try:
        assert proc.wait(timeout=3600) == 0, (tmp_path / "run.out").read_text()[-3000:]
    finally:
        sampler.stop.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
    wall = time.time() - started
    store = Store(tmp_path / "store")
    records = [json.loads(line) for line in store.read_bytes("metrics/train-0.jsonl").decode().splitlines()]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert verify_ledger(store)["trained"] == STEPS * BATCH
    assert store.latest_version() == STEPS

    # 1. bounded: K + 2 versions and N + 1 states at any time
    version_bytes = folder_bytes(store.local_path(layout.policy_dir(STEPS)))
    state_bytes = max(folder_bytes(p) for p in store.local_path("train/state").iterdir())
    bound = (KEEP_VERSIONS + 2) * version_bytes + (KEEP_STATES + 1) * state_bytes
    peak = max(s["policy"] + s["state"] for s in sampler.samples)

    # 2. No stage failed (the supervisor would have restarted it), and the RSS of each stage's process grew
    # by at most 10% over the second half of training.
    logs = {p.name: p.read_text() for p in (tmp_path / "store").parent.joinpath("logs").glob("*.log")}
    errors = {name: [line for line in text.splitlines() if line.startswith("error:")] for name, text in logs.items()}
    assert not any(errors.values()), errors
    first_step, last_step = steps[0]["time"], steps[-1]["time"]
    middle = (first_step + last_step) / 2
    growth = {}
    for stage in ("rollout", "annotate", "train"):
        series = [(s["time"], s["rss"][stage][1]) for s in sampler.samples if stage in s["rss"]]
        assert len({s["rss"][stage][0] for s in sampler.samples if stage in s["rss"]}) == 1, f"{stage} restarted"
        at_middle = [rss for t, rss in series if middle - 5 <= t <= middle + 5]
        second_half = [rss for t, rss in series if middle <= t <= last_step]
        assert at_middle and second_half, f"no RSS samples of {stage}"
        growth[stage] = max(second_half) / statistics.median(at_middle)

    # 3. flat step time
    times = [r["time"] for r in steps]
    intervals = [b - a for a, b in zip(times, times[1:])]
    half = len(intervals) // 2
    first, second = statistics.median(intervals[:half]), statistics.median(intervals[half:])
    compute = [r["step_time_s"] for r in steps]

    figures = {
        "steps": STEPS,
        "wall_s": round(wall, 1),
        "start_to_first_step_s": round(steps[0]["time"] - started, 1),
        "expired_samples": store.read_progress()["expired_samples"],
        "step_ms_first_half": round(first * 1000, 1),
        "step_ms_second_half": round(second * 1000, 1),
        "peak_policy_state_bytes": peak,
        "bound_bytes": bound,
        "version_bytes": version_bytes,
        "state_bytes": state_bytes,
        "rss_mb_peak": {k: round(max(s["rss"].get(k, (0, 0))[1] for s in sampler.samples) / 2**20, 1) for k in growth},
        "rss_growth_second_half": {k: round(v, 3) for k, v in growth.items()},
        "dataset_bytes": folder_bytes(tmp_path / "store" / "rollouts") + folder_bytes(tmp_path / "store" / "annotated"),
    }
    figures["compute_ms_halves"] = [round(1000 * statistics.median(c), 1) for c in (compute[:half], compute[half:])]
    print(f"\nsoak: {json.dumps(figures)}")

    assert peak <= bound, f"policy/ + train/state/ reached {peak:,} bytes, bound {bound:,}"
    assert len(store.policy_versions()) <= KEEP_VERSIONS + 1  # a stopped worker's hold may pin one more
    for stage, ratio in growth.items():
        assert ratio <= 1.10, f"{stage}: RSS grew {ratio:.3f}x over the second half"
    assert second <= 1.10 * first, f"step time {first * 1000:.1f} ms in the first half, {second * 1000:.1f} ms after"

    # 4. nothing temporary left (torch's own caches, e.g. torchinductor_<user>/, are not the stages')
    leftovers = [str(p) for p in (tmp_path / "store").rglob("*") if ".tmp-" in p.name]
    assert not leftovers, leftovers
    ours = [p.name for p in private_tmp.iterdir() if p.name.startswith("opd-")]
    assert not ours, ours
