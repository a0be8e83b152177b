"""`opd train`: the student trainer.

Read top to bottom:

1. `run_train` (the bottom of this file; the same signature as `run_rollout` and `run_annotate`): one process,
   or one per rank under `torchrun` (distributed.py: gloo on CPU, NCCL on GPU, plus a gloo group for the data
   loader's broadcasts).
2. `check_inputs`: every bad input the trainer can detect before training, each with one message naming the
   flag, field or file.
3. `Trainer.__init__`, in phases: the run manifest; the tokenizer and the student, wrapped in its loss module
   (objective.py) and sharded with FSDP2 under torchrun (fsdp.py); AdamW (optim.py); the position, resumed from
   the newest intact state in `train/state/` if any (resume.py); the policy publisher (publish.py).
4. `Trainer.run`: take each step's decoded micro-batches from the prefetch thread (loader.py), accumulate
   gradients over them, clip, step; then write the ledger, publish a policy version every `publish_every`
   steps, write progress, save the resume state every `save_every` steps, log metrics.
5. At the end: publish the final weights, save the state, write `train/DONE` when `max_steps` was reached
   (or `--follow` gave up after `idle_timeout`).

Which policy version each step trains at: resume.py (`TrainPosition.version_of_step`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from rich.console import Console

from opd_cache.config import Config, TrainConfig
from opd_cache.flow.demand import samples_needed_total
from opd_cache.losses import LOSSES, POLICY_GRADIENT, LossConfig, SpanTermConfig
from opd_cache.observe.tracking import check_trackers
from opd_cache.storage import layout
from opd_cache.storage.store import RUN_JSON, RunManifest, Store
from opd_cache.train.checkpoint import save_state, write_consumed, write_progress
from opd_cache.train.distributed import DistEnv, init_distributed
from opd_cache.train.loader import BatchLoader, LoadedStep
from opd_cache.train.objective import DistillationObjective
from opd_cache.train.optim import build_optimizer, learning_rate, low_precision_dtype
from opd_cache.train.publish import PolicyPublisher
from opd_cache.train.resume import TrainPosition, load_newest_intact_state, sweep_after_resume
from opd_cache.train.schedule_report import trainer_schedule
from opd_cache.train.shard_data import ShardCache, required_teachers
from opd_cache.train.step_log import StepLog, step_record
from opd_cache.train.step_stats import StepStats
from opd_cache.train.stream import FINISHED_KINDS, ShardStream, StopKind, StreamCursor, StreamEnd

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Trainer", "TrainResult", "check_inputs", "learning_rate", "run_train"]


# ---------------------------------------------------------------------- 2. bad input
def check_inputs(cfg: TrainConfig, run: RunManifest, world_size: int) -> LossConfig:
    """Refuse what cannot work, before loading anything big; returns the validated loss options."""
    if cfg.loss not in LOSSES and cfg.loss != POLICY_GRADIENT:
        raise ValueError(f"--loss {cfg.loss!r} is not a loss; use one of {', '.join([*LOSSES, POLICY_GRADIENT])}")
    if cfg.global_batch_samples is not None and cfg.global_batch_samples < world_size:
        raise ValueError(
            f"--global-batch-samples {cfg.global_batch_samples} is smaller than the world size "
            f"{world_size}: every rank needs at least one sample per step"
        )
    if cfg.global_batch_tokens is not None and cfg.global_batch_tokens < world_size:
        raise ValueError(f"--global-batch-tokens {cfg.global_batch_tokens} is smaller than the world size {world_size}")
    if cfg.support == "union" and not run.student_topk:
        raise ValueError(
            "--support union needs the student's top-k ids in the rollout shards (student_topk_ids), "
            "but run.json has no student_topk: roll out with rollout.student_topk > 0 or use --support teacher"
        )
    # LossConfig checks the option combination (k1 without PG, tail none + jsd, a clip range, ...).
    try:
        return LossConfig.from_train_config(cfg)
    except ValueError as e:
        raise ValueError(f"--loss {cfg.loss} --tail {cfg.tail}: {e}") from None


@dataclass
class TrainResult:
    step: int
    policy_version: int
    stopped: str  # why training stopped, in words ("max_steps", or the stream's StreamEnd.reason)
    trained_samples: int
    expired_samples: int
    stop_kind: StopKind  # why, as a value to compare (stream.py)


# ---------------------------------------------------------------------- 3-5. the trainer
class Trainer:
    """The student trainer: `__init__` builds its parts in the numbered phases below, `run()` trains.

    `opd replay` subclasses it (train/replay.py): `make_data` and `cursor_type` say where the batches come from.
    """

    cursor_type: ClassVar[type[StreamCursor]] = StreamCursor  # the stream's position, as resume states hold it
    step_line_staleness: ClassVar[bool] = True  # the step line shows the batch's staleness and the expired count

    # the configuration and this process
    config: Config
    cfg: TrainConfig  # config.train
    env: DistEnv  # rank, world size, device, process groups (distributed.py)
    console: Console | None  # rank 0's; None on the other ranks and in quiet library use
    stop: threading.Event  # set: training ends at the next step the stream plans, published and saved
    # 1. store and run manifest
    store: Store
    run_manifest: RunManifest
    loss_config: LossConfig  # the loss options, validated against run.json
    # 2. tokenizer and student
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str  # the tokenizer's, which must be run.json's
    low_precision: torch.dtype | None  # autocast (one process) or FSDP2 parameter dtype; None: float32
    objective: DistillationObjective  # the student with its loss: the module trained (the FSDP2 root)
    # 3. optimizer
    optimizer: torch.optim.Optimizer
    # 4. where training stands
    position: TrainPosition  # step, policy version, stream cursor, version anchor (resume.py)
    saved_step: int  # the step of the newest resume state (-1: none)
    saved_cursor: StreamCursor | None  # its cursor
    # 5. publication
    publisher: PolicyPublisher  # writes policy versions in a background thread (publish.py)
    # reporting
    step_log: StepLog | None  # metrics, trackers, console lines: opened by `run()` on rank 0 (step_log.py)
    _progress_counts: tuple[int, int, int] | None  # (trained, unrouted, expired) of the last progress.json

    def __init__(
        self,
        config: Config,
        store: Store,
        env: DistEnv,
        *,
        stop: threading.Event | None = None,
        console: Console | None = None,
    ):
        from opd_cache.models import load_causal_lm
        from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint

        self.config, self.cfg, self.env = config, config.train, env
        self.console = console if env.rank == 0 else None
        self.stop = stop or threading.Event()
        cfg = self.cfg

        # 1. store and run manifest. With --follow a store without run.json yet is waited for (`opd run` starts
        #    every stage at once): the student loads meanwhile, and is checked against run.json before training.
        self.store = store
        run = self._read_run()  # None: not there yet
        check_trackers(cfg.report_to)  # a missing tracker package fails before the model loads
        student = self._student(run)

        # 2. tokenizer and student, checked against run.json before the model loads when run.json exists
        self.tokenizer = load_tokenizer(student, trust_remote_code=cfg.trust_remote_code)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        loss_config = self._check_run(run, student) if run is not None else None
        torch.manual_seed(cfg.seed)
        model = load_causal_lm(student, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
        if run is None:
            run = self.store.manifest.wait(cfg.poll_seconds, say=self._say)
            loss_config = self._check_run(run, student)
        self.run_manifest, self.loss_config = run, loss_config
        self.low_precision = low_precision_dtype(cfg.mixed_precision, env.device)
        self.objective = self._build_objective(model)

        # 3. optimizer
        self.optimizer = build_optimizer(self.objective, cfg)

        # 4. where training stands: the newest intact resume state, or step 0 at version 0
        resumed = self._resume()
        self.position = resumed or TrainPosition(cursor=self.cursor_type())
        self.saved_step, self.saved_cursor = (resumed.step, resumed.cursor) if resumed else (-1, None)
        if env.rank == 0:
            swept = sweep_after_resume(
                self.store, self.position, keep_versions=cfg.keep_versions, keep_states=cfg.keep_states
            )
            if swept and self.console:
                self.console.print(f"removed {len(swept)} temporary file(s) left by killed writers, e.g. {swept[0]}")
        env.barrier()

        # 5. publication: policy versions are written in the background; the state's gather stays a collective
        self.publisher = PolicyPublisher(
            self.store,
            self.objective.model,
            self.tokenizer,
            dtype=cfg.publish_dtype,
            keep_versions=cfg.keep_versions,
            rank=env.rank,
            distributed=env.distributed,
        )
        self.step_log = None
        self._progress_counts = None

    # ------------------------------------------------------------------ builders of __init__
    def _read_run(self) -> RunManifest | None:
        """run.json; with --follow None while it is not there yet (waited for now only when it names the student)."""
        if not self.cfg.follow:
            return self.store.manifest.require()
        run = self.store.manifest.read()
        if run is None and not self.cfg.student:
            run = self.store.manifest.wait(self.cfg.poll_seconds, say=self._say)  # the student is named there
        return run

    def _student(self, run: RunManifest | None) -> str:
        student = self.cfg.student or (run.student if run is not None else None)
        if not student:
            raise ValueError("no student model: pass --student PATH (run.json has no 'student' either)")
        return student

    def _check_run(self, run: RunManifest, student: str) -> LossConfig:
        """The trainer's configuration and student against run.json; returns the validated loss options."""
        loss_config = check_inputs(self.cfg, run, self.env.world_size)
        if run.tokenizer_fingerprint and run.tokenizer_fingerprint != self.fingerprint:
            raise ValueError(
                f"--student {student}: its tokenizer (fingerprint {self.fingerprint}) is not the run's "
                f"({run.tokenizer_fingerprint} in {self.store.path(RUN_JSON)}); "
                f"train the student whose tokenizer sampled the rollouts"
            )
        if not required_teachers(run) and not self.cfg.follow:
            raise ValueError(
                f"{self.store.path(RUN_JSON)} names no teachers: run `opd annotate` on this store "
                f"first, or pass --follow to wait for it"
            )
        return loss_config

    def _build_objective(self, model: torch.nn.Module) -> DistillationObjective:
        """The student wrapped with its loss, on the device; sharded with FSDP2 under torchrun."""
        if self.cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        span = SpanTermConfig(weight=self.cfg.span_weight, estimator=self.cfg.span_estimator)  # cross-tokenizer parts
        objective = DistillationObjective(model, self.loss_config, span)
        objective.to(self.env.device)
        if self.env.distributed:
            from opd_cache.train.fsdp import apply_fsdp

            apply_fsdp(objective, self.env.mesh, param_dtype=self.low_precision)
        return objective

    def _resume(self) -> TrainPosition | None:
        """The position of the newest intact resume state, loaded into the model and optimizer (None: none)."""
        self.store.latest_version()  # a LATEST naming a missing version fails here, before training
        state = load_newest_intact_state(self.store, self.objective, self.optimizer, rank=self.env.rank)
        if state is None:
            return None
        position = TrainPosition.from_state(state, self.cursor_type)
        if self.console:
            self.console.print(
                f"resuming from {self.store.path(layout.state_dir(position.step))} "
                f"(step {position.step}, policy version {position.version})"
            )
        return position

    def _say(self, message: str) -> None:
        if self.console:
            self.console.print(message, highlight=False, soft_wrap=True)

    def version_of_step(self, step: int) -> int:
        return self.position.version_of_step(step, self.cfg.publish_every)

    def make_data(self) -> tuple[ShardCache, ShardStream | None]:
        """The shard cache (every rank) and the batch stream (rank 0, else None); `opd replay` overrides it."""
        cfg = self.cfg
        cache = ShardCache(
            self.store, self.run_manifest, required_teachers(self.run_manifest), need_support=cfg.support == "union"
        )
        stream = None
        if self.env.rank == 0:
            stream = ShardStream(
                self.store,
                self.run_manifest,
                cache,
                max_staleness=self.config.max_staleness,
                batch_samples=cfg.global_batch_samples,
                batch_tokens=cfg.global_batch_tokens,
                follow=cfg.follow,
                poll_seconds=cfg.poll_seconds,
                idle_timeout=cfg.idle_timeout,
                cursor=self.position.cursor.copy(),  # the stream moves its own copy ahead
                stop=self.stop,
            )
        return cache, stream

    # ------------------------------------------------------------------ main loop
    def run(self) -> TrainResult:
        cfg, env, store, position = self.cfg, self.env, self.store, self.position
        if position.step >= cfg.max_steps:
            if self.console:
                self.console.print(f"already at step {position.step} >= --max-steps {cfg.max_steps}; nothing to train")
            return self._finish("max_steps", "max_steps")
        if env.rank == 0:
            if store.is_done():
                store.clear_done()  # training continues: a larger --max-steps than the finished run's
            self.step_log = StepLog(
                store,
                self.config,
                self.run_manifest.run_id,
                resumed_step=position.step,
                console=self.console,
                staleness=self.step_line_staleness,
            )

        cache, stream = self.make_data()
        if stream is not None and self.console:
            from rich.markup import escape

            stream.on_event = lambda message: self.console.print(
                f"[yellow]{escape(message)}[/]", highlight=False, soft_wrap=True
            )
        loader = self._start_loader(cache, stream)
        if stream is not None:
            stream.on_wait = self._progress_while_waiting(stream, stream.on_wait)
        kind: StopKind = "max_steps"
        reason = "max_steps"
        try:
            while position.step < cfg.max_steps:
                t0 = time.perf_counter()
                item = loader.get()
                queue_wait = time.perf_counter() - t0
                if isinstance(item, StreamEnd):
                    position.cursor, kind, reason = item.cursor, item.kind, item.reason
                    break
                self._train_step(item, queue_wait)
        finally:
            loader.close()
        return self._finish(kind, reason)

    def _start_loader(self, cache: ShardCache, stream: ShardStream | None) -> BatchLoader:
        """The prefetch thread (loader.py), started; with a task reward it also scores each batch."""
        cfg, env = self.cfg, self.env
        scorer = None
        if cfg.task_reward_weight > 0:
            from opd_cache.train.task_reward import score_batch

            scorer = lambda batch: score_batch(batch, cache, self.tokenizer)  # noqa: E731
        return BatchLoader(
            cache=cache,
            stream=stream,
            rank=env.rank,
            world_size=env.world_size,
            group=env.data_group,
            first_step=self.position.step + 1,
            max_steps=cfg.max_steps,
            version_of_step=self.version_of_step,
            micro_batch_tokens=cfg.micro_batch_tokens,
            aggregation=self.loss_config.aggregation,
            scorer=scorer,
            pad_id=self.tokenizer.pad_token_id or 0,
            prefetch=cfg.prefetch_batches,
            pin_memory=env.device.type == "cuda",
        ).start()

    def _train_step(self, item: LoadedStep, queue_wait: float) -> None:
        cfg, env, position = self.cfg, self.env, self.position
        batch = item.batch
        t0 = time.perf_counter()
        position.step += 1
        lr = learning_rate(position.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.objective.train()
        stats = StepStats()
        last = len(item.micro_batches) - 1
        for i, micro in enumerate(item.micro_batches):
            if env.distributed:
                self.objective.set_requires_gradient_sync(i == last)
            with self._autocast():
                loss, _, diag = self.objective(micro.to(env.device))
            loss.backward()
            stats.add(loss, diag)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.objective.parameters(), cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if env.distributed:
            stats.all_reduce(env.device)
        step_time = time.perf_counter() - t0
        position.cursor = batch.cursor

        # the step is done: ledger, publication, progress, resume state, metrics
        if env.rank == 0:
            write_consumed(self.store, position.step, batch)
        self.publisher.check()  # a failed background publication stops the trainer here
        if (position.step - position.anchor_step) % cfg.publish_every == 0:
            self._publish()
        if env.rank == 0:
            self._write_progress(position.cursor)
        if position.step % cfg.save_every == 0:
            self._save()
        if env.rank == 0:
            record = step_record(
                item,
                stats,
                position.cursor,
                step=position.step,
                policy_version=position.version,
                lr=lr,
                grad_norm=float(grad_norm),
                step_time=step_time,
                queue_wait=queue_wait,
                with_task=cfg.task_reward_weight > 0,
            )
            self.step_log.log(record, trained_samples=position.cursor.trained_samples)

    def _autocast(self):
        if self.env.distributed or self.low_precision is None:
            return contextlib.nullcontext()  # FSDP2's MixedPrecisionPolicy casts the parameters itself
        return torch.autocast(self.env.device.type, dtype=self.low_precision)

    # ------------------------------------------------------------------ bookkeeping
    def _write_progress(self, cursor: StreamCursor, assembled_steps: int | None = None, partial_rows: int = 0) -> None:
        """The counters, the demand and the schedule (#25; `assembled_steps` None: the optimizer's step)."""
        schedule = trainer_schedule(
            self.cfg, self.config.max_staleness, self.position, cursor, assembled_steps, partial_rows
        )
        write_progress(
            self.store,
            step=self.position.step,
            policy_version=self.position.version,
            cursor=cursor.to_dict(),
            extra={"samples_needed_total": samples_needed_total(self.cfg), **schedule},
        )  # for pacing
        self._progress_counts = (cursor.trained_samples, cursor.unrouted_samples, cursor.expired_samples)

    def _progress_while_waiting(self, stream, then):
        """The stream's wait hook: publish the rows it expired (or took) while the step waits for data, so that the
        producers' admission (#25) and demand count them now, not after the step."""

        def on_wait() -> None:
            cursor = stream.cursor
            counts = (cursor.trained_samples, cursor.unrouted_samples, cursor.expired_samples)
            # also after a step's write of an older cursor (the stream runs ahead: prefetched batches)
            if counts != self._progress_counts:
                self._write_progress(cursor, stream.assembled_steps, stream.partial_rows)
            if then is not None:
                then()

        return on_wait

    def _publish(self) -> None:
        self.position.version += 1
        self.publisher.submit(self.position.version, self.objective)  # returns once the weights are copied
        self.position.published_step = self.position.step

    def _save(self) -> None:
        self.publisher.wait()  # the state counts every version up to its own as published: they must be complete
        save_state(
            self.store,
            self.position.step,
            self.objective,
            self.optimizer,
            self.position.to_state(world_size=self.env.world_size, loss=self.cfg.loss),
            rank=self.env.rank,
            distributed=self.env.distributed,
            keep=self.cfg.keep_states,
        )
        self.saved_step, self.saved_cursor = self.position.step, self.position.cursor

    def _finish(self, kind: StopKind, reason: str) -> TrainResult:
        """Publish what was trained since the last version, save the state, mark DONE if finished."""
        position = self.position
        if position.step > position.published_step:
            self._publish()
            position.anchor_step, position.anchor_version = position.step, position.version  # later steps count here
        if (position.step, position.cursor) != (self.saved_step, self.saved_cursor):
            self._save()
        self.publisher.close()
        cursor = position.cursor
        if self.env.rank == 0:
            self._write_progress(cursor)
            if kind in FINISHED_KINDS or (self.cfg.follow and kind == "idle_timeout"):
                self.store.mark_done(f"{reason} at step {position.step}")
            if self.step_log is not None:
                self.step_log.close()
            if self.console:
                self.console.print(
                    f"[bold green]stopped[/] ({reason}) at step {position.step}, policy version "
                    f"{position.version}; trained {cursor.trained_samples} samples, "
                    f"{cursor.expired_samples} expired"
                )
        self.env.barrier()
        return TrainResult(
            position.step, position.version, reason, cursor.trained_samples, cursor.expired_samples, kind
        )


# ---------------------------------------------------------------------- 1. the entry point
def run_train(
    cfg: Config, store: Store, *, stop: threading.Event | None = None, console: Console | None = None
) -> TrainResult:
    """Train (one process, or this rank of a torchrun job) until max_steps, the data's end or `stop`.

    `console`: where the step lines go (None: nowhere). `stop`: set, training ends at the next step the stream
    plans, with its policy version published and its state saved (no train/DONE).
    """
    env = init_distributed(cfg.train.device)
    try:
        return Trainer(cfg, store, env, stop=stop, console=console).run()
    finally:
        env.close()
