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
   unconsumed backlog exceeds `max_buffer_samples`, or covers all the trainer's
   remaining steps need (`samples_needed_total` in its progress), or the loaded
   version is more than `max_staleness` behind; sample the next batch of prompts
   (no more than that demand); publish a shard every `flush_rows` rows or
   `flush_seconds` seconds.
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
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from opd_cache.config import RolloutConfig
from opd_cache.engines import engine_fields
from opd_cache.integrity import legacy_warning, verify_local_folder
from opd_cache.metrics import MetricsLog
from opd_cache.progress import Every
from opd_cache.schema import ROLLOUT, CorruptShardError, ShardError, ShardMeta, read_shard, rollout_table, write_shard
from opd_cache.store import COMPLETE_MARKER, ShardWatch, Store, make_shard_id, parse_shard_id, validate_worker_id
from opd_cache.tasks.prompts import PromptSet, load_prompts
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint

# Keys this stage adds to a rollout shard's metadata (ShardMeta ignores keys it does not know).
META_CURSOR = "opd.rollout.cursor"  # stream position after the shard's last prompt
META_SAMPLES = "opd.rollout.samples"  # rows this worker has published, this shard included
META_SEED = "opd.rollout.seed"
META_NUM_PROMPTS = "opd.rollout.num_prompts"


@dataclass
class RolloutShardMeta(ShardMeta):
    """ShardMeta plus where the worker stands in its prompt stream."""

    cursor: int = 0
    samples: int = 0
    seed: int = 0
    num_prompts: int = 0

    def to_metadata(self) -> dict[bytes, bytes]:
        meta = super().to_metadata()
        for key, value in ((META_CURSOR, self.cursor), (META_SAMPLES, self.samples), (META_SEED, self.seed),
                           (META_NUM_PROMPTS, self.num_prompts)):
            meta[key.encode()] = str(value).encode()
        return meta


@dataclass
class RolloutResult:
    shards: list[str] = field(default_factory=list)  # shard ids written by this call
    samples: int = 0  # rows written by this call
    tokens: int = 0  # response tokens written by this call
    seconds: float = 0.0  # wall time of the call, model load included
    generate_seconds: float = 0.0  # time inside engine.generate
    cursor: int = 0  # stream position at the end
    total_samples: int = 0  # rows this worker has published in all its runs
    policy_version: int = 0
    skipped_prompts: int = 0  # over-long prompts skipped with truncate_prompts


# ---------------------------------------------------------------- the prompt stream
def epoch_order(num_prompts: int, seed: int, worker_id: str, epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the prompts (positions into the PromptSet)."""
    rng = np.random.default_rng([seed, zlib.crc32(worker_id.encode()), epoch])
    return rng.permutation(num_prompts)


class PromptStream:
    """Positions `cursor, cursor+1, …` of the infinite, epoch-cycling prompt sequence."""

    def __init__(self, num_prompts: int, seed: int, worker_id: str):
        self.num_prompts, self.seed, self.worker_id = num_prompts, seed, worker_id
        self._orders: dict[int, np.ndarray] = {}

    def take(self, cursor: int, count: int) -> np.ndarray:
        positions = np.arange(cursor, cursor + count)
        epochs, offsets = np.divmod(positions, self.num_prompts)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            if epoch not in self._orders:
                self._orders = {epoch: epoch_order(self.num_prompts, self.seed, self.worker_id, int(epoch))}
            in_epoch = epochs == epoch
            out[in_epoch] = self._orders[epoch][offsets[in_epoch]]
        return out


def batch_seed(seed: int, worker_id: str, cursor: int) -> int:
    """Sampling seed of the batch starting at `cursor`: a restarted worker redraws the same samples."""
    return int(np.random.SeedSequence([seed, zlib.crc32(worker_id.encode()), cursor]).generate_state(1)[0])


# ---------------------------------------------------------------- resume
RESUME_VERSIONS = 8  # partitions a restarted worker looks at before it lists the whole history

@dataclass
class ResumePoint:
    next_seq: int = 0
    cursor: int = 0
    samples: int = 0
    last_shard: str | None = None
    quarantined: list[str] = field(default_factory=list)  # this worker's damaged newest shards, moved aside


def resume_point(store: Store, worker_id: str, run: dict, seed: int, num_prompts: int) -> ResumePoint:
    """Where this worker stopped, read from its own last intact shard.

    A worker's shards never go back in version, so its last one lies in the newest partition holding any of
    its shards: look at the last RESUME_VERSIONS partitions first, list the whole history only when none does.

    A damaged newest shard (checksum, truncation) is quarantined and the worker resumes from the shard before
    it: the damaged shard's prompts are sampled again, under a new shard id (`next_seq` passes every seq this
    worker ever used, quarantined ones included, so no id is reused and no old annotated part pairs up with new
    rows). Its rows are not counted here: the trainer never trains them (gone from `rollouts/`) and counts as
    lost only the rows of it that it had started on (docs/reliability.md).
    """
    latest = store.latest_version()
    mine = []
    for version in range(latest, max(latest - RESUME_VERSIONS, -1), -1):
        mine = [s for s in store.list_rollout_shards([version]) if s.worker == worker_id]
        if mine:
            break
    else:
        mine = [s for s in store.list_rollout_shards() if s.worker == worker_id]
    used_seq = max([s.seq for s in mine] + _quarantined_seqs(store, worker_id), default=-1)
    quarantined = []
    while mine:
        last = max(mine, key=lambda s: s.seq)
        try:
            table, _ = read_shard(store, last.path, kind=ROLLOUT, run=run)
            break
        except CorruptShardError as e:
            _quarantine(store, e)
            quarantined.append(last.shard_id)
            if len(quarantined) == 1:  # the previous intact shard may lie in an older partition: list them all
                mine = [s for s in store.list_rollout_shards() if s.worker == worker_id]
            mine = [s for s in mine if s.seq < last.seq]
    if not mine:
        return ResumePoint(next_seq=used_seq + 1, quarantined=quarantined)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    where = store.path(last.path)
    if META_CURSOR not in meta:
        raise ShardError(f"{where}: no '{META_CURSOR}' in its metadata, so worker {worker_id} cannot resume "
                         f"from it; use another --worker-id")
    recorded = (int(meta.get(META_SEED, seed)), int(meta.get(META_NUM_PROMPTS, num_prompts)))
    if recorded != (seed, num_prompts):
        raise ValueError(
            f"{where}: worker {worker_id} was sampling with seed {recorded[0]} over {recorded[1]} prompts, this "
            f"command has seed {seed} over {num_prompts}: restart with the same settings, or use a new --worker-id"
        )
    return ResumePoint(next_seq=used_seq + 1, cursor=int(meta[META_CURSOR]), samples=int(meta[META_SAMPLES]),
                       last_shard=last.shard_id, quarantined=quarantined)


def _quarantine(store: Store, error: CorruptShardError) -> None:
    """Move a damaged shard of this worker aside with its reason (one line: what failed, and that it moved)."""
    try:
        store.quarantine(error.rel, str(error))
    except FileNotFoundError:
        pass  # the trainer or annotate quarantined it first
    print(f"{error}: quarantined", file=sys.stderr)


def _quarantined_seqs(store: Store, worker_id: str) -> list[int]:
    """Seqs of this worker's rollout shards in quarantine/ (`rollouts__v<version>__<shard id>.arrow`)."""
    seqs = []
    for info in store.list_files("quarantine"):  # names only: one LIST, no reason file read
        name = info.base_name
        if name.startswith("rollouts__") and name.endswith(".arrow"):
            try:
                _, worker, seq = parse_shard_id(name.rsplit("__", 1)[-1].removesuffix(".arrow"))
            except ValueError:
                continue
            if worker == worker_id:
                seqs.append(seq)
    return seqs


# ---------------------------------------------------------------- pacing
def count_rows(store: Store, rel: str) -> int:
    """Rows of an Arrow IPC stream file (zero-copy through a memory map on local stores)."""
    with store.open_input_file(rel) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


class _RowCounts(dict):
    """shard id -> rows, with their running total (shards are immutable: each is counted once)."""

    total = 0

    def __setitem__(self, shard_id: str, rows: int) -> None:
        self.total += rows - self.get(shard_id, 0)
        super().__setitem__(shard_id, rows)


class BacklogGauge:
    """Rows published by all rollout workers that the trainer has not consumed (nor expired) yet.

    The first call counts every shard; later calls list only the last `window` versions' partitions (plus the
    `ShardWatch` sweep, which finds a shard published late into an older version), so a poll's cost does not
    grow with the run's history.
    """

    def __init__(self, store: Store, window: int = 4):
        self.store, self.window = store, window
        self.rows = _RowCounts()
        self._watch = ShardWatch(store)
        self.demand: int | None = None  # samples the trainer's remaining steps still lack (None: unknown)

    def backlog(self) -> int:
        latest = self.store.latest_version()
        for shard in self._watch.poll(latest - self.window, latest):
            if shard.shard_id not in self.rows:
                try:
                    self.rows[shard.shard_id] = count_rows(self.store, shard.path)
                except (OSError, pa.ArrowInvalid):
                    self.rows[shard.shard_id] = 0  # unreadable: annotate will quarantine it
        progress = self.store.read_progress()
        backlog = self.rows.total - int(progress.get("consumed_samples", 0)) - int(progress.get("expired_samples", 0))
        # demand-aware pacing (issue #14): what the remaining steps train, less what the backlog covers.
        # Expired rows left the backlog above; rows expiring while the trainer waits, it publishes then.
        # Once the trainer is DONE its demand is met: rows sampled then are for a later run, paced as before.
        needed = progress.get("samples_needed_total")
        if needed is None or self.store.is_done():
            self.demand = None
        else:
            self.demand = int(needed) - int(progress.get("trained_samples", 0)) - (backlog - self._quarantined_rows())
        return backlog

    def _quarantined_rows(self) -> int:
        """Rows of counted shards moved to quarantine/ (damaged): never trained, so no coverage (one LIST)."""
        moved = {info.base_name for info in self.store.list_files("quarantine")}
        if not moved:
            return 0
        # Store.quarantine names the moved file after its path
        return sum(rows for shard_id, rows in self.rows.items()
                   if self.store.rollout_path(shard_id).replace("/", "__") in moved)


# ---------------------------------------------------------------- rows waiting to be published
class ShardBuffer:
    """Rows of whole prompts, accumulated batch by batch until the next flush."""

    def __init__(self, student_topk: int):
        self.student_topk = student_topk
        self.clear()

    def clear(self) -> None:
        self.columns: dict[str, list] = {name: [] for name in (
            "prompt_index", "sample_index", "prompt_ids", "response_ids", "behavior_logprobs", "finish_reason",
            "data_source", "ground_truth", "extra", "student_topk_ids")}
        self.tokens = 0
        self.started = time.monotonic()

    def __len__(self) -> int:
        return len(self.columns["prompt_index"])

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
            prompt_index=c["prompt_index"], sample_index=c["sample_index"], prompt_ids=c["prompt_ids"],
            response_ids=c["response_ids"], behavior_logprobs=c["behavior_logprobs"], policy_version=policy_version,
            finish_reason=c["finish_reason"], data_source=c["data_source"], ground_truth=c["ground_truth"],
            extra=c["extra"], student_topk_ids=c["student_topk_ids"] if self.student_topk else None,
            student_topk=self.student_topk,
        )


# ---------------------------------------------------------------- engines and policies
def make_engine(cfg: RolloutConfig, model_path: str, tokenizer):
    """The generation engine named by `cfg.engine`, loaded from `model_path`."""
    if cfg.engine == "vllm":
        from opd_cache.engines.vllm_generate import VLLMGenerator

        # cfg.dtype by name: vLLM's "auto" would load float32 weights in bfloat16 on its CPU back-end
        return VLLMGenerator(model_path, tensor_parallel_size=cfg.tensor_parallel_size, dtype=cfg.dtype, seed=cfg.seed,
                             max_logprobs=max(20, cfg.student_topk), trust_remote_code=cfg.trust_remote_code)
    from opd_cache.engines.hf_generate import HFGenerator

    engine = HFGenerator(model_path, tokenizer=tokenizer, device=cfg.device, dtype=cfg.dtype,
                         attn_implementation=cfg.attn_implementation, eos_token_ids=_eos_ids(tokenizer),
                         pad_token_id=tokenizer.pad_token_id, vocab_limit=len(tokenizer), seed=cfg.seed,
                         trust_remote_code=cfg.trust_remote_code)
    output_layer = engine.model.get_output_embeddings()
    model_vocab = output_layer.weight.shape[0] if output_layer is not None else engine.model.config.vocab_size
    if model_vocab < len(tokenizer):
        raise ValueError(f"student {model_path}: the model's output layer has {model_vocab} rows but the tokenizer "
                         f"has {len(tokenizer)} tokens")
    return engine


def _eos_ids(tokenizer) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path}: no eos_token, so responses could never stop")
    return [tokenizer.eos_token_id]


class CorruptPolicyError(ValueError):
    """A published policy version whose files fail their checksums: never loaded."""


class PolicyFiles:
    """Local folders of published policy versions (remote stores: downloaded to a temporary cache).

    Every version is checked against its `_CHECKSUMS.json` before its path is handed out; the files that
    fail are quarantined and the version is refused (CorruptPolicyError), so damaged weights are never loaded.
    """

    RETRY_SECONDS = 30.0  # a refused version is checked again after this long (the trainer may re-publish it)

    def __init__(self, store: Store, student: str):
        self.store, self.student = store, student
        self.cache_dir: str | None = None
        self.refused: dict[int, float] = {}  # version -> when it failed its checksum

    def path(self, version: int) -> str:
        if version == 0:
            return self.student
        rel = self.store.policy_dir(version)
        if self.store.is_local:
            path = str(self.store.local_path(rel))
        else:
            if self.cache_dir is None:
                self.cache_dir = tempfile.mkdtemp(prefix="opd-rollout-policy-")
            path = str(self.store.download_dir(rel, os.path.join(self.cache_dir, f"v{version:06d}")))
        problems = verify_local_folder(Path(path))  # the bytes about to be loaded (remote: the downloaded copy)
        if problems is None:
            legacy_warning("policy version", self.store.path(rel))
        elif problems:
            self.release(version)
            for problem in problems:
                if problem.status == "corrupt" and self.store.exists(f"{rel}/{problem.name}"):
                    self.store.quarantine(f"{rel}/{problem.name}", problem.reason)
            self.refused[version] = time.monotonic()
            raise CorruptPolicyError(f"policy version {version} is not loaded: {problems[0].reason}"
                                     + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                                     + ": quarantined")
        self.refused.pop(version, None)
        return path

    def worth_trying(self, version: int) -> bool:
        failed_at = self.refused.get(version)
        return failed_at is None or time.monotonic() - failed_at >= self.RETRY_SECONDS

    def newest_intact(self, latest: int) -> tuple[int, str]:
        """(version, path) of the newest published version <= `latest` that passes its checksums (0: the student)."""
        for version in range(latest, 0, -1):
            if not self.store.exists(f"{self.store.policy_dir(version)}/{COMPLETE_MARKER}"):
                continue
            try:
                return version, self.path(version)
            except CorruptPolicyError as e:
                print(f"warning: {e}; trying the previous version", file=sys.stderr)
        return 0, self.path(0)

    def release(self, version: int) -> None:
        """Forget a downloaded copy once its weights are loaded."""
        if self.cache_dir is not None and version > 0:
            shutil.rmtree(os.path.join(self.cache_dir, f"v{version:06d}"), ignore_errors=True)

    def close(self) -> None:
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


def _check_policy_tokenizer(path: str, fingerprint: str, version: int) -> None:
    if any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        found = tokenizer_fingerprint(load_tokenizer(path))
        if found != fingerprint:
            raise ValueError(f"policy version {version} ({path}) has tokenizer {found}, this run uses {fingerprint}")


def _student_id(student: str) -> str:
    # A local folder is recorded as an absolute path, so a restart from another directory agrees with run.json.
    return os.path.abspath(student) if os.path.exists(student) else student


# ---------------------------------------------------------------- progress display
class ProgressDisplay:
    """Samples, tokens/s, version, backlog: a rich progress bar on a terminal, a plain line every ~10 s otherwise
    (the log file of `opd run`, a redirected stderr). Silent when not `enabled` (library use)."""

    def __init__(self, enabled: bool, total: int | None, done: int, label: str = "rollout"):
        self.progress = None
        self.plain = None
        self.label = label
        self.total = total
        self.fields = dict(completed=done, tps=0.0, version=0, backlog=0, state="")
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        if not console.is_terminal:
            self.plain = Every()
            return
        self.progress = Progress(
            TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("samples"),
            TextColumn("{task.fields[tps]:.0f} tok/s  v{task.fields[version]}  backlog {task.fields[backlog]}"
                       "  {task.fields[state]}"),
            TimeElapsedColumn(), console=console, transient=False)
        self.task = self.progress.add_task("rollout", total=total, **self.fields)
        self.progress.start()

    def update(self, **fields) -> None:
        self.fields.update(fields)
        if self.progress is not None:
            self.progress.update(self.task, **fields)
        elif self.plain is not None and self.plain.due():
            f = self.fields
            of_total = f"/{self.total}" if self.total else ""
            print(f"{self.label}: {f['completed']}{of_total} samples, {f['tps']:.0f} tok/s, policy v{f['version']}, "
                  f"backlog {f['backlog']}" + (f" ({f['state']})" if f["state"] else ""), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


# ---------------------------------------------------------------- the worker loop
def run_rollout(cfg: RolloutConfig, store: Store, *, stop: threading.Event | None = None,
                show_progress: bool = False) -> RolloutResult:
    """Run one rollout worker until its stop condition; returns what this call published."""
    stop = stop or threading.Event()
    worker = validate_worker_id(cfg.worker_id)
    if cfg.prompts is None:
        raise ValueError("--prompts is required (a parquet, JSONL or datasets file of prompts)")

    # 1. Inputs first: a bad prompt file or tokenizer fails before anything is written.
    run = store.read_run() or {}
    student = cfg.student or run.get("student")
    if student is None:
        raise ValueError("--student is required: this store has no run.json naming the student")
    student = _student_id(student)
    tokenizer = load_tokenizer(student, trust_remote_code=cfg.trust_remote_code, padding_side="left")
    prompts = load_prompts(cfg.prompts, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                           truncate=cfg.truncate_prompts)
    fingerprint = tokenizer_fingerprint(tokenizer)
    student_topk = cfg.student_topk or int(run.get("student_topk", 0))
    if student_topk > len(tokenizer):
        raise ValueError(f"student_topk {student_topk} is larger than the vocabulary ({len(tokenizer)} tokens)")
    run_fields = dict(student=student, tokenizer_fingerprint=fingerprint, vocab_size=len(tokenizer),
                      student_topk=student_topk or None)
    store.check_run(run, **run_fields)  # fail before loading a model; ensure_run checks again

    # 2. The newest policy; run.json is written only once the model has loaded.
    policies = PolicyFiles(store, student)
    version, path = policies.newest_intact(store.latest_version())
    engine = make_engine(cfg, path, tokenizer)
    policies.release(version)
    run = store.ensure_run(**run_fields)

    # 3. Resume from this worker's last shard.
    resume = resume_point(store, worker, run, cfg.seed, len(prompts))
    cursor, total_samples, seq = resume.cursor, resume.samples, resume.next_seq
    stream = PromptStream(len(prompts), cfg.seed, worker)
    prompt_limit = None  # stream position to stop at
    if cfg.max_samples is None and cfg.max_shards is None and not cfg.follow:
        prompt_limit = len(prompts)  # one pass over the prompts

    metrics = MetricsLog(store, "rollout", worker)
    for shard_id in resume.quarantined:  # its prompts are sampled again from `cursor` on
        metrics.log({"event": "shard_quarantined", "shard": shard_id, "resumed_from": resume.last_shard,
                     "cursor": cursor}, flush=True)
    backlog_gauge = BacklogGauge(store)
    buffer = ShardBuffer(student_topk)
    result = RolloutResult(cursor=cursor, total_samples=total_samples, policy_version=version,
                           skipped_prompts=prompts.num_skipped_too_long)
    display = ProgressDisplay(show_progress, cfg.max_samples, total_samples, label=f"rollout {worker}")
    started = time.monotonic()
    backlog = 0
    prompts_per_shard = math.ceil(cfg.flush_rows / cfg.n)

    def flush() -> None:
        nonlocal seq
        if not len(buffer):
            return
        shard_id = make_shard_id(version, worker, seq)
        rows = len(buffer)
        meta = RolloutShardMeta(kind=ROLLOUT, run_id=run["run_id"], tokenizer_fingerprint=fingerprint,
                                shard_id=shard_id, policy_version=version, student_topk=student_topk,
                                cursor=cursor, samples=total_samples, seed=cfg.seed, num_prompts=len(prompts),
                                **engine_fields(engine))
        write_shard(store, store.rollout_path(shard_id), buffer.table(shard_id, version), meta)
        backlog_gauge.rows[shard_id] = rows
        metrics.log({"shard": shard_id, "rows": rows, "tokens": buffer.tokens, "policy_version": version,
                     "cursor": cursor, "total_samples": total_samples, "backlog": backlog,
                     "tokens_per_s": result.tokens / result.generate_seconds if result.generate_seconds else 0.0,
                     "finish_length_frac": buffer.columns["finish_reason"].count("length") / rows})
        result.shards.append(shard_id)
        seq += 1
        buffer.clear()

    def finished() -> bool:
        if stop.is_set() or (cfg.follow and store.is_done()):
            return True
        if cfg.max_samples is not None and total_samples >= cfg.max_samples:
            return True
        if cfg.max_shards is not None and seq >= cfg.max_shards:
            return True
        return prompt_limit is not None and cursor >= prompt_limit

    def must_wait() -> tuple[bool, int]:
        backlog = backlog_gauge.backlog()
        too_stale = version < store.latest_version() - cfg.max_staleness
        return backlog > cfg.max_buffer_samples or too_stale or demand_covered(), backlog

    def demand_covered() -> bool:
        """The published rows and this worker's buffer cover all the trainer's remaining steps still need."""
        return backlog_gauge.demand is not None and backlog_gauge.demand - len(buffer) <= 0

    try:
        while not finished():
            # 4a. A newer policy: publish what the old one sampled (a shard has one version), then reload.
            latest = store.latest_version()
            if latest > version and policies.worth_trying(latest):
                try:
                    path = policies.path(latest)
                except CorruptPolicyError as e:  # keep sampling with the current version until one loads
                    print(f"warning: {e}; keeping policy version {version}", file=sys.stderr)
                    metrics.log({"event": "policy_refused", "policy_version": latest, "reason": str(e)}, flush=True)
                    continue
                flush()
                _check_policy_tokenizer(path, fingerprint, latest)
                engine.load_policy(path)
                policies.release(latest)
                version = result.policy_version = latest
                metrics.log({"event": "reload", "policy_version": version}, flush=True)
                continue  # the flush may have reached a limit

            # 4b. Pace: do not run ahead of the trainer.
            wait, backlog = must_wait()
            display.update(version=version, backlog=backlog, state="waiting for the trainer" if wait else "")
            if wait:
                # the buffer completes the trainer's demand: publish it now, no more rows are coming
                if len(buffer) and (demand_covered() or time.monotonic() - buffer.started >= cfg.flush_seconds):
                    flush()
                stop.wait(cfg.poll_seconds)
                continue

            # 4c. Sample the next batch: whole prompts, no more than the shard / the limits still need.
            count = min(cfg.batch_prompts, prompts_per_shard - len(buffer) // cfg.n)
            if cfg.max_samples is not None:
                count = min(count, math.ceil((cfg.max_samples - total_samples) / cfg.n))
            if prompt_limit is not None:
                count = min(count, prompt_limit - cursor)
            if backlog_gauge.demand is not None:  # no more prompts than the trainer's remaining demand
                count = min(count, math.ceil((backlog_gauge.demand - len(buffer)) / cfg.n))
            positions = stream.take(cursor, count)
            tic = time.monotonic()
            if not len(buffer):
                buffer.started = tic  # flush_seconds counts from when the shard's first batch started
            responses = engine.generate([prompts.prompt_ids[p] for p in positions], cfg.n, cfg.sampling,
                                        student_topk=student_topk, seed=batch_seed(cfg.seed, worker, cursor))
            result.generate_seconds += time.monotonic() - tic
            buffer.add(prompts, positions, responses, cfg.n)
            cursor += count
            total_samples += len(responses)
            result.samples += len(responses)
            result.tokens += sum(len(r.token_ids) for r in responses)
            display.update(completed=total_samples, tps=result.tokens / max(result.generate_seconds, 1e-9))

            # 4d. Publish a shard when it is full or old enough.
            if len(buffer) >= cfg.flush_rows or time.monotonic() - buffer.started >= cfg.flush_seconds:
                flush()
        flush()  # 5. whatever is left (SIGINT/SIGTERM, DONE, limits)
    finally:
        display.close()
        metrics.flush()
        policies.close()
    result.cursor, result.total_samples = cursor, total_samples
    result.seconds = time.monotonic() - started
    return result

