"""A one-machine Ray started by `opd run --launcher ray` listens on 127.0.0.1 only (ray_launcher.bind_ray_to_loopback).

The launcher's own `connect` starts Ray in this process and one stage actor runs; then every listening socket of
this process and of all it started (the GCS, the raylet, Ray's agents and workers, the actor and its command) is
listed with psutil, and each must be on a loopback address. Then the actor is retired as `opd scale` does
it: its command must get SIGINT and stop on its own, well before the launcher's kill deadline. Without `bind_ray_to_loopback` the GCS, the raylet
and the workers listen on `::` (all interfaces) and the runtime-env agent on the machine's external address.
"""

from __future__ import annotations

import ipaddress
import sys
import time

import psutil
import pytest
import yaml

from opd_cache.config import load_config

pytest.importorskip("ray")


SLEEPER = """
import time
print("up", flush=True)
try:
    time.sleep(120)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def listening_sockets() -> list[tuple[str, str, int]]:
    """(process name, address, port) of each listening TCP socket of this process and its descendants."""
    me = psutil.Process()
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:  # ended meanwhile
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback  # dual-stack gRPC sockets: ::ffff:127.0.0.1


def test_the_launchers_ray_listens_on_loopback_only_and_retires_a_worker_by_sigint(tmp_path):
    import ray

    from opd_cache.launch.ray_launcher import RETIRE_SECONDS, RayLauncher

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"store": {"uri": str(tmp_path / "store")}}))
    launcher = RayLauncher(load_config(path), path, tmp_path / "logs")
    launcher.connect()
    try:
        # a stage actor whose command sleeps: its worker process (a core-worker server) and its child run
        command = [sys.executable, "-c", SLEEPER]
        stage = launcher.stage_for("rollout-w00", command, tmp_path / "logs" / "rollout-w00.log")
        launcher.start(stage)
        deadline = time.monotonic() + 600  # a hang guard: the event waited on is the actor's pids file
        while not (tmp_path / "logs" / "rollout-w00.pids").exists():
            assert time.monotonic() < deadline, "the actor did not start its command"
            time.sleep(0.2)
        sockets = listening_sockets()
        names = {name.split(".")[0] for name, _, _ in sockets}  # the actor's title: ray::StageWorker.run
        # Ray's servers all came up and were seen: GCS, raylet (node manager + object manager), agent, actor
        assert {"gcs_server", "raylet", "ray::RuntimeEnvAgent", "ray::StageWorker"} <= names, sockets
        assert len(sockets) >= 6, sockets
        assert [s for s in sockets if not is_loopback(s[1])] == []
        assert ray.util.get_node_ip_address() == "127.0.0.1"

        # scale-down (`retire`): the command gets SIGINT, as Ctrl-C, and stops on its own; then the actor goes
        while "up" not in (tmp_path / "logs" / "rollout-w00.log").read_text():
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.2)
        retired = time.monotonic()
        launcher.retire(stage)
        while stage.refs:
            launcher.poll(stage, time.monotonic(), max_restarts=0)
            time.sleep(0.2)
        assert "interrupted" in (tmp_path / "logs" / "rollout-w00.log").read_text()
        assert time.monotonic() - retired < RETIRE_SECONDS  # stopped by its SIGINT, not killed at the deadline
    finally:
        launcher.stop(stage)
        ray.shutdown()


def test_is_loopback_reads_the_addresses_psutil_gives():
    assert is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1") and is_loopback("::1")
    assert not is_loopback("::") and not is_loopback("0.0.0.0") and not is_loopback("192.0.2.2")
