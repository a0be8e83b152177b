"""`opd run`: rollout, annotate, train (and an evaluator) as processes on one store, supervised.

Each stage is started with the same command a user would type (`python -m
opd_cache.cli <stage> --config <resolved config> …`), so what `opd run` does
on one machine is exactly what separate machines do against a shared store.
The supervisor:

- restarts a stage that exits with an error, with exponential back-off, up to
  `run.max_restarts` times (its work is resumable: see docs/reliability.md);
- shows one live dashboard built from the store alone (shards, annotated parts,
  trainer progress, losses, evaluations);
- stops everything when the trainer has finished (`train/DONE`), and exits
  non-zero when a stage failed for good.

`--sync` runs the same processes in lockstep: `max_staleness = 0`, a new
policy after every optimizer step, and rollout allowed one global batch ahead —
generate → annotate → train, repeat: the synchronous OPD of verl.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.live import Live
from rich.table import Table

from opd_cache.config import Config
from opd_cache.metrics import read_metrics
from opd_cache.store import Store


@dataclass
class StageProcess:
    name: str  # e.g. "rollout-w00"
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    finished: bool = False  # exited 0
    failed: bool = False  # exited non-zero more often than allowed
    exit_codes: list[int] = field(default_factory=list)

    def start(self, env: dict) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # own process group: signals reach its children
        log.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def sync_overrides(cfg: Config) -> Config:
    """The lockstep baseline expressed as pacing: no staleness, publish every step, one batch ahead at most."""
    batch = cfg.train.global_batch_samples or cfg.rollout.flush_rows
    cfg.train.max_staleness = 0
    cfg.train.publish_every = 1
    cfg.rollout.max_staleness = 0
    # rollout pauses while backlog > max_buffer_samples: one row less than a batch makes it wait for the
    # next version after each batch (with `= batch` it samples a second batch of the old version, which expires)
    cfg.rollout.max_buffer_samples = max(batch - 1, 1)
    cfg.rollout.flush_rows = batch
    cfg.annotate.max_staleness = 0
    cfg.run.rollout_workers = 1
    return cfg


def stage_commands(cfg: Config, config_path: Path, logs: Path) -> list[StageProcess]:
    """The stage processes of a run: R rollout workers, A annotate workers per teacher, the trainer, an evaluator."""
    cli = [sys.executable, "-m", "opd_cache.cli"]
    common = ["--config", str(config_path)]
    stages = []
    for w in range(cfg.run.rollout_workers):
        worker = f"w{w:02d}"
        stages.append(StageProcess(f"rollout-{worker}", [*cli, "rollout", *common, "--worker-id", worker, "--follow"],
                                   logs / f"rollout-{worker}.log"))
    teachers = cfg.run.teachers or {cfg.annotate.teacher_name: cfg.annotate.teacher}
    for name, path in teachers.items():
        for i in range(cfg.run.annotate_workers):
            stages.append(StageProcess(
                f"annotate-{name}-{i}",
                [*cli, "annotate", *common, "--teacher", str(path), "--teacher-name", name,
                 "--worker-index", str(i), "--num-workers", str(cfg.run.annotate_workers), "--follow"],
                logs / f"annotate-{name}-{i}.log"))
    stages.append(StageProcess("train", [*cli, "train", *common, "--follow"], logs / "train.log"))
    if cfg.run.evaluate and cfg.eval.prompts:
        teacher = cfg.eval.teacher or next(iter(teachers.values()))
        stages.append(StageProcess(
            "eval", [*cli, "eval", "--model", cfg.store.uri, "--follow", "--every", str(cfg.run.eval_every), *common,
                     "--teacher", str(teacher)], logs / "eval.log"))
    return stages


def dashboard(store: Store, stages: list[StageProcess]) -> Table:
    """One table from the store alone: what each stage has done so far."""
    table = Table(title=f"opd run — {store.uri}", expand=False)
    for col in ("stage", "state", "done so far"):
        table.add_column(col)
    try:
        shards = store.list_rollout_shards()
        parts = store.list_annotated_parts()
        progress = store.read_progress()
        metrics = read_metrics(store)
    except Exception as e:  # the dashboard must never take the run down
        table.add_row("store", "unreadable", str(e)[:80])
        return table
    train = metrics.get("train-0", [])
    last = train[-1] if train else {}
    evals = metrics.get("eval-0", [])
    versions = sorted({s.policy_version for s in shards})
    rollout_rate = [r["tokens_per_s"] for name, rs in metrics.items() if name.startswith("rollout-")
                    for r in rs[-1:] if "tokens_per_s" in r]
    annotate_rate = [r["tokens_per_s"] for name, rs in metrics.items() if name.startswith("annotate-")
                     for r in rs if r.get("event") == "annotated"][-1:]
    summary = {
        "rollout": (f"{len(shards)} shards, versions {versions[0]}..{versions[-1]}"
                    + (f", {sum(rollout_rate):.0f} tok/s" if rollout_rate else "")) if shards else "no shards yet",
        "annotate": (f"{sum(len(t) for t in parts.values())} parts over {len(parts)} shards"
                     + (f", {annotate_rate[0]:.0f} tok/s" if annotate_rate else "")),
        "train": (f"step {progress.get('step', 0)}, version {progress.get('policy_version', 0)}, "
                  f"{progress.get('consumed_samples', 0)} samples, {progress.get('expired_samples', 0)} expired"
                  + (f", loss {last.get('loss', float('nan')):.4f}" if last else "")
                  + (f", staleness {last.get('staleness')}" if last.get("staleness") else "")
                  + (f", {last.get('tokens_per_s', 0):.0f} tok/s" if last.get("tokens_per_s") else "")),
        "eval": (f"v{evals[-1]['version']}: strict {evals[-1]['strict']:.2f}, lenient {evals[-1]['lenient']:.2f}"
                 + (f", KL {evals[-1]['kl']:.4f}" if evals[-1].get("kl") is not None else "")) if evals else "—",
    }
    for stage in stages:
        if stage.failed:
            state = "[red]failed[/]"
        elif stage.finished:
            state = "[green]finished[/]"
        elif stage.proc is not None and stage.proc.poll() is None:
            state = "running" + (f" (restart {stage.restarts})" if stage.restarts else "")
        else:
            state = "waiting to restart"
        table.add_row(stage.name, state, summary.get(stage.name.split("-")[0], ""))
    return table


def poll_stages(stages: list[StageProcess], now: float, max_restarts: int) -> str | None:
    """Record the exits of stage processes; schedule restarts with back-off. Returns the first failure for good."""
    failure = None
    for stage in stages:
        code = stage.proc.poll() if stage.proc is not None else None
        if code is None:
            continue
        stage.exit_codes.append(code)
        stage.proc = None
        if code == 0:
            stage.finished = True
        elif stage.restarts >= max_restarts:
            stage.failed = True
            failure = failure or (f"{stage.name} exited with status {code} {len(stage.exit_codes)} time(s); "
                                  f"see {stage.log_path}")
        else:
            stage.restarts += 1
            stage.next_start = now + min(2.0 ** stage.restarts, 30.0)
    return failure


def supervise(cfg: Config, config_path: Path, logs: Path, *, quiet: bool = False) -> int:
    """Run all stages until the trainer finishes; returns the exit status (0 = every stage succeeded)."""
    store = Store(cfg.store.uri, s3_endpoint=cfg.store.s3_endpoint)
    logs.mkdir(parents=True, exist_ok=True)
    stages = stage_commands(cfg, config_path, logs)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("OMP_NUM_THREADS", str(cfg.run.threads_per_stage))
    # Rollout creates run.json (run id, tokenizer); the other stages validate against it, so they start
    # once it exists. Until then only the rollout workers run.
    for stage in stages:
        if stage.name.startswith("rollout") or store.exists("run.json"):
            stage.start(env)

    stop_requested = False

    def request_stop(signum, frame):
        nonlocal stop_requested
        stop_requested = True

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    failure = None
    try:
        with Live(dashboard(store, stages), refresh_per_second=1, transient=False, redirect_stdout=False,
                  auto_refresh=False) if not quiet else _NullLive() as live:
            while not stop_requested:
                now = time.monotonic()
                failure = poll_stages(stages, now, cfg.run.max_restarts)  # the loop ends at the first
                for stage in stages:
                    if (stage.proc is None and not stage.finished and not stage.failed and now >= stage.next_start
                            and (stage.name.startswith("rollout") or store.exists("run.json"))):
                        stage.start(env)
                live.update(dashboard(store, stages), refresh=True)
                trainer = next(s for s in stages if s.name == "train")
                if failure or trainer.finished:
                    break
                time.sleep(0.5)
            # after the trainer: producers stop on DONE by themselves; the evaluator finishes the last version.
            # Nothing is restarted now, so a stage that exits with an error here has failed for good.
            deadline = time.monotonic() + (cfg.run.drain_seconds if not failure and not stop_requested else 10)
            while any(s.proc is not None for s in stages) and time.monotonic() < deadline:
                failed_now = poll_stages(stages, time.monotonic(), max_restarts=0)  # always: it retires exited stages
                failure = failure or failed_now
                live.update(dashboard(store, stages), refresh=True)
                time.sleep(0.5)
    finally:
        for stage in stages:
            stage.signal(signal.SIGTERM)
        time.sleep(0.5)
        for stage in stages:
            stage.signal(signal.SIGKILL)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        print(f"opd run: {failure}", file=sys.stderr)
        return 1
    if stop_requested:
        return 130
    return 0


class _NullLive:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, *args, **kwargs):
        pass


def write_resolved_config(cfg: Config, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
