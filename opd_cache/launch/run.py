"""`opd run`: rollout, annotate, train (and an evaluator) as processes on one store, supervised.

Each stage is started with the same command a user would type (`python -m
opd_cache.cli <stage> --config <resolved config> …`), so what `opd run` does
on one machine is exactly what separate machines do against a shared store.
The supervisor:

- starts every stage at once: annotate, train and the evaluator do their
  imports and load their models while rollout loads its own and creates
  run.json, then wait for it and check it as when started by hand;
- restarts a stage that exits with an error, with exponential back-off, up to
  `run.max_restarts` times (its work is resumable: see docs/reliability.md);
- shows one live dashboard built from the store alone (shards, annotated parts,
  trainer progress, losses, evaluations, elapsed time and ETA), or, when stdout
  is not a terminal, one plain progress line every ~10 s;
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
from opd_cache.flow.demand import announce_demand
from opd_cache.launch.forkserver import ForkedStage, StageForkServer
from opd_cache.observe.metrics import read_metrics
from opd_cache.observe.progress import Every, duration
from opd_cache.storage.store import ShardTally, Store

# every stage is this command (`opd <stage> …` with this interpreter); the fork server starts exactly these
CLI = [sys.executable, "-m", "opd_cache.cli"]


@dataclass
class StageProcess:
    name: str  # e.g. "rollout-w00"
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | ForkedStage | None = None
    forkable: bool = True  # `python -m opd_cache.cli …` that the fork server may start (not a vLLM engine's)
    restarts: int = 0
    next_start: float = 0.0
    finished: bool = False  # exited 0
    failed: bool = False  # exited non-zero more often than allowed
    exit_codes: list[int] = field(default_factory=list)

    @property
    def can_fork(self) -> bool:
        """An `opd` command of this interpreter that the fork server may start (launch/forkserver.py)."""
        return self.forkable and self.argv[:3] == CLI

    def start(self, env: dict, server: StageForkServer | None = None) -> None:
        if server is not None and server.alive and self.can_fork:
            try:
                self.proc = server.start(self.argv[2], self.argv[3:], env, self.log_path)
                return
            except RuntimeError as e:  # the server is gone: a fresh interpreter, as without it
                print(f"opd run: {e}; starting {self.name} as a new process", file=sys.stderr)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )  # own process group: signals reach its children
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
    cfg.max_staleness = 0
    cfg.train.publish_every = 1
    # rollout pauses while backlog > max_buffer_samples: one row less than a batch makes it wait for the
    # next version after each batch (with `= batch` it samples a second batch of the old version, which expires)
    cfg.rollout.max_buffer_samples = max(batch - 1, 1)
    cfg.rollout.flush_rows = batch
    cfg.run.rollout_workers = 1
    return cfg


def stage_commands(cfg: Config, config_path: Path, logs: Path) -> list[StageProcess]:
    """The stage processes of a run: R rollout workers, A annotate workers per teacher, the trainer, an evaluator."""
    common = ["--config", str(config_path)]
    stages = []
    for w in range(cfg.run.rollout_workers):
        worker = f"w{w:02d}"
        stages.append(
            StageProcess(
                f"rollout-{worker}",
                [*CLI, "rollout", *common, "--worker-id", worker, "--follow"],
                logs / f"rollout-{worker}.log",
                forkable=cfg.rollout.engine != "vllm",  # vLLM starts engine processes of its own
            )
        )
    teachers = cfg.run.teachers or {cfg.annotate.teacher_name: cfg.annotate.teacher}
    for name, path in teachers.items():
        for i in range(cfg.run.annotate_workers):
            stages.append(
                StageProcess(
                    f"annotate-{name}-{i}",
                    [
                        *CLI,
                        "annotate",
                        *common,
                        "--teacher",
                        str(path),
                        "--teacher-name",
                        name,
                        "--set",
                        f"annotate.worker_id={name}-{i}",  # shards are claimed by leases (annotate/leases.py)
                        "--follow",
                    ],
                    logs / f"annotate-{name}-{i}.log",
                    forkable=cfg.annotate.engine != "vllm",
                )
            )
    stages.append(StageProcess("train", [*CLI, "train", *common, "--follow"], logs / "train.log"))
    if cfg.run.evaluate and cfg.eval.prompts:
        teacher = cfg.eval.teacher or next(iter(teachers.values()))
        if cfg.annotate.cross_tokenizer and not cfg.eval.teacher:
            teacher = None  # the evaluator's KL is per token: across tokenizers it reports accuracy only
        stages.append(StageProcess("eval", eval_command(cfg, config_path, teacher), logs / "eval.log"))
    return stages


def eval_command(cfg: Config, config_path: Path, teacher: str | os.PathLike | None) -> list[str]:
    """The evaluator of a run: every `run.eval_every`-th published version of the store, until train/DONE."""
    return [
        *[*CLI, "eval", "--model", cfg.store.uri],
        *["--follow", "--every", str(cfg.run.eval_every)],
        *["--config", str(config_path)],
        *(["--teacher", str(teacher)] if teacher is not None else []),
    ]


def read_run_state(
    store: Store, total_steps: int | None = None, started: float | None = None, tally: ShardTally | None = None
) -> dict:
    """What the dashboard and the plain progress lines show, read from the store alone.

    `started` (wall-clock `time.time()` of the run's start) gives the elapsed time; the ETA comes from the
    trainer's step rate over its metrics records of this run (all of them when `started` is not given).
    `tally` (kept across calls by `RunDisplay`) counts shards and parts with a window poll instead of two
    full listings, so the dashboard's cost does not grow with the run's history.
    """
    shards, parts = tally.poll() if tally is not None else (store.shards.rollouts(), store.shards.annotated_parts())
    progress = store.read_progress()
    metrics = read_metrics(store)
    train = metrics.get("train-0", [])
    evals = metrics.get("eval-0", [])
    step = progress.get("step", 0)
    # the step rate: this run's records (a resumed run's metrics also hold its earlier incarnations')
    recent = [r for r in train if started is None or r.get("time", 0) >= started] or train[-1:]
    eta = None
    if total_steps and len(recent) >= 2 and recent[-1]["step"] > recent[0]["step"]:
        seconds_per_step = (recent[-1]["time"] - recent[0]["time"]) / (recent[-1]["step"] - recent[0]["step"])
        eta = max(total_steps - step, 0) * seconds_per_step
    return {
        "shards": shards,
        "parts": parts,
        "metrics": metrics,
        "progress": progress,
        "step": step,
        "total_steps": total_steps,
        "last_train": train[-1] if train else {},
        "last_eval": evals[-1] if evals else None,
        "elapsed": time.time() - started if started is not None else None,
        "eta": eta,
    }


def staleness_text(histogram: dict) -> str:
    """{'2': 64, '0': 3} -> '0:3 2:64' (rows per version lag)."""
    return " ".join(f"{lag}:{rows}" for lag, rows in sorted(histogram.items(), key=lambda kv: int(kv[0])))


def eval_text(record: dict) -> str:
    return f"v{record['version']}: strict {record['strict']:.2f}, lenient {record['lenient']:.2f}" + (
        f", KL {record['kl']:.4f}" if record.get("kl") is not None else ""
    )


def step_text(state: dict) -> str:
    total = state["total_steps"]
    return f"step {state['step']}/{total}" if total else f"step {state['step']}"


def timing_text(state: dict) -> str:
    parts = []
    if state["elapsed"] is not None:
        parts.append(f"elapsed {duration(state['elapsed'])}")
    if state["eta"] is not None:
        parts.append(f"ETA {duration(state['eta'])}")
    return ", ".join(parts)


def stage_state(stage: StageProcess) -> str:
    if stage.failed:
        return "[red]failed[/]"
    if stage.finished:
        return "[green]finished[/]"
    if stage.proc is not None and stage.proc.poll() is None:
        return "running" + (f" (restart {stage.restarts})" if stage.restarts else "")
    if not stage.exit_codes:
        return "starting"  # not started yet
    return "waiting to restart"


def dashboard(
    store: Store,
    stages: list[StageProcess],
    total_steps: int | None = None,
    started: float | None = None,
    tally: ShardTally | None = None,
) -> Table:
    """One table from the store alone: what each stage has done so far."""
    table = Table(title=f"opd run — {store.uri}", expand=False)
    for col in ("stage", "state", "done so far"):
        table.add_column(col)
    try:
        state = read_run_state(store, total_steps, started, tally)
    except Exception as e:  # the dashboard must never take the run down
        table.add_row("store", "unreadable", str(e)[:80])
        return table
    shards, parts, metrics, progress, last = (
        state["shards"],
        state["parts"],
        state["metrics"],
        state["progress"],
        state["last_train"],
    )
    versions = sorted({s.policy_version for s in shards})
    rollout_rate = [
        r["tokens_per_s"]
        for name, rs in metrics.items()
        if name.startswith("rollout-")
        for r in rs[-1:]
        if "tokens_per_s" in r
    ]
    annotate_rate = [
        r["tokens_per_s"]
        for name, rs in metrics.items()
        if name.startswith("annotate-")
        for r in rs
        if r.get("event") == "annotated"
    ][-1:]
    timing = timing_text(state)
    summary = {
        "rollout": (
            f"{len(shards)} shards, versions {versions[0]}..{versions[-1]}"
            + (f", {sum(rollout_rate):.0f} tok/s" if rollout_rate else "")
        )
        if shards
        else "no shards yet",
        "annotate": (
            f"{sum(len(t) for t in parts.values())} parts over {len(parts)} shards"
            + (f", {annotate_rate[0]:.0f} tok/s" if annotate_rate else "")
        ),
        "train": (
            f"{step_text(state)}, version {progress.get('policy_version', 0)}, "
            f"{progress.get('consumed_samples', 0)} samples, {progress.get('expired_samples', 0)} expired"
            + (f", loss {last['loss']:.4f}" if last.get("loss") is not None else "")
            + (f", staleness {staleness_text(last['staleness'])}" if last.get("staleness") else "")
            + (f", {last['tokens_per_s']:.0f} tok/s" if last.get("tokens_per_s") else "")
            + (f"; {timing}" if timing else "")
        ),
        "eval": eval_text(state["last_eval"]) if state["last_eval"] else "—",
    }
    for stage in stages:
        table.add_row(stage.name, stage_state(stage), summary.get(stage.name.split("-")[0], ""))
    return table


def progress_line(
    store: Store,
    total_steps: int | None = None,
    started: float | None = None,
    stages: list[StageProcess] = (),
    tally: ShardTally | None = None,
) -> str:
    """One plain line for output that is not a terminal: steps, samples, loss, latest evaluation, ETA,
    and the stages that crashed (restarting or failed)."""
    try:
        state = read_run_state(store, total_steps, started, tally)
    except Exception as e:  # like the dashboard, never fatal
        return f"opd run: store unreadable ({str(e)[:80]})"
    last, progress = state["last_train"], state["progress"]
    parts = [step_text(state), f"{progress.get('consumed_samples', 0)} samples"]
    if last.get("loss") is not None:
        parts.append(f"loss {last['loss']:.4f}")
    if state["last_eval"]:
        parts.append(f"eval {eval_text(state['last_eval'])}")
    troubled = [
        f"{stage.name} failed" if stage.failed else f"{stage.name} restarted {stage.restarts}×"
        for stage in stages
        if stage.failed or (stage.restarts and not stage.finished)
    ]
    parts.extend(troubled)
    timing = timing_text(state)
    return "opd run: " + " | ".join(parts) + (f" | {timing}" if timing else "")


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
            failure = failure or (
                f"{stage.name} exited with status {code} {len(stage.exit_codes)} time(s); see {stage.log_path}"
            )
        else:
            stage.restarts += 1
            stage.next_start = now + min(2.0**stage.restarts, 30.0)
    return failure


def supervise(cfg: Config, config_path: Path, logs: Path, *, quiet: bool = False) -> int:
    """Run all stages until the trainer finishes; returns the exit status (0 = every stage succeeded)."""
    store = Store(cfg.store.uri, s3_endpoint=cfg.store.s3_endpoint)
    logs.mkdir(parents=True, exist_ok=True)
    stages = stage_commands(cfg, config_path, logs)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("OMP_NUM_THREADS", str(cfg.run.threads_per_stage))
    env.setdefault("COLUMNS", "200")  # a log file has no width: rich would wrap the stages' lines at 80 columns
    announce_demand(store, cfg.train, cfg.max_staleness)  # rollout paces on the trainer's schedule from the start
    forking = cfg.run.fork_stages and any(s.can_fork for s in stages)
    server = StageForkServer(env) if forking else None  # the stages' imports, once (launch/forkserver.py)
    for stage in stages:
        stage.start(env, server)

    stop = StopSignals()
    failure = None
    display = RunDisplay(store, stages, cfg.train.max_steps, quiet=quiet)
    try:
        with display:
            while not stop.requested:
                now = time.monotonic()
                failure = poll_stages(stages, now, cfg.run.max_restarts)  # the loop ends at the first
                for stage in stages:
                    if stage.proc is None and not stage.finished and not stage.failed and now >= stage.next_start:
                        stage.start(env, server)
                display.update()
                trainer = next(s for s in stages if s.name == "train")
                if failure or trainer.finished:
                    break
                time.sleep(0.5)
            # after the trainer: producers stop on DONE by themselves; the evaluator finishes the last version.
            # Nothing is restarted now, so a stage that exits with an error here has failed for good.
            deadline = time.monotonic() + (cfg.run.drain_seconds if not failure and not stop.requested else 10)
            while any(s.proc is not None for s in stages) and time.monotonic() < deadline:
                failed_now = poll_stages(stages, time.monotonic(), max_restarts=0)  # always: it retires exited stages
                failure = failure or failed_now
                display.update()
                time.sleep(0.5)
    finally:
        for stage in stages:
            stage.signal(signal.SIGTERM)
        if any(s.proc is not None and s.proc.poll() is None for s in stages):
            time.sleep(0.5)
        for stage in stages:
            stage.signal(signal.SIGKILL)
        if server is not None:
            server.close()  # after its children: their CPU reaches whoever waits for this process
        stop.restore()
    if failure:
        print(f"opd run: {failure}", file=sys.stderr)
        return 1
    if stop.requested:
        return 130
    return 0


class StopSignals:
    """SIGINT and SIGTERM ask the supervisor's loop to stop (it then stops every stage) instead of killing it
    on the spot; `restore()` puts the previous handlers back. Both launchers use it (here and ray_launcher.py)."""

    def __init__(self):
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._request) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _request(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class RunDisplay:
    """The run's progress on stdout: a live dashboard on a terminal; otherwise (CI, nohup, `| tee`) one plain
    line at the start, every ~10 s and at the end; nothing with `quiet`."""

    def __init__(self, store: Store, stages: list[StageProcess], total_steps: int, *, quiet: bool = False):
        self.store, self.stages, self.total_steps = store, stages, total_steps
        self.started = time.time()
        self.tally = ShardTally(store)  # one window poll per refresh, not two listings of the whole store
        self.quiet = quiet
        self.live = None
        self.plain = Every() if not quiet and not sys.stdout.isatty() else None

    def __enter__(self):
        if not self.quiet and self.plain is None:
            self.live = Live(
                self._table(), refresh_per_second=1, transient=False, redirect_stdout=False, auto_refresh=False
            )
            self.live.__enter__()
        return self

    def _table(self) -> Table:
        return dashboard(self.store, self.stages, self.total_steps, self.started, self.tally)

    def update(self) -> None:
        if self.live is not None:
            self.live.update(self._table(), refresh=True)
        elif self.plain is not None and self.plain.due():
            print(progress_line(self.store, self.total_steps, self.started, self.stages, self.tally), flush=True)

    def __exit__(self, *exc):
        if self.live is not None:
            return self.live.__exit__(*exc)
        if self.plain is not None:
            print(progress_line(self.store, self.total_steps, self.started, self.stages, self.tally), flush=True)
        return False


def write_resolved_config(cfg: Config, path: Path) -> Path:
    """The configuration every stage process reads (`--config`): the resolved one, complete, as YAML."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
