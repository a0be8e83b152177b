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
