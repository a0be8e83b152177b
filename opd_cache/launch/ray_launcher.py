"""`opd run --launcher ray`: the same stage commands as `opd run`, each run by a Ray actor (docs/scale-out.md).

Every stage worker is an actor (ray_actor.py) that runs the stage's usual command (`python -m opd_cache.cli
<stage> …`, the argv of `opd_cache.launch.run.stage_commands`) as its child process, so a stage behaves exactly as
under the local launcher or on a hand-started machine. Why a child and not the stage in the actor's own
process: the stages own their process (signal handlers, torch threads, `torch.distributed` state, CUDA
context), and a restart must start from a clean one. The child dies with its actor (PR_SET_PDEATHSIG), and
the actor dies with its child (a non-zero exit ends the actor), so for Ray "the worker died" is one event:

- rollout, annotate and the evaluator are actors with the resources of their `ray.<stage>` section and
  `max_restarts = run.max_restarts`: Ray restarts a dead one (killed, OOM, its node lost) and re-runs it;
- the trainer is `ray.train_world_size` rank actors in one placement group (a torchrun equivalent: RANK,
  WORLD_SIZE, MASTER_ADDR/PORT for FSDP2; each rank sees only its own GPUs, so LOCAL_RANK is 0). A dead rank
  takes its peers down, so the launcher restarts the whole group (it resumes from its newest state);
- `opd scale S --annotate-workers N --rollout-workers M` writes `launch/scale.json`; the launcher reads it every
  `ray.scale_poll_seconds` and adds or removes workers while the run goes on. A removed worker is stopped as by
  Ctrl-C (`retire`): rollout flushes its rows, annotate releases its shard lease (annotate/leases.py), which
  another worker takes at once; one that does not stop within RETIRE_SECONDS is killed, and its lease expires.
- a one-machine Ray started here listens on 127.0.0.1 only (`bind_ray_to_loopback`).

Nothing goes between the stages except the store, so the dashboard and `opd report` are unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import opd_cache
from opd_cache.config import Config, StageResources
from opd_cache.flow.demand import announce_demand
from opd_cache.launch.ray_actor import StageWorker
from opd_cache.launch.run import RunDisplay, StopSignals, stage_commands
from opd_cache.storage.store import Store, StoreError

SCALE_FILE = "launch/scale.json"  # {"rollout": R, "annotate": A}: written by `opd scale`, read by the launcher
RETIRE_SECONDS = 30.0  # a worker scaled away has this long to stop cleanly after its SIGINT, then it is killed
MAX_SCALE_UP = 8  # a one-machine Ray started by the launcher has CPU tokens for this many extra workers per stage
PASSED_ENV = ("AWS_", "OPD_", "HF_", "TRANSFORMERS_", "WANDB_")  # what the stages read from the environment


def bind_ray_to_loopback() -> None:
    """Make the one-machine Ray that `ray.init` starts listen on 127.0.0.1 only (call before `ray.init`).

    `ray.init(_node_ip_address="127.0.0.1")` alone does not: Ray turns a loopback node address into the
    machine's external one (ray/_private/services.py `resolve_ip_for_localhost`, via `get_node_ip_address`)
    unless multi-machine clusters are off, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (the default on macOS and
    Windows). With the node address 127.0.0.1 every Ray server binds to it instead of 0.0.0.0: the GCS
    (src/ray/gcs/gcs_server.cc, `rpc_server_(…, config.node_ip_address == "127.0.0.1", …)`), the raylet, each
    worker's core-worker server (core_worker.cc, `options_.node_ip_address == "127.0.0.1"`), and the
    runtime-env agent binds the node address itself. tests/test_ray_loopback.py lists the listening sockets.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the processes Ray starts read it when they import ray
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process read it when it imported ray


# the logger of Ray's notice "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to
# opt out ..." (ray/_private/authentication/authentication_token_setup.py), printed by every ray.init that starts
# a new one-machine cluster
RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def quiet_token_auth_notice():
    """Hide Ray's token-authentication notice while the launcher starts its one-machine Ray: that cluster listens
    on 127.0.0.1 only (bind_ray_to_loopback) and Ray's token auth stays as Ray sets it; the notice, a warning
    about a choice the user never made, came first in every `opd run --launcher ray` output. Ray's errors show."""
    logger = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def check_store_reachable(store: Store, nodes: int, shared_filesystem: bool) -> None:
    """A local-directory store on a cluster of several nodes: the other nodes cannot see it."""
    if nodes > 1 and store.on_this_machine and not shared_filesystem:
        raise StoreError(
            f"--launcher ray: the cluster has {nodes} nodes but the store {store.uri} is a local "
            f"directory that the other nodes cannot see; use s3://… (or gs://…), or set "
            f"ray.shared_filesystem=true if {store.uri} is a shared filesystem mounted on every node"
        )


@dataclass
class RayStage:
    """One stage worker (or the trainer's rank group) as the launcher and the dashboard see it."""

    name: str
    argv: list[str]
    log_path: Path
    resources: StageResources
    world_size: int = 1  # > 1: trainer ranks in a placement group
    ray_restarts: int = 0  # Ray's max_restarts for the actor (the trainer group is restarted by the launcher)
    actors: list = field(default_factory=list)
    refs: list = field(default_factory=list)
    placement_group: object = None
    restarts: int = 0
    next_start: float = 0.0
    finished: bool = False
    failed: bool = False
    exit_codes: list[int] = field(default_factory=list)
    removed: bool = False  # scaled away
    retire_by: float = 0.0  # scaled away: killed at this time unless its command has stopped by then

    @property
    def proc(self):  # the dashboard's `stage_state` asks `stage.proc.poll()`
        return self if self.refs else None

    def poll(self):
        return None

    def incarnations(self) -> int:
        """How often the actor started its command (Ray's restarts included), from its `.pids` file."""
        pids = self.log_path.with_suffix(".pids")
        return len(pids.read_text().splitlines()) if pids.exists() else 0


class RayLauncher:
    def __init__(self, cfg: Config, config_path: Path, logs: Path):
        import ray

        self.ray, self.cfg, self.config_path, self.logs = ray, cfg, config_path.resolve(), logs.resolve()
        self.config_text = self.config_path.read_text()
        self.store = Store(cfg.store.uri, s3_endpoint=cfg.store.s3_endpoint)
        self.env = {
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(cfg.run.threads_per_stage)),
            "COLUMNS": "200",
        }
        self.stages: list[RayStage] = []
        self.scale_seen: dict | None = None
        self.next_scale_check = 0.0

    # ---------------------------------------------------------------- cluster
    def connect(self) -> None:
        """Join `ray.address`, or start a one-machine Ray bound to 127.0.0.1; refuse a local store on many nodes."""
        ray, cfg = self.ray, self.cfg
        package_root = str(Path(opd_cache.__file__).resolve().parents[1])
        pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        passed = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV)}
        runtime_env = {"env_vars": {**passed, "PYTHONPATH": pythonpath}}  # actors import this tree's opd_cache
        if cfg.ray.address:
            if cfg.ray.address.split("://")[-1].rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
                bind_ray_to_loopback()  # a cluster on this machine's loopback (tests): this driver's server too
            ray.init(address=cfg.ray.address, runtime_env=runtime_env, log_to_driver=False)
        else:
            # logical CPUs (scheduling tokens, not cores): the configured stages, and room for `opd scale` to add
            # up to MAX_SCALE_UP more workers per stage; the stages share the cores as under the local launcher
            stages = [cfg.ray.rollout] * cfg.run.rollout_workers + [cfg.ray.annotate] * cfg.run.annotate_workers
            stages += [cfg.ray.rollout, cfg.ray.annotate] * MAX_SCALE_UP + [cfg.ray.eval]
            wanted = sum(r.num_cpus for r in stages) + cfg.ray.train.num_cpus * cfg.ray.train_world_size
            bind_ray_to_loopback()  # one machine: nothing listens beyond 127.0.0.1
            with quiet_token_auth_notice():
                ray.init(
                    num_cpus=max(os.cpu_count() or 1, int(wanted + 0.999)),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    runtime_env=runtime_env,
                    log_to_driver=False,
                )
        check_store_reachable(self.store, len([n for n in ray.nodes() if n.get("Alive")]), cfg.ray.shared_filesystem)

    # ---------------------------------------------------------------- stages
    def stage_for(self, name: str, argv: list[str], log_path: Path) -> RayStage:
        kind = name.split("-")[0]
        resources = getattr(self.cfg.ray, kind)
        if kind == "train":
            return RayStage(name, argv, log_path, resources, world_size=self.cfg.ray.train_world_size)
        return RayStage(name, argv, log_path, resources, ray_restarts=self.cfg.run.max_restarts)

    def create(self, stage: RayStage) -> None:
        """The stage's actors, before its command may start: Ray starts their worker processes meanwhile."""
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = stage.resources
        # max_concurrency 2: `interrupt` (scale-down) can reach the actor while its `run` waits for the command
        options = dict(num_cpus=res.num_cpus, num_gpus=res.num_gpus, resources=dict(res.resources), max_concurrency=2)
        actor_cls = ray.remote(StageWorker)
        if stage.world_size == 1 and stage.ray_restarts:
            options.update(max_restarts=stage.ray_restarts, max_task_retries=stage.ray_restarts)
        if stage.world_size > 1:
            bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {}), **res.resources}
            stage.placement_group = ray.util.placement_group([bundle] * stage.world_size, strategy="PACK")
            ray.get(stage.placement_group.ready())
        stage.actors = []
        for rank in range(stage.world_size):
            rank_options = dict(options)
            if stage.placement_group is not None:
                rank_options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    stage.placement_group, placement_group_bundle_index=rank
                )
            log = stage.log_path if stage.world_size == 1 else stage.log_path.with_name(f"{stage.name}-{rank}.log")
            stage.actors.append(
                actor_cls.options(**rank_options).remote(
                    stage.name, stage.argv, str(log), str(self.config_path), self.config_text, self.env
                )
            )

    def start(self, stage: RayStage) -> None:
        """Run the stage's command in its actors (created here unless `create` did it already)."""
        ray = self.ray
        if not stage.actors:
            self.create(stage)
        if stage.world_size == 1:
            stage.refs = [stage.actors[0].run.remote()]
            return
        # torchrun's environment: rank 0's node and a free port there are the rendezvous point
        master = ray.get(stage.actors[0].node_ip.remote())
        port = ray.get(stage.actors[0].free_port.remote())
        stage.refs = [
            actor.run.remote(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(stage.world_size),
                    "LOCAL_RANK": "0",  # Ray gives each rank only its own GPUs
                    "MASTER_ADDR": master,
                    "MASTER_PORT": str(port),
                }
            )
            for rank, actor in enumerate(stage.actors)
        ]

    def stop(self, stage: RayStage) -> None:
        for actor in stage.actors:
            self.ray.kill(actor, no_restart=True)
        if stage.placement_group is not None:
            self.ray.util.remove_placement_group(stage.placement_group)
        stage.actors, stage.refs, stage.placement_group = [], [], None

    def poll(self, stage: RayStage, now: float, max_restarts: int) -> str | None:
        """Record a stage that ended: exit 0 (every rank), or dead for good; the trainer group is restarted here."""
        if not stage.refs:
            return None
        done, _ = self.ray.wait(stage.refs, num_returns=len(stage.refs), timeout=0)
        if stage.removed:  # scaled away: stopped on its own after `retire`, or killed now for not stopping in time
            if done or now >= stage.retire_by:
                self.stop(stage)
            return None
        errors = []
        for ref in done:
            try:
                self.ray.get(ref)
            except Exception as e:  # RayActorError: the actor died and Ray's restarts (if any) are spent
                errors.append(e)
        if not errors and len(done) < len(stage.refs):
            return None
        self.stop(stage)
        stage.exit_codes.append(1 if errors else 0)
        if not errors:
            stage.finished = True
        elif stage.ray_restarts or stage.restarts >= max_restarts:
            stage.failed = True
            return f"{stage.name} died {stage.incarnations()} time(s); see {stage.log_path}"
        else:  # the trainer group: every rank again, from the newest resume state
            stage.restarts += 1
            stage.next_start = now + min(2.0**stage.restarts, 30.0)
        return None

    # ---------------------------------------------------------------- elastic counts
    def apply_scale(self) -> None:
        """Match the rollout / annotate worker counts to `launch/scale.json` (`opd scale`)."""
        desired = self.store.read_json(SCALE_FILE, default=None)
        if not isinstance(desired, dict) or desired == self.scale_seen:
            return
        self.scale_seen = desired
        cfg = self.cfg
        if "rollout" in desired:
            cfg.run.rollout_workers = int(desired["rollout"])
        if "annotate" in desired:
            cfg.run.annotate_workers = int(desired["annotate"])
        wanted = {s.name: s for s in stage_commands(cfg, self.config_path, self.logs)}
        for stage in self.stages:
            if stage.name not in wanted and not stage.removed and stage.name.split("-")[0] in ("rollout", "annotate"):
                self.retire(stage)
        present = {s.name for s in self.stages if not s.removed}
        for name, spec in wanted.items():
            if name not in present:
                for old in [s for s in self.stages if s.name == name]:  # a worker scaled away, now back
                    self.stop(old)  # still stopping: one process per worker id
                    self.stages.remove(old)
                self.stages.append(self.stage_for(name, spec.argv, spec.log_path))
        print(f"opd run: scaled to {cfg.run.rollout_workers} rollout, {cfg.run.annotate_workers} annotate", flush=True)

    def retire(self, stage: RayStage) -> None:
        """Scale-down, gracefully: SIGINT to the command, as Ctrl-C. A rollout worker flushes its buffered rows,
        an annotate worker drops its shard and deletes the lease (its `with lease:` block exits), so another
        worker takes the shard over at its next poll instead of after the expiry. `poll` kills the actor once the
        command has stopped, or after RETIRE_SECONDS (then the lease expires as after a crash)."""
        stage.removed, stage.finished = True, True
        if not stage.refs:  # created but its command not started: nothing to stop cleanly
            self.stop(stage)
            return
        for actor in stage.actors:
            actor.interrupt.remote()  # not waited for: the actor may still be starting
        stage.retire_by = time.monotonic() + RETIRE_SECONDS

    # ---------------------------------------------------------------- the run
    def supervise(self, quiet: bool = False) -> int:
        cfg, store = self.cfg, self.store
        self.logs.mkdir(parents=True, exist_ok=True)
        store.delete(SCALE_FILE)  # a previous run's counts do not apply to this one
        self.connect()
        self.stages = [
            self.stage_for(s.name, s.argv, s.log_path) for s in stage_commands(cfg, self.config_path, self.logs)
        ]
        announce_demand(store, cfg.train, cfg.max_staleness)
        stop = StopSignals()
        failure = None
        display = RunDisplay(store, self.stages, cfg.train.max_steps, quiet=quiet)
        display.stages = self.stages
        try:
            with display:
                while not stop.requested:
                    now = time.monotonic()
                    if now >= self.next_scale_check:
                        self.next_scale_check = now + cfg.ray.scale_poll_seconds
                        self.apply_scale()
                        display.stages = [s for s in self.stages if not s.removed]
                    for stage in self.stages:
                        failure = failure or self.poll(stage, now, cfg.run.max_restarts)
                    for stage in self.stages:
                        if stage.refs or stage.finished or stage.failed or stage.removed:
                            continue
                        if stage.name.startswith("rollout") or store.exists("run.json"):
                            if now >= stage.next_start:
                                self.start(stage)
                        elif not stage.actors:
                            self.create(stage)  # waits for run.json: its worker process starts meanwhile
                    display.update()
                    trainer = next(s for s in self.stages if s.name == "train")
                    if failure or trainer.finished:
                        break
                    time.sleep(0.5)
                deadline = time.monotonic() + (cfg.run.drain_seconds if not failure and not stop.requested else 10)
                while any(s.refs for s in self.stages) and time.monotonic() < deadline:
                    for stage in self.stages:
                        failure = failure or self.poll(stage, time.monotonic(), max_restarts=0)
                    display.update()
                    time.sleep(0.5)
        finally:
            for stage in self.stages:
                self.stop(stage)
            self.ray.shutdown()
            stop.restore()
        if failure:
            print(f"opd run: {failure}", file=sys.stderr)
            return 1
        return 130 if stop.requested else 0


def supervise_ray(cfg: Config, config_path: Path, logs: Path, *, quiet: bool = False) -> int:
    """`opd run --launcher ray`: like `opd_cache.launch.run.supervise`, with the stages as Ray actors."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("--launcher ray needs Ray: pip install 'opd-cache[ray]'") from None
    return RayLauncher(cfg, config_path, logs).supervise(quiet=quiet)
