"""The chaos driver: rollout, annotate and train on one store, SIGKILLed again and again, restarted each time.

A run, top to bottom:

1. `chaos_config` writes a shortened tiny `opd run` configuration (tests/helpers.py's
   `tiny_run_config`, more steps, no evaluator, short polls).
2. `ChaosDriver.run` starts the stage processes with exactly the commands
   `opd run` uses (`opd_cache.launch.run.stage_commands`): rollout first, annotate and
   train once run.json exists, as `opd run` does.
3. It sends SIGKILL (to the stage's process group) in three ways, and restarts
   the killed stage at once with the same command:
   - *kill points*: hook/sitecustomize.py (on the stages' PYTHONPATH) stops a
     stage with SIGSTOP at a chosen moment of a store write — content written
     but the stream open, a complete `*.tmp-*` not yet renamed, a policy or
     state folder just renamed, a file just published — and the driver
     either kills it there or lets it go on (SIGCONT);
   - *tmp watch* (local stores): a new `*.tmp-*` file or folder appears in the
     store; its writer is killed 0–15 ms later, wherever it is by then;
   - *random*: at exponentially distributed intervals, a random stage,
     whatever it is doing (loading a model, sampling, training, waiting).
   Every decision comes from `random.Random(seed)`; the timing of the
   processes is not reproducible, so neither is the exact kill sequence.
   It also damages up to `corruptions` stored files (an annotated part, or a
   file of the newest resume state): bytes flipped or the file truncated,
   replaced atomically; the stages must notice, quarantine and recover.
4. While the stages run, it reads `policy/LATEST` every half second: it must
   always name a complete version and never move back.
5. It stops killing once it has sent `kills` SIGKILLs and met the quotas (per
   stage, per key kill point), and returns when the trainer has written
   train/DONE and every stage has exited 0. A stage that exits non-zero on
   its own is a failure (`ChaosFailure`, with the tail of its log).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opd_cache.config import Config, load_config
from opd_cache.launch.forkserver import StageForkServer
from opd_cache.launch.run import StageProcess, stage_commands
from opd_cache.storage import layout
from opd_cache.storage.store import TMP_MARKER, Store, StoreError, parse_shard_id
from tests.conftest import REPO
from tests.helpers import tiny_run_config, write_config

HOOK_DIR = Path(__file__).resolve().parent / "hook"
CORRUPT_RETRY_S = 0.25  # a file damage that found nothing to damage is tried again this soon

# Kill points the run must hit at least this many times (the point names are hook/sitecustomize.py's).
LOCAL_KEY_POINTS = {
    "rollout-shard:open": 1,  # a partial *.tmp-* shard
    "rollout-shard:before-rename": 2,  # a complete *.tmp-* shard, not visible yet
    "annotated-part:open": 1,
    "annotated-part:before-rename": 2,
    "policy:before-rename": 1,  # policy/vN.tmp-* copied, not renamed
    "policy:after-rename": 1,  # policy/vN complete, LATEST still older
    "policy-latest:before-rename": 1,
    "train-state:saved-locally": 1,  # DCP wrote step-N.tmp-save; no trainer.json, no marker yet
    "train-state:before-rename": 1,  # complete step-N.tmp-save, not renamed
    "train-state:after-rename": 1,  # step-N in place, old states not deleted yet
    "policy:deleting": 1,  # retention removed an old version's _COMPLETE, its files not yet
    "ledger:published": 1,  # step ledger written; publication, progress and state not yet
    "done-marker:open": 1,
}
# On object stores nothing is renamed: a write is visible once its upload completes.
S3_KEY_POINTS = {
    "rollout-shard:open": 2,  # the shard serialized, not uploaded
    "annotated-part:open": 2,
    "policy:open": 1,  # a file of policy/vN not uploaded, maybe others before it
    "policy:published": 1,  # some files of policy/vN uploaded (maybe _COMPLETE too), LATEST older
    "policy-latest:open": 1,
    "train-state:saved-locally": 1,  # DCP wrote the local folder, nothing uploaded
    "train-state:published": 1,  # some files of train/state/step-N uploaded
    "policy:deleting": 1,  # retention removed an old version's _COMPLETE, its files not yet
    "ledger:published": 1,
    "done-marker:open": 1,
}
# Probability that the hook stops a stage at a kill point of this kind of file.
PAUSE_PROBABILITIES = {
    "rollout-shard": 0.5,
    "annotated-part": 0.5,
    "policy": 0.5,
    "policy-latest": 0.5,
    "train-state": 0.6,
    "ledger": 0.3,
    "skipped-ledger": 0.5,
    "progress": 0.15,
    "done-marker": 1.0,
    "run-manifest": 0.3,
    "metrics": 0.05,
    "*": 0.05,
}


class ChaosFailure(AssertionError):
    """A stage failed on its own, LATEST named an incomplete version or moved back, or the run timed out."""


@dataclass
class ChaosSettings:
    seed: int
    kills: int = 30  # SIGKILLs to send at least
    min_kills_per_stage: int = 5  # each of rollout, annotate, train
    key_points: dict[str, int] = field(default_factory=lambda: dict(LOCAL_KEY_POINTS))
    random_interval_s: float = 4.0  # mean time between random kills
    kill_at_pause: float = 0.25  # probability of killing at a non-key kill point (while kills are wanted)
    kill_at_tmp: float = 0.3  # probability of killing the writer of a newly seen *.tmp-*
    timeout_s: float = 1500.0  # generous: on a busy 2-core machine one restart takes 20-40 s
    corruptions: int = 3  # stored files damaged during the run (flipped bytes or truncation), at most
    # mean time between two of them: the local run takes ~30 s since its restarts are forks (launch/forkserver.py);
    # at 15 s a run could end before any file was damaged
    corrupt_interval_s: float = 4.0


@dataclass
class Kill:
    seconds: float  # since the start of the run
    stage: str  # rollout | annotate | train
    point: str  # a kill point, "tmp-seen:<kind>", "random:working" or "random:starting"


@dataclass
class ChaosReport:
    seed: int
    seconds: float = 0.0
    kills: list[Kill] = field(default_factory=list)
    starts: Counter = field(default_factory=Counter)  # process starts per stage name
    pauses: int = 0  # kill points at which a stage was stopped (killed or resumed)
    latest_seen: list[int] = field(default_factory=list)  # distinct LATEST values, in order
    corrupted: list[dict] = field(default_factory=list)  # {"seconds", "rel", "how"} of each damaged file

    def per_stage(self) -> Counter:
        return Counter(k.stage for k in self.kills)

    def per_point(self) -> Counter:
        return Counter(k.point for k in self.kills)

    def summary(self) -> str:
        seconds = self.seconds or (self.kills[-1].seconds if self.kills else 0.0)
        lines = [
            f"seed {self.seed}: {len(self.kills)} kills in {seconds:.0f} s, {self.pauses} pauses, "
            f"LATEST {self.latest_seen}",
            "  per stage: " + ", ".join(f"{k} {v}" for k, v in sorted(self.per_stage().items())),
            "  per point: " + ", ".join(f"{k} {v}" for k, v in sorted(self.per_point().items())),
            "  starts: " + ", ".join(f"{k} {v}" for k, v in sorted(self.starts.items())),
            "  damaged: " + ", ".join(f"{c['rel']} ({c['how']})" for c in self.corrupted),
        ]
        return "\n".join(lines)


def chaos_config(
    workdir: Path,
    store_uri: str,
    *,
    s3_endpoint: str | None = None,
    max_steps: int = 20,
    cross_tokenizer: bool = False,
) -> Path:
    """The tiny `opd run` configuration, shortened for killing: small shards, frequent versions and states.

    `cross_tokenizer`: the BPE student of examples/arithmetic_xtok_cpu under the character teacher (issue #27),
    so annotate aligns two tokenizations and the parts carry `target_flags` through every kill."""
    pair = {}
    if cross_tokenizer:
        pair = {
            "rollout": {"student": str(REPO / "data/models/student_bpe")},
            "annotate": {"cross_tokenizer": True, "cross_tokenizer_topk": "group_start"},
        }
    config = tiny_run_config(
        store_uri,
        steps=max_steps,
        batch=16,
        poll_seconds=0.2,
        # save_every 3 vs publish_every 2: kills between a publication and the next state are common, so the
        # resumed trainer retrains steps whose version is already published. max_staleness 1 makes rows expire.
        max_staleness=1,
        store={"s3_endpoint": s3_endpoint} if s3_endpoint else {},
        train={
            "save_every": 3,
            "keep_states": 2,
            "keep_versions": 3,  # retention deletes 7 of the 10 versions while the stages are killed
        },
        **pair,
    )
    return write_config(workdir, config)


def _stage_kind(name: str) -> str:
    return name.split("-")[0]


def _stage_of_point(point: str) -> str:
    """The stage that writes the files of a kill point (rollout shards, annotated parts; the rest: the trainer)."""
    return {"rollout-shard": "rollout", "annotated-part": "annotate"}.get(point.split(":")[0], "train")


def _is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP): the state letter of /proc/<pid>/stat is T."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


class ChaosDriver:
    def __init__(self, config_path: Path, workdir: Path, settings: ChaosSettings, env: dict | None = None):
        self.config_path, self.workdir, self.settings = config_path, workdir, settings
        self.cfg: Config = load_config(config_path)
        self.store = Store(self.cfg.store.uri, s3_endpoint=self.cfg.store.s3_endpoint)
        self.logs = workdir / "logs"
        self.pause_dir = workdir / "pauses"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pause_dir.mkdir(parents=True, exist_ok=True)
        self.stages: list[StageProcess] = stage_commands(self.cfg, config_path, self.logs)
        self.rng = random.Random(settings.seed)
        self.report = ChaosReport(seed=settings.seed)
        pythonpath = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {
            **os.environ,
            **(env or {}),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": pythonpath,
            "OPD_CHAOS_DIR": str(self.pause_dir),
            "OPD_CHAOS_STORE_ROOT": self.store.root if self.store.is_local else "",
            "OPD_CHAOS_SEED": str(settings.seed),
            "OPD_CHAOS_PAUSE": ",".join(f"{k}={v}" for k, v in PAUSE_PROBABILITIES.items()),
        }
        self._t0 = 0.0
        self._started_at: dict[str, float] = {}
        self._tmp_seen: set[str] = set()
        self.pristine = workdir / "pristine"  # each damaged file's bytes before the damage
        self._annotated_done: set[str] = set()  # annotated/<version>/<shard> folders whose part exists (no tmp)
        self.fork_server: StageForkServer | None = None  # as `opd run` starts its stages (launch/forkserver.py)

    # ------------------------------------------------------------ processes
    def _start(self, stage: StageProcess) -> None:
        if self.cfg.run.fork_stages and self.fork_server is None and stage.can_fork:
            self.fork_server = StageForkServer(self.env)  # the hook is imported there once, like the modules
        stage.start(self.env, self.fork_server)
        self.report.starts[stage.name] += 1
        self._started_at[stage.name] = time.monotonic()

    def _kill(self, stage: StageProcess, point: str) -> None:
        """SIGKILL the stage's process group, record it, and start the same command again."""
        proc = stage.proc
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        self._forget_pause(proc.pid)
        kill = Kill(round(time.monotonic() - self._t0, 2), _stage_kind(stage.name), point)
        self.report.kills.append(kill)
        with open(self.workdir / "kills.jsonl", "a") as f:  # to follow a run while it goes
            f.write(json.dumps(asdict(kill)) + "\n")
        self._write_owed()
        self._start(stage)

    def _write_owed(self) -> None:
        """The key points still short of their quota, for the hook: it pauses at them every time (atomically
        replaced: a stage reads it at every kill point)."""
        per_point = self.report.per_point()
        owed = [p for p, n in self.settings.key_points.items() if per_point[p] < n]
        (self.pause_dir / "owed.new").write_text("\n".join(owed) + "\n")
        os.replace(self.pause_dir / "owed.new", self.pause_dir / "owed")

    def _forget_pause(self, pid: int) -> None:
        for name in (f"pause-{pid}", f"up-{pid}"):
            try:
                os.unlink(self.pause_dir / name)
            except FileNotFoundError:
                pass

    def _is_up(self, stage: StageProcess) -> bool:
        """Past start-up (imports, model loading): it has written to the store since it started, or ran 60 s."""
        return (self.pause_dir / f"up-{stage.proc.pid}").exists() or time.monotonic() - self._started_at[
            stage.name
        ] > 60.0

    def _running(self, kind: str | None = None) -> list[StageProcess]:
        return [
            s
            for s in self.stages
            if s.proc is not None and s.proc.poll() is None and (kind is None or _stage_kind(s.name) == kind)
        ]

    # ------------------------------------------------------------ what to kill
    def _quotas_met(self) -> bool:
        per_stage, per_point = self.report.per_stage(), self.report.per_point()
        return (
            len(self.report.kills) >= self.settings.kills
            and all(per_stage[k] >= self.settings.min_kills_per_stage for k in ("rollout", "annotate", "train"))
            and all(per_point[p] >= n for p, n in self.settings.key_points.items())
        )

    def _extra_kills_left(self) -> bool:
        """Kills beyond the key points' quotas are still wanted (the quotas' remaining kills are reserved)."""
        per_point = self.report.per_point()
        reserved = sum(max(0, n - per_point[p]) for p, n in self.settings.key_points.items())
        return len(self.report.kills) + reserved < self.settings.kills

    def _want_kill_at(self, kind: str, point: str) -> bool:
        if self._quotas_met() or self.store.is_done():
            return False
        if self.report.per_point()[point] < self.settings.key_points.get(point, 0):
            return True  # some points come once per run (done-marker): never let one pass
        if point.startswith("done-marker") and len(self.report.kills) < self.settings.kills:
            # the run's last kill point: the kills still owed are sent here (each restart comes back to it), not
            # lost with the run's end (a run at load 8 ended after 29 of its 30)
            return True
        if self._extra_kills_left():
            # the trainer's restarts are the run's critical path (one trainer): spend extra kills elsewhere
            return self.rng.random() < self.settings.kill_at_pause * (0.2 if kind == "train" else 1.0)
        return False

    def _handle_pauses(self) -> None:
        for stage in self._running():
            pid = stage.proc.pid
            if not _is_stopped(pid):
                continue
            try:
                point = (self.pause_dir / f"pause-{pid}").read_text().strip()
            except FileNotFoundError:
                point = "unknown"
            self.report.pauses += 1
            if self._want_kill_at(_stage_kind(stage.name), point):
                self._kill(stage, point)
            else:
                try:
                    os.unlink(self.pause_dir / f"pause-{pid}")
                except FileNotFoundError:
                    pass
                os.kill(pid, signal.SIGCONT)

    def _new_tmp_paths(self) -> list[str]:
        """Store-relative paths of `*.tmp-*` files and folders not seen before (local stores)."""
        root = Path(self.store.root)
        folders = ["policy", "train/state"]  # publications, resume states; shard writes: their version partitions
        rollouts = root / "rollouts"
        if rollouts.is_dir():
            folders += [f"rollouts/{entry.name}" for entry in os.scandir(rollouts) if entry.is_dir()]
        annotated = root / "annotated"
        if annotated.is_dir():
            for partition in os.scandir(annotated):
                if not partition.is_dir():
                    continue
                for entry in os.scandir(partition.path):
                    if f"{partition.name}/{entry.name}" not in self._annotated_done:
                        folders.append(f"annotated/{partition.name}/{entry.name}")
        found = []
        for folder in folders:
            try:
                entries = list(os.scandir(root / folder))
            except FileNotFoundError:
                continue
            names = [e.name for e in entries]
            if folder.startswith("annotated/") and any(n.endswith(".arrow") for n in names):
                self._annotated_done.add(folder.split("/", 1)[1])
            for name in names:
                rel = f"{folder}/{name}"
                if TMP_MARKER in name and rel not in self._tmp_seen:
                    self._tmp_seen.add(rel)
                    found.append(rel)
        return found

    def _writer_of(self, rel: str) -> StageProcess | None:
        if rel.startswith("rollouts/"):
            worker = parse_shard_id(rel.split("/")[2].split(".")[0])[1]  # rollouts/v<version>/<shard>.arrow.tmp-*
            names = [f"rollout-{worker}"]
        elif rel.startswith("annotated/"):
            names = [s.name for s in self.stages if s.name.startswith("annotate-")]
        else:
            names = ["train"]
        candidates = [s for s in self._running() if s.name in names]
        return self.rng.choice(candidates) if candidates else None

    def _watch_tmp(self) -> None:
        for rel in self._new_tmp_paths():
            if not self._extra_kills_left() or self.store.is_done():
                continue
            if self.rng.random() >= self.settings.kill_at_tmp:
                continue
            stage = self._writer_of(rel)
            if stage is None:
                continue
            time.sleep(self.rng.uniform(0.0, 0.015))
            if stage.proc.poll() is None:
                kind = rel.split("/")[0] if not rel.startswith("train/") else rel.split("/")[1]
                self._kill(stage, f"tmp-seen:{kind}")

    def _random_kill(self) -> None:
        """Kill a random stage at work (one in twenty: at start-up); stages under their quota first."""
        if self.store.is_done():
            return
        # a stage is behind when its kills so far plus the key-point kills it still has coming miss its quota
        projected, per_point = self.report.per_stage(), self.report.per_point()
        for point, n in self.settings.key_points.items():
            projected[_stage_of_point(point)] += max(0, n - per_point[point])
        behind = [k for k in ("rollout", "annotate", "train") if projected[k] < self.settings.min_kills_per_stage]
        if not behind and not self._extra_kills_left():
            return
        kinds = behind or self.rng.choices(["rollout", "annotate", "train"], weights=[0.4, 0.4, 0.2])
        running = [s for s in self._running() if _stage_kind(s.name) in kinds]
        # a kill during start-up (imports, model loading) costs a whole restart and shows little: rarely
        pool = running if self.rng.random() < 0.05 else [s for s in running if self._is_up(s)]
        if pool:
            stage = self.rng.choice(pool)
            self._kill(stage, "random:working" if self._is_up(stage) else "random:starting")

    # ------------------------------------------------------------ damaged bytes
    def _corrupt_random_file(self) -> bool:
        """Damage one stored file: an annotated part already trained, or a file of the newest resume state
        (while another complete state is intact, so that there is one to fall back to); False if none is there.

        The damaged copy replaces the file atomically (a new file, as a bad copy or a re-replicated object
        leaves it): a reader that has the old file open keeps the bytes it verified. Rollout shards (their rows
        are lost by design) and policy versions are covered by tests/test_integrity.py instead.
        """
        from opd_cache.storage.layout import state_dir
        from opd_cache.train.checkpoint import complete_states

        states = complete_states(self.store)
        # Parts of shards finished before the oldest complete state: no resume reads them again (a resumed
        # trainer that skipped a quarantined part would train its steps in another order than the versions
        # already published, which the replay check below would rightly refuse; see docs/reliability.md).
        try:
            finished = (
                set(json.loads(self.store.read_bytes(f"{state_dir(states[0])}/trainer.json"))["cursor"]["finished"])
                if states
                else set()
            )
        except (FileNotFoundError, ValueError, KeyError):
            finished = set()
        candidates = [
            layout.annotated_path(shard, teacher)
            for shard, teachers in self.store.shards.annotated_parts().items()
            if shard in finished
            for teacher in teachers
        ]
        damaged_states = {c["rel"].rsplit("/", 1)[0] for c in self.report.corrupted if c["rel"].startswith("train/")}
        if len(states) >= 2 and not damaged_states & {state_dir(s) for s in states}:
            newest = state_dir(states[-1])
            candidates += [
                f"{newest}/{info.base_name}"
                for info in self.store.list_files(newest)
                if info.base_name not in ("_COMPLETE", "_CHECKSUMS.json")
            ]
        done = {c["rel"] for c in self.report.corrupted}
        candidates = sorted(set(candidates) - done)
        if not candidates:
            return False
        rel = self.rng.choice(candidates)
        try:
            data = self.store.read_bytes(rel)
        except FileNotFoundError:
            return False  # quarantined or deleted since the listing
        how = self.rng.choice(["flip", "truncate"])
        if how == "truncate" or len(data) < 2:
            damaged = data[: self.rng.randrange(0, max(1, len(data)))]
        else:
            buf = bytearray(data)
            at = self.rng.randrange(len(buf))
            for i in range(at, min(at + 8, len(buf))):
                buf[i] ^= 0xFF
            damaged = bytes(buf)
        (self.pristine / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.pristine / rel).write_bytes(data)
        self.store.write_bytes(rel, damaged)
        self.report.corrupted.append({"seconds": round(time.monotonic() - self._t0, 2), "rel": rel, "how": how})
        return True

    # ------------------------------------------------------------ LATEST
    def _check_latest(self) -> None:
        try:
            latest = self.store.latest_version()
        except StoreError as e:
            raise ChaosFailure(f"policy/LATEST names an incomplete version: {e}") from e
        seen = self.report.latest_seen
        if seen and latest < seen[-1]:
            raise ChaosFailure(f"policy/LATEST moved back from {seen[-1]} to {latest}")
        if not seen or latest != seen[-1]:
            seen.append(latest)

    # ------------------------------------------------------------ the faults' schedule (seeded)
    def _start_fault_clocks(self) -> None:
        """When the first random kill and the first file damage fall due: the same schedule for the same seed."""
        self._t0 = time.monotonic()
        self._next_random = self._t0 + self.rng.expovariate(1.0 / self.settings.random_interval_s)
        self._next_latest = 0.0
        self._next_corrupt = self._t0 + self.rng.expovariate(1.0 / self.settings.corrupt_interval_s)

    def _faults_and_checks(self, now: float) -> None:
        """One turn of a driver's loop: the temp-file watch, and the random kill, LATEST check and file damage
        whose time has come."""
        if self.store.is_local:
            self._watch_tmp()
        if now >= self._next_random:
            self._random_kill()
            self._next_random = now + self.rng.expovariate(1.0 / self.settings.random_interval_s)
        if now >= self._next_latest:
            self._check_latest()
            self._next_latest = now + 0.5
        if (
            now >= self._next_corrupt
            and len(self.report.corrupted) < self.settings.corruptions
            and not self.store.is_done()
        ):
            # nothing to damage yet (no resume state so far): look again shortly, not a whole interval later — a
            # run of the fast stages can end within a few intervals (seed 1 once finished in 20 s with none)
            damaged = self._corrupt_random_file()
            wait = self.rng.expovariate(1.0 / self.settings.corrupt_interval_s) if damaged else CORRUPT_RETRY_S
            self._next_corrupt = now + wait

    # ------------------------------------------------------------ the run
    def run(self) -> ChaosReport:
        self._write_owed()
        self._start_fault_clocks()
        finished: set[str] = set()
        have_run = False
        try:
            while True:
                now = time.monotonic()
                if now - self._t0 > self.settings.timeout_s:
                    raise ChaosFailure(
                        f"the chaos run did not finish in {self.settings.timeout_s:.0f} s; "
                        f"{self.report.summary()}\n{self._log_tails()}"
                    )
                have_run = have_run or self.store.exists("run.json")
                for stage in self.stages:
                    if stage.name in finished:
                        continue
                    if stage.proc is None:
                        if _stage_kind(stage.name) == "rollout" or have_run:
                            self._start(stage)
                        continue
                    code = stage.proc.poll()
                    if code is None:
                        continue
                    self._forget_pause(stage.proc.pid)
                    if code != 0:
                        raise ChaosFailure(
                            f"{stage.name} exited with status {code} on its own:\n{self._log_tail(stage)}"
                        )
                    if not self.store.is_done():
                        raise ChaosFailure(
                            f"{stage.name} exited 0 but train/DONE does not exist:\n{self._log_tail(stage)}"
                        )
                    finished.add(stage.name)
                    stage.proc = None
                if len(finished) == len(self.stages):
                    break
                self._handle_pauses()
                self._faults_and_checks(now)
                time.sleep(0.015)
            self._check_latest()
        finally:
            for stage in self.stages:
                if stage.proc is not None and stage.proc.poll() is None:
                    try:
                        os.killpg(stage.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    stage.proc.wait()
            if self.fork_server is not None:
                self.fork_server.close()
        self.report.seconds = time.monotonic() - self._t0
        return self.report

    def _log_tail(self, stage: StageProcess, lines: int = 25) -> str:
        try:
            text = stage.log_path.read_text(errors="replace").strip().splitlines()
        except FileNotFoundError:
            return f"({stage.log_path} missing)"
        return f"--- {stage.log_path} ---\n" + "\n".join(text[-lines:])

    def _log_tails(self) -> str:
        return "\n".join(self._log_tail(s, 8) for s in self.stages)


def run_chaos(
    workdir: Path,
    store_uri: str,
    seed: int,
    *,
    s3_endpoint: str | None = None,
    max_steps: int = 20,
    env: dict | None = None,
    cross_tokenizer: bool = False,
    **settings,
) -> tuple[Path, ChaosReport]:
    """Write the configuration, run the driver; returns (config path, report)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = chaos_config(
        workdir, store_uri, s3_endpoint=s3_endpoint, max_steps=max_steps, cross_tokenizer=cross_tokenizer
    )
    if s3_endpoint and "key_points" not in settings:
        settings["key_points"] = dict(S3_KEY_POINTS)
    report = ChaosDriver(config, workdir, ChaosSettings(seed=seed, **settings), env=env).run()
    return config, report
