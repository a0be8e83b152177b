"""Stages forked from one pre-imported interpreter (opd_cache/launch/forkserver.py): the same command, log,
environment, session, exit status and CPU accounting as a fresh `python -m opd_cache.cli` process.

One server for the module (it imports torch and transformers once, a few seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from opd_cache.launch.forkserver import ForkedStage, StageForkServer
from tests.conftest import REPO

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def server():
    server = StageForkServer(ENV, cwd=REPO)
    yield server
    server.close()


def test_a_forked_stage_runs_the_command_into_its_log_with_its_status(server, tmp_path):
    log = tmp_path / "help.log"
    stage = server.start("opd_cache.cli", ["inspect", "--help"], ENV, log, cwd=REPO)
    assert stage.wait(120) == 0
    assert "Usage: opd inspect" in log.read_text()

    refused = server.start("opd_cache.cli", ["inspect", str(tmp_path / "nope")], ENV, tmp_path / "nope.log", cwd=REPO)
    assert refused.wait(120) == 2  # the CLI's status for a user error, as from a fresh process
    assert "does not exist" in (tmp_path / "nope.log").read_text()


def test_a_forked_stage_reads_the_environment_it_was_given(server, tmp_path):
    """The help's width follows COLUMNS, read when the command runs: the child's environment, not the server's."""
    widths = {}
    for columns in ("60", "150"):
        log = tmp_path / f"help-{columns}.log"
        stage = server.start("opd_cache.cli", ["inspect", "--help"], {**ENV, "COLUMNS": columns}, log, cwd=REPO)
        assert stage.wait(120) == 0
        widths[columns] = max(len(line) for line in log.read_text().splitlines())
    assert widths["60"] <= 60 < widths["150"] <= 150


def test_a_forked_stage_leads_its_own_process_group_and_reports_its_signal(server, tmp_path):
    """A trainer waiting for a store's run.json logs that it waits (unbuffered, while it runs), and is killed
    through its process group, as the supervisor does; a SIGKILL is its status, as Popen reports it."""
    store = tmp_path / "store"
    store.mkdir()
    config = REPO / "examples" / "arithmetic_cpu" / "config.yaml"
    argv = ["train", "--config", str(config), "--set", f"store.uri={store}", "--follow"]
    log = tmp_path / "train.log"
    waiting = server.start("opd_cache.cli", argv, ENV, log, cwd=REPO)
    assert waiting.poll() is None
    assert os.getpgid(waiting.pid) == waiting.pid  # the server answers once the child has its own session
    # its log is written as it goes, not at exit: the waiting line shows while it is still waiting
    deadline = time.monotonic() + 120
    while "waiting for" not in log.read_text() and time.monotonic() < deadline:
        assert waiting.poll() is None, log.read_text()
        time.sleep(0.05)
    assert "waiting for" in log.read_text() and waiting.poll() is None
    os.killpg(waiting.pid, signal.SIGKILL)
    assert waiting.wait(60) == -signal.SIGKILL


def test_closing_the_server_hands_the_stages_cpu_to_its_parent(tmp_path):
    """The server waits for its children before it exits, so their CPU reaches the supervisor's
    RUSAGE_CHILDREN (the benchmarks' clock): measured here in a child that runs one server."""
    probe = (
        "import json, os, resource, sys\n"
        "from opd_cache.launch.forkserver import StageForkServer\n"
        "server = StageForkServer(dict(os.environ))\n"
        "stage = server.start('opd_cache.cli', ['inspect', '--help'], dict(os.environ), sys.argv[1])\n"
        "status = stage.wait(120)\n"
        "server.close()\n"
        "usage = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'status': status, 'server': server.proc.returncode, 'cpu': usage.ru_utime + usage.ru_stime}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "help.log")], cwd=REPO, env=ENV, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == 0 and result["server"] == 0
    assert result["cpu"] > 1.0  # the server's imports of torch and transformers, at least


def test_opd_run_forks_its_stages_but_not_vllm_ones(tmp_path):
    from opd_cache.config import load_config
    from opd_cache.launch.run import stage_commands

    cfg = load_config(REPO / "examples" / "arithmetic_cpu" / "config.yaml")
    stages = stage_commands(cfg, tmp_path / "config.yaml", tmp_path)
    assert all(s.can_fork for s in stages)
    cfg.rollout.engine = "vllm"  # vLLM starts engine processes of its own: a fresh interpreter
    assert [s.name for s in stage_commands(cfg, tmp_path / "c.yaml", tmp_path) if not s.can_fork] == ["rollout-w00"]


@pytest.mark.parametrize("fork_stages", [True, False])
def test_the_supervisor_restarts_a_forked_stage_then_gives_up(tmp_path, monkeypatch, capsys, fork_stages):
    """`opd run`'s supervisor with forked stages: a stage that fails is forked again after its back-off, then
    given up; the others run to their end. With `run.fork_stages: false`, the same as fresh processes."""
    from opd_cache.config import load_config
    from opd_cache.launch import run as run_module
    from opd_cache.launch.run import StageProcess
    from tests.test_run import tiny_config

    store_dir = tmp_path / "store"
    store_dir.mkdir()
    (store_dir / "run.json").write_text("{}")
    overrides = {"run.max_restarts": 1, "run.drain_seconds": 30, "run.fork_stages": fork_stages}
    cfg = load_config(tiny_config(tmp_path), overrides=overrides)
    cli = [sys.executable, "-m", "opd_cache.cli"]
    stages = [
        StageProcess("train", [*cli, "inspect", str(tmp_path / "nope")], tmp_path / "train.log"),
        StageProcess("eval", [*cli, "inspect", "--help"], tmp_path / "eval.log"),
    ]
    assert all(s.can_fork for s in stages)
    monkeypatch.setattr(run_module, "stage_commands", lambda cfg, config_path, logs: stages)
    started = []  # the stage processes as the supervisor held them
    real_start = StageProcess.start
    monkeypatch.setattr(StageProcess, "start", lambda self, *a: (real_start(self, *a), started.append(self.proc)))
    status = run_module.supervise(cfg, tmp_path / "config.yaml", tmp_path / "logs", quiet=True)
    assert len(started) == 3 and all(isinstance(p, ForkedStage) == fork_stages for p in started)
    assert status == 1
    assert "train exited with status 2 2 time(s)" in capsys.readouterr().err
    assert (tmp_path / "train.log").read_text().count("does not exist") == 2  # forked twice
    assert "Usage: opd inspect" in (tmp_path / "eval.log").read_text()
