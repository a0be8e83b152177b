"""`opd run` end to end on a tiny configuration: every stage exits 0 and the store holds what it should.

Also: `--sync` (lockstep, max_staleness 0) trains on the same number of samples as the asynchronous run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from opd_cache.metrics import read_metrics
from opd_cache.store import Store
from opd_cache.train.checkpoint import complete_states, read_ledger, verify_ledger

REPO = Path(__file__).resolve().parents[1]
STEPS, BATCH = 4, 16


def tiny_config(tmp_path: Path) -> Path:
    config = {
        "store": {"uri": str(tmp_path / "store")},
        "rollout": {"student": str(REPO / "data/models/student"), "prompts": str(REPO / "data/arithmetic/train.parquet"),
                    "n": 4, "batch_prompts": 4, "flush_rows": BATCH, "max_buffer_samples": 3 * BATCH,
                    "sampling": {"max_new_tokens": 10}},
        "annotate": {"teacher": str(REPO / "data/models/teacher"), "top_k": 8},
        "train": {"max_steps": STEPS, "global_batch_samples": BATCH, "lr": 1e-3, "publish_every": 2, "save_every": 2},
        "eval": {"prompts": str(REPO / "data/arithmetic/test.parquet"), "max_prompts": 16, "max_new_tokens": 10},
        "run": {"eval_every": 1, "drain_seconds": 120},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def opd_run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(tiny_config(tmp_path)), "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)


def exit_codes(logs: Path) -> dict[str, str]:
    """The last line of each stage's log (the stages print a one-line summary when they finish)."""
    return {p.stem: p.read_text().strip().splitlines()[-1] if p.read_text().strip() else "" for p in logs.glob("*.log")}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    return tmp, opd_run(tmp)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync")
    return tmp, opd_run(tmp, "--sync")


def assert_tiny_run_finished(store: Store) -> None:
    """What the store of a finished tiny run holds (local here, S3 in tests/test_s3_pipeline.py)."""
    assert store.is_done()
    shards = store.list_rollout_shards()
    parts = store.list_annotated_parts()
    assert len(shards) >= STEPS, "at least one shard per optimizer step"
    progress = store.read_progress()
    assert progress["step"] == STEPS and progress["consumed_samples"] == STEPS * BATCH
    assert store.policy_versions() == [1, 2] and store.latest_version() == 2  # publish_every 2 over 4 steps
    assert complete_states(store)[-1] == STEPS
    ledger, _ = read_ledger(store)
    trained = [sid for step in sorted(ledger) for sid in ledger[step]]
    assert len(trained) == STEPS * BATCH and len(set(trained)) == len(trained)
    assert not verify_ledger(store)["duplicates"]
    # every trained row was annotated by the teacher
    assert {sid.rsplit("-", 1)[0] for sid in trained} <= {s for s, teachers in parts.items() if "teacher" in teachers}
    # the evaluator scored version 0 and the published versions
    versions = sorted(r["version"] for r in read_metrics(store, "eval")["eval-0"])
    assert versions == [0, 1, 2]


def test_run_completes_and_store_holds_shards_versions_and_ledger(async_run):
    tmp, out = async_run
    assert out.returncode == 0, out.stderr + str(exit_codes(tmp / "logs"))
    assert_tiny_run_finished(Store(tmp / "store"))


def test_sync_trains_on_as_many_samples_as_async_and_never_stale(async_run, sync_run):
    (_, a), (tmp, s) = async_run, sync_run
    assert a.returncode == 0 and s.returncode == 0, s.stderr
    store = Store(tmp / "store")
    assert store.read_progress()["consumed_samples"] == STEPS * BATCH
    train = read_metrics(store, "train")["train-0"]
    staleness = {int(k) for r in train for k in r["staleness"]}
    assert staleness == {0}, "lockstep trains only on rows of the current version"
    assert store.policy_versions() == list(range(1, STEPS + 1))  # publish after every step


# --- the supervisor alone, with stand-in stage processes -------------------------------------------------

def supervise_fakes(tmp_path: Path, monkeypatch, codes: dict[str, str], max_restarts: int = 0) -> int:
    """`supervise` with stand-in stages: each named stage runs its Python snippet instead of the real command."""
    from opd_cache import run as run_module
    from opd_cache.config import load_config
    from opd_cache.run import StageProcess

    store_dir = tmp_path / "store"
    store_dir.mkdir()
    (store_dir / "run.json").write_text("{}")  # the non-rollout stages start once run.json exists
    cfg = load_config(tiny_config(tmp_path), overrides={"run.max_restarts": max_restarts, "run.drain_seconds": 30})
    stages = [StageProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log") for name, code in codes.items()]
    monkeypatch.setattr(run_module, "stage_commands", lambda cfg, config_path, logs: stages)
    return run_module.supervise(cfg, tmp_path / "config.yaml", tmp_path / "logs", quiet=True)


def test_supervisor_fails_when_the_evaluator_fails_after_training_finished(tmp_path, monkeypatch, capsys):
    # The trainer finishes first; the evaluator, still scoring the last version, then exits with an error;
    # rollout stops a second later. The run fails, and ends as soon as the last stage has exited (not after
    # the 30 s drain deadline).
    start = time.monotonic()
    status = supervise_fakes(tmp_path, monkeypatch, {
        "rollout-w00": "import time; time.sleep(3)",
        "train": "pass",
        "eval": "import sys, time; time.sleep(2); sys.exit(3)"})
    assert status == 1
    assert "eval exited with status 3 1 time(s)" in capsys.readouterr().err
    assert time.monotonic() - start < 15


def test_supervisor_succeeds_when_every_stage_exits_0(tmp_path, monkeypatch, capsys):
    status = supervise_fakes(tmp_path, monkeypatch, {"train": "import time; time.sleep(1)",
                                                     "eval": "import time; time.sleep(2)"})
    assert status == 0
    assert capsys.readouterr().err == ""


def test_supervisor_restarts_a_crashed_stage_then_gives_up(tmp_path, monkeypatch, capsys):
    # The trainer always crashes: started, restarted once after back-off (max_restarts 1), then failed for good.
    status = supervise_fakes(tmp_path, monkeypatch, {"train": "import sys; sys.exit(7)",
                                                     "eval": "import time; time.sleep(60)"}, max_restarts=1)
    assert status == 1
    assert "train exited with status 7 2 time(s)" in capsys.readouterr().err
