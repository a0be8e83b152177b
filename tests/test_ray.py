"""`opd run --launcher ray` on a one-machine Ray bound to 127.0.0.1 (opd_cache/launch/ray_launcher.py).

One tiny run, disturbed while it runs: the annotate worker's process is SIGKILLed, the rollout actor's process
is SIGKILLed (what `ray.kill` or a lost node does to it), and the annotate workers go 1 -> 3 -> 1 through
`opd scale`. Ray restarts the dead actors, and the store must end as a clean run's: the ledger exactly-once,
versions contiguous, every shard annotated once (`-m chaos`: minutes). The default suite starts Ray only for
the multi-node refusal (a two-node `ray.cluster_utils.Cluster`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from opd_cache.observe.metrics import read_metrics
from opd_cache.storage.store import Store, StoreError
from opd_cache.train.checkpoint import read_ledger, verify_ledger
from tests.test_run import BATCH, tiny_config

pytest.importorskip("ray")

STEPS = 40  # long enough (after the slow start of the actors on a loaded machine) to disturb it


def pids(logs: Path, stage: str) -> list[tuple[int, int]]:
    """(actor pid, stage process pid) of each start of a stage's actor, from its `.pids` file."""
    path = logs / f"{stage}.pids"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(line.split()[0]), int(line.split()[1])) for line in lines]  # the third field: the node id


def wait_for(condition, timeout: float, what: str, proc) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"opd run exited ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def opd(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opd_cache.cli", *args], capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def disturbed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    config = yaml.safe_load(tiny_config(tmp).read_text())
    config["train"].update(max_steps=STEPS, publish_every=2, save_every=10)
    config["annotate"].update(lease_seconds=4, poll_seconds=0.2)
    config["run"].update(evaluate=False, max_restarts=3)
    config["ray"] = {"scale_poll_seconds": 0.5}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    logs, store = tmp / "logs", Store(tmp / "store")
    out = open(tmp / "stdout.txt", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "opd_cache.cli", "run", "--launcher", "ray", "--config", str(path), "--logs", str(logs)],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=tmp,
        env=env,
    )
    events = {}
    try:
        # hang guards, not paces: each waits for an event; at load ~14 (CI + a stress run + a training job on 2
        # cores) the rollout stage process alone took 5 min to start, beyond the 300 s this guard had
        wait_for(lambda: store.shards.annotated_parts(), 900, "the first annotated part", proc)
        scaled = opd("scale", "--store", str(store.uri), "--annotate", "3")
        assert scaled.returncode == 0, scaled.stderr
        wait_for(lambda: pids(logs, "annotate-teacher-2"), 600, "the third annotate worker", proc)
        events["step_at_scale_up"] = store.read_progress().get("step", 0)

        ((_, annotate_child),) = pids(logs, "annotate-teacher-0")
        os.kill(annotate_child, signal.SIGKILL)  # the stage process: its actor dies with it, Ray restarts both
        wait_for(lambda: len(pids(logs, "annotate-teacher-0")) == 2, 600, "the annotate restart", proc)
        ((rollout_actor, _),) = pids(logs, "rollout-w00")
        os.kill(rollout_actor, signal.SIGKILL)  # the actor's process itself, as a lost node or `ray.kill`
        wait_for(lambda: len(pids(logs, "rollout-w00")) == 2, 600, "the rollout restart", proc)

        assert opd("scale", "--store", str(store.uri), "--annotate", "1").returncode == 0
        events["step_at_scale_down"] = store.read_progress().get("step", 0)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:  # a failed check: SIGTERM lets the launcher stop its actors and Ray
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.close()
    return tmp, store, logs, proc.returncode, (tmp / "stdout.txt").read_text(), events


@pytest.mark.chaos  # 2-5 minutes on two shared cores (Ray starts each actor's worker process slowly): CI step 4
def test_ray_run_survives_killed_actors_and_rescaling(disturbed_run):
    tmp, store, logs, returncode, stdout, events = disturbed_run
    assert returncode == 0, stdout[-3000:] + "".join(p.read_text()[-1500:] for p in logs.glob("*.log"))
    assert "scaled to 1 rollout, 3 annotate" in stdout and "scaled to 1 rollout, 1 annotate" in stdout
    assert events["step_at_scale_down"] < STEPS  # the counts changed while training went on
    # Ray restarted what was killed; the scaled-up workers ran
    assert len(pids(logs, "annotate-teacher-0")) == 2 and len(pids(logs, "rollout-w00")) == 2
    assert all(pids(logs, f"annotate-teacher-{i}") for i in (1, 2))
    # scaled away gracefully: SIGINT (as Ctrl-C), so the worker deleted its lease on the way out, not killed;
    # at work it says "interrupted" (cli/common.py), still importing it ends with Python's KeyboardInterrupt
    for i in (1, 2):
        log = (logs / f"annotate-teacher-{i}.log").read_text()
        assert "interrupted" in log or log.rstrip().endswith("KeyboardInterrupt"), log[-1500:]

    # the trainer's ledger: every step once, every sample once, versions contiguous
    progress = store.read_progress()
    assert store.is_done() and progress["step"] == STEPS and progress["consumed_samples"] == STEPS * BATCH
    # publish_every 2: version STEPS / 2 is the last; retention keeps the newest train.keep_versions (3), contiguous
    last = STEPS // 2
    assert store.latest_version() == last and store.policy_versions() == list(range(last - 2, last + 1))
    ledger, _ = read_ledger(store)
    assert len(ledger) == STEPS
    trained = [sid for step in sorted(ledger) for sid in ledger[step]]
    assert len(trained) == STEPS * BATCH == len(set(trained))
    assert not verify_ledger(store)["duplicates"]

    # every shard annotated once: one part file per shard, and no two workers report the same shard
    parts = store.shards.annotated_parts()
    assert {sid.rsplit("-", 1)[0] for sid in trained} <= {s for s, t in parts.items() if "teacher" in t}
    for shard_id in parts:
        folder = Path(store.uri) / "annotated" / shard_id[:7] / shard_id
        assert [p.name for p in folder.iterdir() if ".tmp-" not in p.name] == ["teacher.arrow"]
    reported = [
        r["shard_id"]
        for name, records in read_metrics(store).items()
        if name.startswith("annotate-")
        for r in records
        if r.get("event") == "annotated"
    ]
    assert len(reported) == len(set(reported))


def test_a_local_store_is_refused_on_a_cluster_of_several_nodes(local_store, s3_store):
    from opd_cache.launch.ray_launcher import check_store_reachable

    with pytest.raises(StoreError, match="the cluster has 2 nodes but the store .* is a local directory"):
        check_store_reachable(local_store, 2, shared_filesystem=False)
    check_store_reachable(local_store, 1, shared_filesystem=False)  # one machine: fine
    check_store_reachable(local_store, 2, shared_filesystem=True)  # mounted on every node: the user says so
    check_store_reachable(s3_store, 2, shared_filesystem=False)


def test_opd_scale_writes_the_wanted_counts_and_refuses_no_count(local_store):
    from opd_cache.launch.ray_launcher import SCALE_FILE

    local_store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    assert opd("scale", "--store", local_store.uri, "--annotate", "3").returncode == 0
    assert opd("scale", "--store", local_store.uri, "--rollout", "2").returncode == 0
    assert local_store.read_json(SCALE_FILE) == {"annotate": 3, "rollout": 2}
    refused = opd("scale", "--store", local_store.uri)
    assert refused.returncode == 2 and "give --rollout-workers N and/or --annotate-workers N" in refused.stderr
