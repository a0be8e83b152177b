"""The chaos driver with `opd run --launcher ray` as the supervisor: the driver kills, Ray restarts.

The same run as driver.py (its configuration, kill points, tmp watch, random kills, damaged files, the LATEST
watch, all from `random.Random(seed)`), with one difference: the driver does not start or restart the stages.
It starts `opd run --launcher ray` once, finds each stage's current process in the launcher's `<stage>.pids`
files (one line per start: actor pid, stage pid, node), and SIGKILLs that process; its actor dies with it and
Ray (rollout, annotate) or the launcher (the trainer's rank group) starts it again. The kill-point hook is on
the launcher's PYTHONPATH and passed to the actors (`OPD_*`, PYTHONPATH), so the stages stop at the same
points; a process that is not a stage's (the launcher, when it writes to the store) is resumed at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import yaml

from tests.chaos.driver import ChaosDriver, ChaosFailure, ChaosReport, ChaosSettings, Kill, _stage_kind, chaos_config


class StageProcessOnRay:
    """The current process of one stage under Ray, as the driver's code expects a `StageProcess.proc`."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        try:
            return None if psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE else 0
        except psutil.NoSuchProcess:
            return 0


class RayStage:
    def __init__(self, name: str, logs: Path):
        self.name, self.log_path = name, logs / f"{name}.log"

    def starts(self) -> list[int]:
        pids = self.log_path.with_suffix(".pids")
        return [int(line.split()[1]) for line in pids.read_text().splitlines()] if pids.exists() else []

    @property
    def proc(self) -> StageProcessOnRay | None:
        starts = self.starts()
        if not starts:
            return None
        proc = StageProcessOnRay(starts[-1])
        return proc if proc.poll() is None else None


@dataclass(frozen=True)
class RunningRayStage:
    """A stage with its process read once: `RayStage.proc` re-reads the `.pids` file and polls at every access, so
    a process that ended between `_running()`'s check and a later `stage.proc.pid` gave None (CI, stop 33)."""

    name: str
    log_path: Path
    proc: StageProcessOnRay


class RayChaosDriver(ChaosDriver):
    def __init__(self, config_path: Path, workdir: Path, settings: ChaosSettings, env: dict | None = None):
        super().__init__(config_path, workdir, settings, env)
        self.stages = [RayStage(s.name, self.logs) for s in self.stages]
        self.launcher: subprocess.Popen | None = None

    def _start(self, stage) -> None:  # Ray starts it again; the driver only counts
        self.report.starts[stage.name] += 1
        self._started_at[stage.name] = time.monotonic()

    def _is_up(self, stage) -> bool:
        """Past start-up: it has written to the store, or its process has run 60 s."""
        proc = stage.proc
        try:
            started = psutil.Process(proc.pid).create_time() if proc is not None else time.time()
        except psutil.NoSuchProcess:
            return False
        return (self.pause_dir / f"up-{proc.pid}").exists() or time.time() - started > 60.0

    def _kill(self, stage, point: str) -> None:
        """SIGKILL the stage's process (its actor dies with it, and is restarted), record it."""
        pid = stage.proc.pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while StageProcessOnRay(pid).poll() is None:
            time.sleep(0.01)
        self._forget_pause(pid)
        kill = Kill(round(time.monotonic() - self._t0, 2), _stage_kind(stage.name), point)
        self.report.kills.append(kill)
        with open(self.workdir / "kills.jsonl", "a") as f:
            f.write(json.dumps(asdict(kill)) + "\n")
        self._start(stage)

    def _running(self, kind: str | None = None) -> list[RunningRayStage]:
        running = []
        for stage in self.stages:
            proc = stage.proc
            if proc is not None and (kind is None or _stage_kind(stage.name) == kind):
                running.append(RunningRayStage(stage.name, stage.log_path, proc))
        return running

    def _resume_others(self) -> None:
        """A stopped process at a kill point that is no stage's current process (the launcher): go on."""
        stage_pids = {s.proc.pid for s in self._running()}
        for marker in self.pause_dir.glob("pause-*"):
            pid = int(marker.name.split("-")[1].split(".")[0])
            if pid not in stage_pids and StageProcessOnRay(pid).poll() is None:
                marker.unlink(missing_ok=True)
                os.kill(pid, signal.SIGCONT)

    def run(self) -> ChaosReport:
        self._start_fault_clocks()
        out = open(self.workdir / "opd-run.txt", "w")
        cmd = [sys.executable, "-m", "opd_cache.cli", "run", "--launcher", "ray", "--quiet"]
        cmd += ["--config", str(self.config_path), "--logs", str(self.logs)]
        self.launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        try:
            while self.launcher.poll() is None:
                now = time.monotonic()
                if now - self._t0 > self.settings.timeout_s:
                    raise ChaosFailure(f"the Ray chaos run did not finish in {self.settings.timeout_s:.0f} s")
                self._handle_pauses()
                self._resume_others()
                self._faults_and_checks(now)
                time.sleep(0.02)
            self._check_latest()
        finally:
            if self.launcher.poll() is None:  # a failure: SIGTERM lets the launcher stop its actors and Ray
                self.launcher.terminate()
                try:
                    self.launcher.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.launcher.kill()
                    self.launcher.wait()
            out.close()
        self.report.seconds = time.monotonic() - self._t0
        for stage in self.stages:  # the starts Ray and the launcher made, from the `.pids` files
            self.report.starts[stage.name] = len(stage.starts())
        if self.launcher.returncode != 0:
            raise ChaosFailure(
                f"opd run --launcher ray exited {self.launcher.returncode}:\n"
                f"{(self.workdir / 'opd-run.txt').read_text()[-3000:]}\n{self._log_tails()}"
            )
        return self.report


def run_ray_chaos(workdir: Path, seed: int, *, max_steps: int, **settings) -> tuple[Path, ChaosReport]:
    """driver.run_chaos's configuration on a local store, under the Ray launcher; returns (config, report)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = chaos_config(workdir, str(workdir / "store"), max_steps=max_steps)
    config = yaml.safe_load(config_path.read_text())
    # every kill is a restart: Ray's (rollout, annotate) or the launcher's (the trainer), never "given up"
    config["run"].update(max_restarts=1000)
    config["ray"] = {"scale_poll_seconds": 1.0}
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    report = RayChaosDriver(config_path, workdir, ChaosSettings(seed=seed, **settings)).run()
    return config_path, report
