"""`opd train`: the student trainer.

Read top to bottom:

1. `init_distributed` (distributed.py): one process, or one per rank under `torchrun`
   (gloo on CPU, NCCL on GPU), plus a gloo group for the data loader's broadcasts.
2. `check_inputs`: every bad input the trainer can detect before training,
   each with one message naming the flag, field or file.
3. `Trainer.__init__`: load the student, wrap it in the loss module
   (objective.py), shard it with FSDP2 under torchrun (fsdp.py), build AdamW,
   and resume from the newest complete state in `train/state/` if any.
4. `Trainer.run`: take each step's decoded micro-batches from the prefetch
   thread (loader.py), accumulate gradients over them, clip, step; then write
   the ledger, publish a policy version every `publish_every` steps, write
   progress, save the resume state every `save_every` steps, log metrics.
5. At the end: publish the final weights, save the state, write `train/DONE`
   when `max_steps` was reached (or `--follow` gave up after `idle_timeout`).

Policy versions: the student at step s (1-based) has version
anchor_version + (s − 1 − anchor_step) // publish_every, where the anchor is
(0, 0) for a run without a resume state and moves when a run ends between publications.
Knowing the version of every future step lets the stream judge staleness
while it prefetches.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass

import torch

from opd_cache.config import Config, TrainConfig
from opd_cache.flow.demand import samples_needed_total
from opd_cache.losses import LOSSES, POLICY_GRADIENT, LossConfig
from opd_cache.observe.metrics import MetricsLog
from opd_cache.observe.tracking import Tracker, check_trackers, train_metrics
from opd_cache.storage.retention import retention_pass
from opd_cache.storage.store import RUN_JSON, RunManifest, Store
from opd_cache.train.checkpoint import (
    CorruptStateError,
    clear_ledger_after,
    complete_states,
    drop_corrupt_state,
    load_state,
    save_state,
    state_rel,
    write_consumed,
    write_progress,
)
from opd_cache.train.distributed import DistEnv, init_distributed
from opd_cache.train.loader import BatchLoader, LoadedStep
from opd_cache.train.objective import DistillationObjective
from opd_cache.train.publish import PolicyPublisher
from opd_cache.train.shard_data import ShardCache, required_teachers
from opd_cache.train.step_stats import StepStats
from opd_cache.train.stream import ShardStream, StreamCursor, StreamEnd


# ---------------------------------------------------------------------- 2. bad input
def check_inputs(cfg: TrainConfig, run: RunManifest, world_size: int) -> LossConfig:
    """Refuse what cannot work, before loading anything big; returns the validated loss options."""
    if cfg.loss not in LOSSES and cfg.loss != POLICY_GRADIENT:
        raise ValueError(f"--loss {cfg.loss!r} is not a loss; use one of {', '.join([*LOSSES, POLICY_GRADIENT])}")
    if cfg.max_staleness < 0:
        raise ValueError(f"--max-staleness {cfg.max_staleness}: must be >= 0 (0 = synchronous on-policy training)")
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


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then constant or cosine decay to `min_lr` at `max_steps`."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    step: int
    policy_version: int
    stopped: str
    trained_samples: int
    expired_samples: int


# ---------------------------------------------------------------------- 3-5. the trainer
class Trainer:
    def __init__(self, config: Config, env: DistEnv, console=None):
        from opd_cache.models import load_causal_lm
        from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint

        self.config, self.cfg, self.env = config, config.train, env
        self.console = console if env.rank == 0 else None
        self.metrics = self.tracker = None  # rank 0 opens them when training starts
        self._progress_counts = None  # (trained, unrouted, expired) of the last train/progress.json written
        cfg = self.cfg
        self.store = Store(config.store.uri, s3_endpoint=config.store.s3_endpoint)
        # with --follow a store without run.json yet is waited for (`opd run` starts every stage at once):
        # the student loads meanwhile, and is checked against run.json before anything is trained
        run = self.store.manifest.read() if cfg.follow else self.store.manifest.require()
        if run is None and not cfg.student:
            run = self.store.manifest.wait(cfg.poll_seconds, say=self._say)  # the student is named there
        check_trackers(cfg.report_to)  # a missing tracker package fails before the model loads
        student = cfg.student or run.student
        if not student:
            raise ValueError("no student model: pass --student PATH (run.json has no 'student' either)")
        self.tokenizer = load_tokenizer(student, trust_remote_code=cfg.trust_remote_code)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        if run is not None:
            self._check_run(run, student)  # before the model loads
        torch.manual_seed(cfg.seed)

        # model, loss module, sharding, optimizer
        model = load_causal_lm(student, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
        if run is None:
            run = self.store.manifest.wait(cfg.poll_seconds, say=self._say)
            self._check_run(run, student)
        self.run_manifest = run
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.objective = DistillationObjective(model, self.loss_config)
        self.low_precision = self._low_precision_dtype()
        self.objective.to(env.device)
        if env.distributed:
            from opd_cache.train.fsdp import apply_fsdp

            apply_fsdp(self.objective, env.mesh, param_dtype=self.low_precision)
        self.optimizer = torch.optim.AdamW(
            self.objective.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )

        # resume
        self.step, self.saved_step, self.saved_cursor = 0, -1, None
        # Without a resume state the model is the student, version 0, even when LATEST is higher: a trainer
        # killed after its first publication but before its first state starts over, re-deriving versions
        # 1, 2, ... (publish_version keeps what exists, LATEST never moves back). Counting on from LATEST
        # instead would number the student's weights as a later version.
        self.store.latest_version()  # a LATEST naming a missing version fails here, before training
        self.version = 0
        self.anchor_step, self.anchor_version, self.published_step = 0, self.version, 0
        self.cursor = StreamCursor().to_dict()
        state = self._load_newest_intact_state()
        if state is not None:
            self.step = self.saved_step = state["step"]
            self.version, self.cursor = state["policy_version"], state["cursor"]
            self.saved_cursor = self.cursor
            self.anchor_step, self.anchor_version = state["anchor_step"], state["anchor_version"]
            self.published_step = state["published_step"]
            if self.console:
                self.console.print(
                    f"resuming from {self.store.path(state_rel(self.step))} "
                    f"(step {self.step}, policy version {self.version})"
                )
        if env.rank == 0:
            clear_ledger_after(self.store, self.step, self.cursor["finished"])
            swept = self.store.remove_stale_tmp()  # what killed writers of any stage left, over an hour ago
            if swept and self.console:
                self.console.print(f"removed {len(swept)} temporary file(s) left by killed writers, e.g. {swept[0]}")
            retention_pass(self.store, cfg.keep_versions, cfg.keep_states)  # finishes a pass a kill cut short
        env.barrier()
        # policy versions are written in the background (train/publish.py); the state gather stays a collective
        self.publisher = PolicyPublisher(
            self.store,
            self.objective.model,
            self.tokenizer,
            dtype=cfg.publish_dtype,
            keep_versions=cfg.keep_versions,
            rank=env.rank,
            distributed=env.distributed,
        )

    def _check_run(self, run: RunManifest, student: str) -> None:
        """The trainer's configuration and student against run.json; sets the loss configuration."""
        cfg = self.cfg
        self.loss_config = check_inputs(cfg, run, self.env.world_size)
        if run.tokenizer_fingerprint and run.tokenizer_fingerprint != self.fingerprint:
            raise ValueError(
                f"--student {student}: its tokenizer (fingerprint {self.fingerprint}) is not the run's "
                f"({run.tokenizer_fingerprint} in {self.store.path(RUN_JSON)}); "
                f"train the student whose tokenizer sampled the rollouts"
            )
        if not required_teachers(run) and not cfg.follow:
            raise ValueError(
                f"{self.store.path(RUN_JSON)} names no teachers: run `opd annotate` on this store "
                f"first, or pass --follow to wait for it"
            )

    def _say(self, message: str) -> None:
        if self.console:
            self.console.print(message, highlight=False, soft_wrap=True)

    def _load_newest_intact_state(self) -> dict | None:
        """trainer.json of the newest complete resume state whose files pass their checksums, loaded.

        A damaged state is quarantined (rank 0) and never loaded, not even in part; the previous one is tried.
        """
        for step in reversed(complete_states(self.store)):
            try:
                return load_state(self.store, step, self.objective, self.optimizer, rank=self.env.rank)
            except CorruptStateError as e:
                if self.env.rank == 0:
                    drop_corrupt_state(self.store, e)
                    print(
                        f"warning: resume state step {step} is damaged ({e}): quarantined; trying the previous "
                        f"complete state",
                        file=sys.stderr,
                    )
        return None

    def _low_precision_dtype(self) -> torch.dtype | None:
        mode, device = self.cfg.mixed_precision, self.env.device
        if mode == "bf16":
            return torch.bfloat16
        if mode == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None

    def version_of_step(self, step: int) -> int:
        return self.anchor_version + (step - 1 - self.anchor_step) // self.cfg.publish_every

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "policy_version": self.version,
            "cursor": self.cursor,
            "anchor_step": self.anchor_step,
            "anchor_version": self.anchor_version,
            "published_step": self.published_step,
            "world_size": self.env.world_size,
            "loss": self.cfg.loss,
            "time": round(time.time(), 3),
        }

    def make_data(self):
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
                max_staleness=cfg.max_staleness,
                batch_samples=cfg.global_batch_samples,
                batch_tokens=cfg.global_batch_tokens,
                follow=cfg.follow,
                poll_seconds=cfg.poll_seconds,
                idle_timeout=cfg.idle_timeout,
                cursor=StreamCursor.from_dict(self.cursor),
            )
        return cache, stream

    # ------------------------------------------------------------------ main loop
    def run(self) -> TrainResult:
        cfg, env, store = self.cfg, self.env, self.store
        if self.step >= cfg.max_steps:
            if self.console:
                self.console.print(f"already at step {self.step} >= --max-steps {cfg.max_steps}; nothing to train")
            self._finish("max_steps")
            return self._result("max_steps")
        if env.rank == 0:
            if store.is_done():
                store.clear_done()  # training continues: a larger --max-steps than the finished run's
            self.metrics = MetricsLog(store, "train", "0")
            # records of steps after the resumed state are logged again by this run
            self.metrics.rewrite(lambda record: record.get("step", 0) <= self.step)
            self.tracker = (
                Tracker(
                    cfg.report_to,
                    store=store,
                    run_id=self.run_manifest.run_id,
                    job="train",
                    config=self.config.model_dump(mode="json"),
                )
                if cfg.report_to
                else None
            )

        cache, stream = self.make_data()
        if stream is not None:
            if self.console:
                from rich.markup import escape

                stream.on_event = lambda message: self.console.print(
                    f"[yellow]{escape(message)}[/]", highlight=False, soft_wrap=True
                )
        scorer = None
        if cfg.task_reward_weight > 0:
            from opd_cache.train.task_reward import score_batch

            scorer = lambda batch: score_batch(batch, cache, self.tokenizer)  # noqa: E731
        loader = BatchLoader(
            cache=cache,
            stream=stream,
            rank=env.rank,
            world_size=env.world_size,
            group=env.data_group,
            first_step=self.step + 1,
            max_steps=cfg.max_steps,
            version_of_step=self.version_of_step,
            micro_batch_tokens=cfg.micro_batch_tokens,
            aggregation=self.loss_config.aggregation,
            scorer=scorer,
            pad_id=self.tokenizer.pad_token_id or 0,
            prefetch=cfg.prefetch_batches,
            pin_memory=env.device.type == "cuda",
        ).start()
        if stream is not None:
            stream.on_wait = self._progress_while_waiting(stream, stream.on_wait)
        stopped = "max_steps"
        try:
            while self.step < cfg.max_steps:
                t0 = time.perf_counter()
                item = loader.get()
                queue_wait = time.perf_counter() - t0
                if isinstance(item, StreamEnd):
                    self.cursor = item.cursor
                    stopped = item.reason
                    break
                self._train_step(item, queue_wait)
        finally:
            loader.close()
        self._finish(stopped)
        return self._result(stopped)

    def _train_step(self, item: LoadedStep, queue_wait: float) -> None:
        cfg, env = self.cfg, self.env
        batch = item.batch
        t0 = time.perf_counter()
        self.step += 1
        lr = learning_rate(self.step, cfg)
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
        self.cursor = batch.cursor

        # the step is done: ledger, publication, progress, resume state, metrics
        if env.rank == 0:
            write_consumed(self.store, self.step, batch)
        self.publisher.check()  # a failed background publication stops the trainer here
        if (self.step - self.anchor_step) % cfg.publish_every == 0:
            self._publish()
        if env.rank == 0:
            self._write_progress(self.cursor)
        if self.step % cfg.save_every == 0:
            self._save()
        if env.rank == 0:
            tokens = stats.tokens
            record = {
                "step": self.step,
                "policy_version": self.version,
                "trained_version": batch.version,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "samples": batch.num_rows,
                "input_tokens": int((batch.prompt_lengths + batch.response_lengths).sum()),
                "micro_batches": len(item.micro_batches),
                "step_time_s": step_time,
                "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
                "data_wait_s": queue_wait,
                "stream_wait_s": batch.wait_seconds,
                "decode_s": item.decode_seconds,
                "expired_rows": batch.expired_rows,
                "expired_total": self.cursor["expired_samples"],
                "lost_total": self.cursor.get("lost_samples", 0),
                "lost_shards": self.cursor.get("lost_shards", 0),
                "staleness": batch.staleness_histogram(),
                **stats.record(with_task=cfg.task_reward_weight > 0),
            }
            if cfg.task_reward_weight > 0:
                record["task_reward_mean"] = float(batch.rewards.mean()) if batch.rewards is not None else None
            self._log(record)

    def _autocast(self):
        if self.env.distributed or self.low_precision is None:
            return contextlib.nullcontext()  # FSDP2's MixedPrecisionPolicy casts the parameters itself
        return torch.autocast(self.env.device.type, dtype=self.low_precision)

    def _write_progress(self, cursor: dict) -> None:
        write_progress(
            self.store,
            step=self.step,
            policy_version=self.version,
            cursor=cursor,
            extra={"samples_needed_total": samples_needed_total(self.cfg)},
        )  # for pacing
        self._progress_counts = (cursor["trained_samples"], cursor["unrouted_samples"], cursor["expired_samples"])

    def _progress_while_waiting(self, stream, then):
        """The stream's wait hook: publish rows it expired (or took) while the step waits for data.

        Rollout and annotate stop once the unconsumed rows cover the remaining demand; rows that expired
        during this wait would otherwise count as coverage until the step ends, and the step waits for them.
        """

        def on_wait() -> None:
            cursor = stream.cursor.to_dict()
            counts = (cursor["trained_samples"], cursor["unrouted_samples"], cursor["expired_samples"])
            # also after a step's write of an older cursor (the stream runs ahead: prefetched batches)
            if counts != self._progress_counts:
                self._write_progress(cursor)
            if then is not None:
                then()

        return on_wait

    def _publish(self) -> None:
        self.version += 1
        self.publisher.submit(self.version, self.objective)  # returns once the weights are copied
        self.published_step = self.step

    def _save(self) -> None:
        self.publisher.wait()  # the state counts every version up to its own as published: they must be complete
        save_state(
            self.store,
            self.step,
            self.objective,
            self.optimizer,
            self.trainer_state(),
            rank=self.env.rank,
            distributed=self.env.distributed,
            keep=self.cfg.keep_states,
        )
        self.saved_step, self.saved_cursor = self.step, self.cursor

    def _finish(self, stopped: str) -> None:
        """Publish what was trained since the last version, save the state, mark DONE if finished."""
        if self.step > self.published_step:
            self._publish()
            self.anchor_step, self.anchor_version = self.step, self.version  # later steps count from here
        if (self.step, self.cursor) != (self.saved_step, self.saved_cursor):
            self._save()
        self.publisher.close()
        if self.env.rank == 0:
            self._write_progress(self.cursor)
            if stopped == "max_steps" or (self.cfg.follow and "idle" in stopped):
                self.store.mark_done(f"{stopped} at step {self.step}")
            if self.metrics is not None:
                self.metrics.flush()
            if self.tracker is not None:
                self.tracker.close()
            if self.console:
                self.console.print(
                    f"[bold green]stopped[/] ({stopped}) at step {self.step}, policy version "
                    f"{self.version}; trained {self.cursor['trained_samples']} samples, "
                    f"{self.cursor['expired_samples']} expired"
                )
        self.env.barrier()

    def _result(self, stopped: str) -> TrainResult:
        return TrainResult(
            self.step, self.version, stopped, self.cursor["trained_samples"], self.cursor["expired_samples"]
        )

    # ------------------------------------------------------------------ reporting
    def _log(self, record: dict) -> None:
        self.metrics.log(record)
        if self.tracker is not None:  # train.report_to: the same numbers, live (opd_cache/observe/tracking.py)
            self.tracker.log(train_metrics(record, self.cursor["trained_samples"]), record["step"])
        if self.console:
            stale = " ".join(f"{k}:{v}" for k, v in record["staleness"].items())
            self.console.print(
                f"step {record['step']:>5}/{self.cfg.max_steps} v{record['policy_version']} "
                f"loss {record['loss']:.4f} gnorm {record['grad_norm']:.3f} lr {record['lr']:.2e} "
                f"{record['tokens_per_s']:,.0f} tok/s wait {record['data_wait_s']:.2f}s "
                f"staleness[{stale}] expired {record['expired_total']}",
                highlight=False,
            )


def train(config: Config, console=None) -> TrainResult:
    """Run the trainer (single process, or this rank of a torchrun job) until it stops."""
    env = init_distributed(config.train.device)
    try:
        return Trainer(config, env, console=console).run()
    finally:
        env.close()
