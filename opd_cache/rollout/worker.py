"""`opd rollout`: the student samples responses to prompts and publishes them as rollout shards.

The worker loop, top to bottom:

1. Load the student's tokenizer and the prompts, and check them against
   `run.json` (bad input fails here, before anything is written).
2. Load the newest published policy (`policy/LATEST`, or the configured student
   as version 0), then create or complete `run.json` (student, tokenizer
   fingerprint, vocabulary size, `student_topk`).
3. Resume: this worker's own last shard records where the worker was in the
   prompt stream (`opd.rollout.cursor` in its metadata), so a restarted worker
   (even after SIGKILL) neither repeats nor skips prompts. Nothing else holds
   state: there is no side file to get out of sync with the shards.
4. Loop: reload the weights when a newer version is published; wait while the
   trainer's schedule admits no prompt at the loaded version (pacing.py, issue
   #25; without a schedule: while the unconsumed backlog exceeds
   `max_buffer_samples` or covers the trainer's remaining demand), or the loaded
   version is more than `max_staleness` behind; sample the next batch of prompts
   (no more than admitted); publish a shard every `flush_rows` rows or
   `flush_seconds` seconds, and at once when nothing more is admitted.
5. Stop after `max_samples` / `max_shards` (totals for this worker, so a
   restart with the same command finishes the job instead of redoing it), at
   the trainer's `train/DONE` with `follow`, on SIGINT/SIGTERM (the CLI sets
   `stop`), or after one pass over the prompts when none of these is given.
   Whatever is buffered is flushed on the way out.

The prompt stream is infinite and deterministic: epoch e visits every prompt
once, in a permutation drawn from (seed, worker id, e). The cursor is the
position in that stream; prompt `cursor` is epoch `cursor // len(prompts)`.
A shard always holds whole prompts (all `n` samples of each), so its rows are
`ceil(flush_rows / n) * n` except for the last, partial flush.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from rich.console import Console

from opd_cache.config import Config, RolloutConfig
from opd_cache.engine import Generator, SampleRequest, engine_fields
from opd_cache.flow.staleness import is_too_stale
from opd_cache.observe.metrics import MetricsLog
from opd_cache.rollout.agent import AgentSampler, AgentShardBuffer
from opd_cache.rollout.display import ProgressDisplay
from opd_cache.rollout.engines import make_engine
from opd_cache.rollout.pacing import BacklogGauge
from opd_cache.rollout.policy import CorruptPolicyError, PolicyFiles, check_policy_tokenizer
from opd_cache.rollout.prompt_stream import PromptStream, batch_seed
from opd_cache.rollout.resume import RolloutShardMeta, resume_point
from opd_cache.storage import layout
from opd_cache.storage.manifest import student_id
from opd_cache.storage.retention import VersionHold
from opd_cache.storage.schema import ROLLOUT, rollout_table, write_shard
from opd_cache.storage.store import RunManifest, Store, make_shard_id, validate_worker_id
from opd_cache.tasks.prompts import PromptSet, load_prompts
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["RolloutResult", "RolloutWorker", "ShardBuffer", "make_engine", "run_rollout"]


@dataclass
class RolloutResult:
    shards: list[str] = field(default_factory=list)  # shard ids written by this call
    samples: int = 0  # rows written by this call
    tokens: int = 0  # response tokens written by this call
    seconds: float = 0.0  # wall time of the loop (`run()`, after the model loaded)
    generate_seconds: float = 0.0  # time inside engine.generate
    cursor: int = 0  # stream position at the end
    total_samples: int = 0  # rows this worker has published in all its runs
    policy_version: int = 0
    skipped_prompts: int = 0  # over-long prompts skipped with truncate_prompts


# ---------------------------------------------------------------- rows waiting to be published
class ShardBuffer:
    """Rows of whole prompts, accumulated batch by batch until the next flush (`clear` empties it)."""

    student_topk: int  # columns of the student's top-k ids recorded per position (0: none)
    columns: dict[str, list]  # rollout column -> one value per buffered row
    tokens: int  # response tokens buffered
    started: float  # monotonic time the shard's first batch started (flush_seconds counts from it)

    def __init__(self, student_topk: int):
        self.student_topk = student_topk
        self.clear()

    def clear(self) -> None:
        self.columns = {
            name: []
            for name in (
                "prompt_index",
                "sample_index",
                "prompt_ids",
                "response_ids",
                "behavior_logprobs",
                "finish_reason",
                "data_source",
                "ground_truth",
                "extra",
                "student_topk_ids",
            )
        }
        self.tokens = 0
        self.started = time.monotonic()

    def __len__(self) -> int:
        return len(self.columns["prompt_index"])

    def length_fraction(self) -> float:
        return self.columns["finish_reason"].count("length") / max(len(self), 1)

    def add(self, prompts: PromptSet, positions: np.ndarray, responses: list, n: int) -> None:
        c = self.columns
        for row, response in enumerate(responses):
            p = int(positions[row // n])
            c["prompt_index"].append(prompts.row_index[p])
            c["sample_index"].append(row % n)
            c["prompt_ids"].append(prompts.prompt_ids[p])
            c["response_ids"].append(response.token_ids)
            c["behavior_logprobs"].append(response.logprobs)
            c["finish_reason"].append(response.finish_reason)
            c["data_source"].append(prompts.data_source[p])
            c["ground_truth"].append(prompts.ground_truth[p])
            c["extra"].append(prompts.extra[p])
            if self.student_topk:
                c["student_topk_ids"].append(response.topk_ids)
            self.tokens += len(response.token_ids)

    def table(self, shard_id: str, policy_version: int) -> pa.Table:
        c = self.columns
        return rollout_table(
            sample_ids=[f"{shard_id}-{row}" for row in range(len(self))],
            prompt_index=c["prompt_index"],
            sample_index=c["sample_index"],
            prompt_ids=c["prompt_ids"],
            response_ids=c["response_ids"],
            behavior_logprobs=c["behavior_logprobs"],
            policy_version=policy_version,
            finish_reason=c["finish_reason"],
            data_source=c["data_source"],
            ground_truth=c["ground_truth"],
            extra=c["extra"],
            student_topk_ids=c["student_topk_ids"] if self.student_topk else None,
            student_topk=self.student_topk,
        )


# ---------------------------------------------------------------- the worker loop
class RolloutWorker:
    """One rollout worker: `__init__` runs phases 1-3 of the module docstring, `run()` the loop (4-5).

    Every piece of loop state is an attribute, so `flush`, `finished` and the pacing checks read the same
    numbers the loop advances.
    """

    # the configuration
    cfg: RolloutConfig  # config.rollout
    max_staleness: int  # the configuration's one bound (flow/staleness.py): sampling pauses beyond it
    store: Store
    worker: str  # this worker's id in shard ids (rollout.worker_id)
    stop: threading.Event  # set (SIGINT/SIGTERM in the CLI): flush what is buffered and return
    # 1. inputs, checked against run.json before anything is written
    tokenizer: PreTrainedTokenizerBase  # the student's, left-padded
    prompts: PromptSet
    fingerprint: str  # the tokenizer's, recorded in run.json and every shard
    student_topk: int  # student top-k ids recorded per position (0: none)
    # 2. the newest policy, and run.json
    policies: PolicyFiles  # published versions, checked before they load (policy.py)
    hold: VersionHold  # keeps retention off the version being sampled (storage/retention.py)
    version: int  # the policy version loaded
    engine: Generator  # rollout.engine (engines.py)
    run_manifest: RunManifest
    # 3. where this worker resumes, from its own last shard (resume.py)
    cursor: int  # position in the prompt stream
    total_samples: int  # rows this worker has published in all its runs
    seq: int  # sequence number of its next shard
    stream: PromptStream
    prompt_limit: int | None  # stream position to stop at (one pass over the prompts when no limit is given)
    metrics: MetricsLog
    # the loop's state: pacing, the rows waiting to be published, reporting
    backlog_gauge: BacklogGauge  # unconsumed rows and the trainer's remaining demand (pacing.py)
    backlog: int  # the gauge's last reading
    admitted: int | None  # prompts the trainer's schedule admits now (None: no schedule, pace by count)
    agent: AgentSampler | None  # rollout.agent: conversations with an environment (agent.py); None: single-turn
    buffer: ShardBuffer | AgentShardBuffer
    prompts_per_shard: int  # a shard holds whole prompts: ceil(flush_rows / n)
    result: RolloutResult  # what this call published
    display: ProgressDisplay

    def __init__(
        self, config: Config, store: Store, *, stop: threading.Event | None = None, console: Console | None = None
    ):
        cfg = self.cfg = config.rollout
        self.max_staleness, self.store = config.max_staleness, store
        self.stop = stop or threading.Event()
        self.worker = validate_worker_id(cfg.worker_id)
        if cfg.prompts is None:
            raise ValueError("--prompts is required (a parquet, JSONL or datasets file of prompts)")

        # 1. Inputs first: a bad prompt file or tokenizer fails before anything is written.
        run = store.manifest.read() or RunManifest()
        student = cfg.student or run.student
        if student is None:
            raise ValueError("--student is required: this store has no run.json naming the student")
        student = student_id(student)
        self.tokenizer = load_tokenizer(student, trust_remote_code=cfg.trust_remote_code, padding_side="left")
        self.prompts = load_prompts(
            cfg.prompts, self.tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, truncate=cfg.truncate_prompts
        )
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.student_topk = self._student_topk(run)
        self.agent = None  # rollout.agent: conversations instead of single responses (agent.py)
        if cfg.agent.environment is not None:
            self.agent = AgentSampler.from_config(
                cfg.agent, self.tokenizer, cfg.sampling.max_new_tokens, self.student_topk
            )
        run_fields = dict(
            student=student,
            tokenizer_fingerprint=self.fingerprint,
            vocab_size=len(self.tokenizer),
            student_topk=self.student_topk or None,
        )
        store.manifest.check(run, **run_fields)  # fail before loading a model; ensure checks again

        # 2. The newest policy; run.json is written only once the model has loaded.
        self.policies = PolicyFiles(store, student)
        self.hold = VersionHold(store, f"rollout-{self.worker}", ttl_s=max(120.0, 30 * cfg.poll_seconds))
        # what a paced worker waits on: the trainer (progress, DONE) and a new policy; the other workers' claims
        # and shards only ever admit less, so they need no wake-up
        self.bell = store.bell(layout.TRAIN, layout.POLICY)
        self.version, self.engine = self._load_newest_policy()
        self.run_manifest = store.manifest.ensure(**run_fields)

        # 3. Resume from this worker's last shard.
        resume = resume_point(store, self.worker, self.run_manifest, cfg.seed, len(self.prompts))
        self.cursor, self.total_samples, self.seq = resume.cursor, resume.samples, resume.next_seq
        self.stream = PromptStream(len(self.prompts), cfg.seed, self.worker)
        one_pass = cfg.max_samples is None and cfg.max_shards is None and not cfg.follow
        self.prompt_limit = len(self.prompts) if one_pass else None
        self.metrics = MetricsLog(store, "rollout", self.worker)
        for shard_id in resume.quarantined:  # its prompts are sampled again from `cursor` on
            self.metrics.log(
                {
                    "event": "shard_quarantined",
                    "shard": shard_id,
                    "resumed_from": resume.last_shard,
                    "cursor": self.cursor,
                },
                flush=True,
            )

        # The loop's state: pacing, the buffer of rows, what this call publishes, the progress display.
        self.backlog_gauge = BacklogGauge(
            store, window=max(4, self.max_staleness + 2), worker=self.worker, claim_seconds=cfg.claim_seconds
        )
        self.backlog = 0
        self.admitted = None
        self.buffer = AgentShardBuffer() if self.agent else ShardBuffer(self.student_topk)
        self.prompts_per_shard = math.ceil(cfg.flush_rows / cfg.n)
        self.result = RolloutResult(
            cursor=self.cursor,
            total_samples=self.total_samples,
            policy_version=self.version,
            skipped_prompts=self.prompts.num_skipped_too_long,
        )
        self.display = ProgressDisplay(console, cfg.max_samples, self.total_samples, label=f"rollout {self.worker}")

    # ------------------------------------------------------------ builders of __init__
    def _student_topk(self, run: RunManifest) -> int:
        """The flag's, else the run's (0: none); no larger than the vocabulary."""
        student_topk = self.cfg.student_topk or run.student_topk or 0
        if student_topk > len(self.tokenizer):
            raise ValueError(
                f"student_topk {student_topk} is larger than the vocabulary ({len(self.tokenizer)} tokens)"
            )
        return student_topk

    def _load_newest_policy(self) -> tuple[int, Generator]:
        """The newest intact published version (the configured student is version 0), held and loaded."""
        while True:
            version, path = self.policies.newest_intact(self.store.latest_version())
            # the trainer's retention keeps the version this worker samples with (opd_cache/storage/retention.py)
            self.hold.hold(version)
            try:
                engine = make_engine(self.cfg, path, self.tokenizer)
                break
            except OSError:
                if version == 0 or self.store.is_published(version):
                    raise
                # retention deleted it between LATEST and the hold (a newer version is out): load that one
        self.policies.release(version)
        return version, engine

    # ------------------------------------------------------------ the loop's steps
    def flush(self) -> None:
        """Publish the buffered rows as one shard (a shard holds one policy version)."""
        buffer, result = self.buffer, self.result
        if not len(buffer):
            return
        shard_id = make_shard_id(self.version, self.worker, self.seq)
        rows = len(buffer)
        meta = RolloutShardMeta(
            kind=ROLLOUT,
            run_id=self.run_manifest.run_id,
            tokenizer_fingerprint=self.fingerprint,
            shard_id=shard_id,
            policy_version=self.version,
            student_topk=self.student_topk,
            cursor=self.cursor,
            samples=self.total_samples,
            seed=self.cfg.seed,
            num_prompts=len(self.prompts),
            **engine_fields(self.engine),
        )
        write_shard(self.store, layout.rollout_path(shard_id), buffer.table(shard_id, self.version), meta)
        self.backlog_gauge.rows[shard_id] = rows
        self.backlog_gauge.claim(self.version, 0)  # published: counted as rows now, no longer claimed
        self.metrics.log(
            {
                "shard": shard_id,
                "rows": rows,
                "tokens": buffer.tokens,
                "policy_version": self.version,
                "cursor": self.cursor,
                "total_samples": self.total_samples,
                "backlog": self.backlog,
                "tokens_per_s": result.tokens / result.generate_seconds if result.generate_seconds else 0.0,
                "finish_length_frac": buffer.length_fraction(),
                "cpu_s": self.metrics.cpu_lap(),
            }
        )
        result.shards.append(shard_id)
        self.seq += 1
        buffer.clear()

    def finished(self) -> bool:
        cfg = self.cfg
        if self.stop.is_set() or (cfg.follow and self.store.is_done()):
            return True
        if cfg.max_samples is not None and self.total_samples >= cfg.max_samples:
            return True
        if cfg.max_shards is not None and self.seq >= cfg.max_shards:
            return True
        return self.prompt_limit is not None and self.cursor >= self.prompt_limit

    def must_wait(self) -> bool:
        """Too far ahead of the trainer: the trainer's schedule admits no prompt at this version (#25), or
        without a schedule the backlog is over the buffer or covers the demand; or the policy is too stale."""
        self.backlog = self.backlog_gauge.backlog()
        if self.cfg.follow and self.backlog_gauge.trainer_done:
            # DONE appeared since finished() looked: with it the schedule is gone, and pacing by count would
            # sample a batch no step will train (a tiny run's last shard, at its final version); the loop ends at
            # its next check
            return True
        too_stale = is_too_stale(self.version, self.store.latest_version(), self.max_staleness)
        self.admitted = self.backlog_gauge.prompts_allowed(
            self.version, len(self.buffer), self.cfg.n, self.cfg.max_buffer_samples
        )
        if self.admitted is not None:
            return too_stale or self.admitted == 0
        # one pass over the prompts (no limit, no --follow), before any trainer: nothing would ever consume the
        # backlog, so waiting on it would never end (the README's stages run one after another)
        paced = self.prompt_limit is None or self.backlog_gauge.trainer_running
        return (paced and self.backlog > self.cfg.max_buffer_samples) or too_stale or self.demand_covered()

    def demand_covered(self) -> bool:
        """The published rows and this worker's buffer cover all the trainer's remaining steps still need."""
        if self.admitted is not None:
            return self.admitted == 0  # the schedule admits nothing more now: what is buffered is all that comes
        demand = self.backlog_gauge.demand
        return demand is not None and demand - len(self.buffer) <= 0

    def maybe_reload(self) -> bool:
        """Load a newer published policy, publishing what the old one sampled first; True when one loaded."""
        self.hold.renew()
        latest = self.store.latest_version()
        if latest <= self.version or not self.policies.worth_trying(latest):
            return False
        self.hold.hold(self.version, latest)  # held before loading, so retention cannot delete it meanwhile
        if not self.store.is_published(latest):
            return True  # deleted by retention since LATEST was read, before the hold: a newer one is out
        try:
            path = self.policies.path(latest)
        except CorruptPolicyError as e:  # keep sampling with the current version until one loads
            print(f"warning: {e}; keeping policy version {self.version}", file=sys.stderr)
            self.metrics.log({"event": "policy_refused", "policy_version": latest, "reason": str(e)}, flush=True)
            return True  # look again at once: the flush below is not due, the limits did not move
        self.flush()
        try:
            check_policy_tokenizer(path, self.fingerprint, latest)
            self.engine.load_policy(path)
        except OSError:
            if self.store.is_published(latest):
                raise
            return True  # deleted by retention after the check above (its hold came too late): load a newer one
        self.policies.release(latest)
        self.version = self.result.policy_version = latest
        self.hold.hold(latest)
        self.metrics.log({"event": "reload", "policy_version": self.version}, flush=True)
        return True

    def sample_batch(self) -> None:
        """Sample the next batch: whole prompts, no more than the shard, the limits and the demand still need."""
        cfg, buffer, result = self.cfg, self.buffer, self.result
        count = min(cfg.batch_prompts, self.prompts_per_shard - len(buffer) // cfg.n)
        if cfg.max_samples is not None:
            count = min(count, math.ceil((cfg.max_samples - self.total_samples) / cfg.n))
        if self.prompt_limit is not None:
            count = min(count, self.prompt_limit - self.cursor)
        if self.admitted is not None:  # admission by the trainer's schedule (pacing.py)
            count = min(count, self.admitted)
        if self.backlog_gauge.demand is not None:  # no more prompts than the trainer's remaining demand
            count = min(count, math.ceil((self.backlog_gauge.demand - len(buffer)) / cfg.n))
        if self.admitted is not None:  # claimed: the other workers count these rows from now on (pacing.py)
            count = self.backlog_gauge.admit_claimed(self.version, len(buffer), count, cfg.n, cfg.max_buffer_samples)
            if count <= 0:
                return  # another worker claimed these slots first: wait for the next poll
        positions = self.stream.take(self.cursor, count)
        tic = time.monotonic()
        if not len(buffer):
            buffer.started = tic  # flush_seconds counts from when the shard's first batch started
        request = SampleRequest(
            cfg.sampling, cfg.n, student_topk=self.student_topk, seed=batch_seed(cfg.seed, self.worker, self.cursor)
        )
        if self.agent is not None:  # n conversations per prompt, each a row (agent.py)
            rows, tokens = self.agent.sample(self.engine, self.prompts, positions, cfg.n, request, buffer)
            result.generate_seconds += time.monotonic() - tic
        else:
            responses = self.engine.generate([self.prompts.prompt_ids[p] for p in positions], request)
            result.generate_seconds += time.monotonic() - tic
            buffer.add(self.prompts, positions, responses, cfg.n)
            rows, tokens = len(responses), sum(len(r.token_ids) for r in responses)
        self.cursor += count
        self.total_samples += rows
        result.samples += rows
        result.tokens += tokens
        self.display.update(completed=self.total_samples, tps=result.tokens / max(result.generate_seconds, 1e-9))

    # ------------------------------------------------------------ phase 4-5: the loop
    def run(self) -> RolloutResult:
        started = time.monotonic()
        cfg, buffer = self.cfg, self.buffer
        self.backlog_gauge.claims.start()  # a thread keeps this worker's claim alive, in generate() too
        self.hold.start()  # and its hold on the version it samples with (retention must not delete it meanwhile)
        try:
            while not self.finished():
                # 4a. A newer policy: publish what the old one sampled, then reload.
                if self.maybe_reload():
                    continue  # the flush may have reached a limit

                # 4b. Pace: do not run ahead of the trainer.
                wait = self.must_wait()
                self.display.update(
                    version=self.version, backlog=self.backlog, state="waiting for the trainer" if wait else ""
                )
                if wait:
                    # the buffer completes the trainer's demand: publish it now, no more rows are coming
                    if len(buffer) and (
                        self.demand_covered() or time.monotonic() - buffer.started >= cfg.flush_seconds
                    ):
                        self.flush()
                    self.bell.wait(cfg.poll_seconds, self.stop)
                    continue

                # 4c. Sample; 4d. publish a shard when it is full or old enough.
                self.sample_batch()
                if len(buffer) >= cfg.flush_rows or time.monotonic() - buffer.started >= cfg.flush_seconds:
                    self.flush()
            self.flush()  # 5. whatever is left (SIGINT/SIGTERM, DONE, limits)
        finally:
            self.display.close()
            self.backlog_gauge.claims.close()  # stopped: its claim no longer holds back the others
            self.metrics.flush()
            self.policies.close()
            self.hold.release()
        self.result.cursor, self.result.total_samples = self.cursor, self.total_samples
        self.result.seconds = time.monotonic() - started
        return self.result


def run_rollout(
    cfg: Config, store: Store, *, stop: threading.Event | None = None, console: Console | None = None
) -> RolloutResult:
    """Run one rollout worker until its stop condition; returns what this call published.

    `stop`: set, the worker flushes what is buffered and returns. `console`: where the progress goes (a bar on a
    terminal, else a plain line every ~10 s); None: no progress.
    """
    return RolloutWorker(cfg, store, stop=stop, console=console).run()
