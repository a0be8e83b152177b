"""`opd run --launcher ray --address …` on a two-node `ray.cluster_utils.Cluster` on 127.0.0.1 (-m chaos: ~2 min).

The head node has a custom resource `rollout_node`, the second node `annotate_node`; the tiny run asks for them
in `ray.rollout.resources` / `ray.annotate.resources`, so the rollout worker must run on the head and the annotate
worker on the other node (each actor writes its node id to its `.pids` file). The two nodes share this machine's
filesystem, so the local store is allowed with `ray.shared_filesystem: true` (without it the launcher refuses a
local store on two nodes: tests/test_ray.py). While the run goes, every listening socket of the cluster's
processes and of the launcher must be on loopback (tests/test_ray_loopback.py).

A likely cause of the hang seen before (not reproduced: a two-node Cluster starts here in ~12 s with or without the
loopback setting): a `Cluster` node has one CPU unless told more, and the four stage actors (rollout,
annotate, train and the evaluator, one CPU each) waited for CPUs that two such nodes do not have.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from opd_cache.storage.store import Store
from opd_cache.train.checkpoint import read_ledger, verify_ledger
from tests.test_ray_loopback import is_loopback, listening_sockets
from tests.test_run import BATCH, tiny_config

pytest.importorskip("ray")

STEPS = 4


def node_ids(logs, stage: str) -> list[str]:
    path = logs / f"{stage}.pids"
    return [line.split()[2] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.chaos
def test_rollout_and_annotate_run_on_the_nodes_their_resources_name(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    from opd_cache.launch.ray_launcher import bind_ray_to_loopback

    bind_ray_to_loopback()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 3, "resources": {"rollout_node": 1}, "include_dashboard": False},
    )
    try:
        annotate_node = cluster.add_node(num_cpus=3, resources={"annotate_node": 1})
        cluster.wait_for_nodes()
        config = yaml.safe_load(tiny_config(tmp_path).read_text())
        config["train"].update(max_steps=STEPS)
        config["run"].update(evaluate=False)
        config["ray"] = {
            "address": cluster.address,
            "rollout": {"resources": {"rollout_node": 1}},
            "annotate": {"resources": {"annotate_node": 1}},
            "shared_filesystem": True,
        }
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        logs, store = tmp_path / "logs", Store(tmp_path / "store")
        with open(tmp_path / "stdout.txt", "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "opd_cache.cli", "run", "--launcher", "ray", "--config", str(path)]
                + ["--logs", str(logs), "--quiet"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            try:
                deadline = time.monotonic() + 900  # a hang guard: Ray's workers start slowly on a loaded machine
                while not store.shards.annotated_parts():  # both workers at work: look at the sockets then
                    assert proc.poll() is None, (tmp_path / "stdout.txt").read_text()[-3000:]
                    assert time.monotonic() < deadline, "no annotated part in 900 s"
                    time.sleep(0.5)
                sockets = listening_sockets()  # the two nodes' processes, the launcher and its actors
                assert sum(name == "raylet" for name, _, _ in sockets) == 4, sockets  # two ports per raylet
                assert [s for s in sockets if not is_loopback(s[1])] == []
                returncode = proc.wait(timeout=900)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=60)
        stdout = (tmp_path / "stdout.txt").read_text()
        assert returncode == 0, stdout[-3000:] + "".join(p.read_text()[-1500:] for p in logs.glob("*.log"))

        head_id = cluster.head_node.node_id
        assert head_id != annotate_node.node_id
        assert node_ids(logs, "rollout-w00") == [head_id]
        assert node_ids(logs, "annotate-teacher-0") == [annotate_node.node_id]
        progress = store.read_progress()
        assert store.is_done() and progress["step"] == STEPS and progress["consumed_samples"] == STEPS * BATCH
        ledger, _ = read_ledger(store)
        trained = [sid for step in sorted(ledger) for sid in ledger[step]]
        assert len(trained) == STEPS * BATCH == len(set(trained)) and not verify_ledger(store)["duplicates"]
    finally:
        ray.shutdown()
        cluster.shutdown()
