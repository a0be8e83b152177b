"""benchmarks/bench_stage_cpu.py's measurement shim: every python process it covers reports its own CPU time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_stage_cpu  # noqa: E402


def test_the_shim_reports_each_process_cpu_at_exit_and_names_the_stage(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(bench_stage_cpu.SHIM)
    log = tmp_path / "cpu.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OPD_BENCH_CPU_LOG": str(log)}
    burn = "import sys, time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass\n"
    for stage in ("train", "run"):
        subprocess.run([sys.executable, "-c", burn, stage], env=env, check=True)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2
    assert all(r["user_s"] + r["system_s"] >= 0.2 for r in records)  # the busy loop's CPU is in the report
    assert [bench_stage_cpu.process_name(r["argv"]) for r in records] == ["train", "launcher"]


def test_the_shim_is_silent_without_its_log_variable(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(bench_stage_cpu.SHIM)
    env = {k: v for k, v in os.environ.items() if k != "OPD_BENCH_CPU_LOG"}
    out = subprocess.run(
        [sys.executable, "-c", "print('ok')"], env={**env, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout == "ok\n" and out.stderr == ""


def test_the_shim_reports_forked_stages_and_their_fork_server(tmp_path):
    """With `run.fork_stages` the stages are forks of launch/forkserver.py: each still reports its own CPU (a
    fork starts its CPU count at zero and runs the exit functions it inherited), and so does the server."""
    from opd_cache.launch.forkserver import StageForkServer

    (tmp_path / "sitecustomize.py").write_text(bench_stage_cpu.SHIM)
    log = tmp_path / "cpu.jsonl"
    pythonpath = os.pathsep.join([str(tmp_path), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": pythonpath, "OPD_BENCH_CPU_LOG": str(log)}
    server = StageForkServer(env, cwd=ROOT)
    try:
        assert server.start("opd_cache.cli", ["inspect", "--help"], env, tmp_path / "help.log", cwd=ROOT).wait(120) == 0
    finally:
        server.close()
    records = {bench_stage_cpu.process_name(r["argv"]): r for r in map(json.loads, log.read_text().splitlines())}
    assert sorted(records) == ["fork server", "inspect"]
    server_cpu, stage_cpu = (records[n]["user_s"] + records[n]["system_s"] for n in ("fork server", "inspect"))
    assert server_cpu > 1.0 > stage_cpu  # the imports are the server's; the fork's count started at zero
