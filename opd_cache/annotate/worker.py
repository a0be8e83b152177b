"""`opd annotate`: the batch teacher job (DESIGN.md §2, §3, §5, §6).

A worker finds rollout shards that have no part for its teacher yet, scores
them with the teacher, and publishes `annotated/v<version>/<shard_id>/<teacher>.arrow`:
per response position, the teacher's top-k ids and log-probs, the log-prob of
the sampled token, and (when the rollout recorded the student's top-k ids)
the teacher's log-probs at those ids.

    list rollouts -> keep mine (stable hash) and unannotated -> skip too-stale
      -> read + validate (corrupt: quarantine) -> route rows -> score -> write atomically

Properties the rest of the system relies on:
- **Before any shard is scored** (and before the teacher's weights load when
  run.json is already there; `opd run` starts every stage at once, so there
  the teacher loads while rollout creates run.json, then waits for it) the
  teacher's tokenizer is checked against the run's
  (the student's), and the teacher records itself (model, top_k, routing) in
  `run/teachers/<name>.json` (a create-if-absent object, never run.json) so
  that a contradicting worker fails instead of writing incompatible parts.
- **No coordinator:** workers claim shards through leases in the store
  (annotate/leases.py), so they can join and leave at any time; or, with
  `num_workers` n > 1, worker i takes the shards whose crc32(shard_id) % n is i
  (crc32 is stable across processes and machines; Python's `hash` is salted).
- **Idempotent:** the output name depends only on (shard, teacher); a part
  that exists is never rewritten, and rewriting one would give the same bytes.
  Killed mid-shard, a worker leaves at most an ignored `*.tmp-*` file.
- **Routing:** with `routing` configured, a teacher annotates only the rows
  whose key column routes to it, in rollout order; a shard with none of its
  rows still gets a (zero-row) part, so "annotated by every teacher" is
  decidable from a listing.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from opd_cache.annotate.leases import LeaseBook
from opd_cache.config import AnnotateConfig
from opd_cache.engine import engine_fields
from opd_cache.flow.staleness import is_too_stale, staleness_window
from opd_cache.observe.metrics import MetricsLog
from opd_cache.observe.progress import Every
from opd_cache.storage import layout
from opd_cache.storage.codec import META_ID_BITS, encode_annotation
from opd_cache.storage.manifest import plain
from opd_cache.storage.schema import (
    ANNOTATED,
    ROLLOUT,
    ShardError,
    ShardMeta,
    annotated_table,
    count_rows,
    flat_values,
    list_lengths,
    read_shard,
    write_shard,
)
from opd_cache.storage.store import RunManifest, ShardInfo, ShardWatch, Store, TeacherRecord, validate_name
from opd_cache.tokenizer import check_compatible, load_tokenizer, tokenizer_fingerprint


def shard_owner(shard_id: str, num_workers: int) -> int:
    """Which worker annotates `shard_id`: the same answer in every process, on every machine."""
    return zlib.crc32(shard_id.encode()) % num_workers


@dataclass
class AnnotateStats:
    annotated: list[str] = field(default_factory=list)  # shard ids this run wrote a part for
    skipped_stale: list[str] = field(default_factory=list)  # too old for the trainer: left unannotated
    quarantined: list[str] = field(default_factory=list)  # unreadable rollout shards moved to quarantine/
    rows: int = 0
    tokens: int = 0  # response tokens scored
    seconds: float = 0.0  # wall time spent on shards (read, score, write)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


# ---------------------------------------------------------------- checks before any compute
def _student_tokenizer(store: Store, run: RunManifest):
    """The run's tokenizer, when it can be loaded here (the student folder, or a published policy)."""
    candidates = []
    if run.student and os.path.isdir(run.student):
        candidates.append(run.student)
    if store.local_dir(layout.POLICY) is not None:  # a local store: published policies, read in place
        candidates += [str(store.local_dir(layout.policy_dir(v))) for v in reversed(store.policy_versions())]
    for path in candidates:
        try:
            return load_tokenizer(path)
        except (OSError, ValueError):
            continue
    return None


def _embedding_size(model_path: str, trust_remote_code: bool) -> int | None:
    """The teacher's output size from its config.json (no weights are loaded)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    return getattr(config.get_text_config(), "vocab_size", None)


def check_teacher_tokenizer(
    store: Store, run: RunManifest, teacher_tok, teacher: str, embedding_size: int | None
) -> None:
    """Teacher and student must map every id to the same token; raise naming both models and the difference."""
    student = run.student or "student"
    expected = run.tokenizer_fingerprint
    got = tokenizer_fingerprint(teacher_tok)
    # the fingerprint hashes the vocabulary and the special tokens: when it matches, loading the student's
    # tokenizer to compare them token by token would only repeat that work
    student_tok = _student_tokenizer(store, run) if got != expected else None
    if student_tok is not None:
        # names the first differing token; also refuses tokenizer ids beyond the teacher's embedding
        check_compatible(student_tok, teacher_tok, embedding_size, student_name=student, teacher_name=teacher)
    if expected and got != expected:
        raise ValueError(
            f"teacher {teacher} and student {student} tokenizers differ: the teacher's fingerprint is "
            f"{got}, the run's (run.json) is {expected}"
        )
    if run.vocab_size is not None and len(teacher_tok) != run.vocab_size:
        raise ValueError(
            f"teacher {teacher}: its tokenizer has {len(teacher_tok)} tokens, the run's has "
            f"{run.vocab_size} (run.json vocab_size)"
        )
    if embedding_size is not None and embedding_size < len(teacher_tok):
        raise ValueError(
            f"teacher {teacher}: the tokenizer has {len(teacher_tok)} tokens but the model's embedding "
            f"has only {embedding_size} rows (ids >= {embedding_size} cannot be scored)"
        )


# ---------------------------------------------------------------- the worker
class Annotator:
    """One annotate worker: `Annotator(store, cfg).run()`; `scorer=` injects an already loaded engine."""

    def __init__(
        self,
        store: Store,
        cfg: AnnotateConfig,
        *,
        scorer=None,
        console: Console | None = None,
        progress: bool | None = None,
    ):
        self.store = store
        self.cfg = cfg
        self.teacher = validate_name("teacher name", cfg.teacher_name)
        if not cfg.teacher:
            raise ValueError("--teacher: no teacher model given (a checkpoint folder or hub id)")
        self.teacher_path = os.path.abspath(cfg.teacher) if os.path.isdir(cfg.teacher) else cfg.teacher
        self.console = console or Console(stderr=True)
        # with --follow a store without run.json yet is waited for (`opd run` starts every stage at once)
        run = store.manifest.read() if cfg.follow else store.manifest.require()

        # 1. tokenizer compatibility and k: checked against run.json before any weights are loaded, when it
        #    exists; otherwise the teacher loads while rollout creates it, and nothing is scored before the check
        teacher_tok = load_tokenizer(cfg.teacher, trust_remote_code=cfg.trust_remote_code)
        embedding_size = _embedding_size(cfg.teacher, cfg.trust_remote_code)
        self.vocab_size = len(teacher_tok)
        record = self._agree_with_run(run, teacher_tok, embedding_size) if run is not None else None

        # 2. the engine. vLLM's is sized by top_k, which an unflagged worker takes from the store: it waits first
        if scorer is None and (record is not None or cfg.engine != "vllm" or "top_k" in cfg.model_fields_set):
            scorer = make_scorer(cfg, record.top_k if record is not None else cfg.top_k, self.vocab_size)
        if record is None:
            run = store.manifest.wait(cfg.poll_seconds, say=lambda line: self.console.print(line, soft_wrap=True))
            record = self._agree_with_run(run, teacher_tok, embedding_size)
        self.scorer = scorer if scorer is not None else make_scorer(cfg, self.top_k, self.vocab_size)

        # 3. record this teacher; a store changed meanwhile by a contradicting worker fails here
        self.run_info = store.manifest.register_teacher(record)
        self.max_staleness = cfg.max_staleness  # the configuration's one bound (opd_cache/flow/staleness.py)
        self.union_support = cfg.engine == "hf"  # vLLM cannot gather log-probs at arbitrary ids
        self._warned_no_support = False
        worker = cfg.worker_id or f"{self.teacher}-{cfg.worker_index}"
        self.metrics = MetricsLog(store, "annotate", worker)
        # one worker of n (static split) takes its shards unasked; otherwise every shard is claimed by a lease
        self.leases = (
            LeaseBook(store, self.teacher, worker, cfg.lease_seconds)
            if cfg.num_workers == 1 and cfg.lease_seconds is not None
            else None
        )
        self.show_progress = self.console.is_terminal if progress is None else progress
        # not on a terminal (the log file of `opd run`): a plain line every ~10 s instead of the bar
        self.plain_progress = Every() if progress is None and not self.console.is_terminal else None
        self.stats = AnnotateStats()
        self._watch = ShardWatch(store, parts=True)  # lists the versions still worth annotating, not the history
        self.scored_rows: dict[str, int] = {}  # rollout rows of the shards with this teacher's part (any worker)
        self._scored_since_poll: set[str] = set()  # parts this worker wrote that the last poll could not list

    def _agree_with_run(self, run: RunManifest, teacher_tok, embedding_size: int | None) -> TeacherRecord:
        """This teacher's record, checked against the run: its tokenizer, k and routing (sets top_k, routing)."""
        cfg, store = self.cfg, self.store
        check_teacher_tokenizer(store, run, teacher_tok, cfg.teacher, embedding_size)
        # flags/YAML win; otherwise an existing store keeps its top_k and routing
        given = cfg.model_fields_set
        self.top_k = cfg.top_k if "top_k" in given or run.top_k is None else run.top_k
        if self.top_k > self.vocab_size:
            raise ValueError(
                f"--top-k {self.top_k} is larger than the vocabulary of teacher {cfg.teacher} "
                f"({self.vocab_size} tokens)"
            )
        routing = None
        if cfg.routing:
            routing = {"key": cfg.routing_key, "map": dict(cfg.routing), "default": cfg.default_teacher}
        # what this worker assumes must agree with the store: checked before the slow model load where it can
        # be, but recorded only after it, so a teacher that cannot be loaded leaves the store untouched
        record = TeacherRecord(
            name=self.teacher,
            model=self.teacher_path,
            top_k=self.top_k,
            routing=routing or run.routing,
            tokenizer_fingerprint=tokenizer_fingerprint(teacher_tok),
            vocab_size=self.vocab_size,
            codec=cfg.codec,
        )
        store.manifest.check_teacher(record)
        self.routing = plain(record.routing)
        if self.routing and self.teacher not in {*self.routing["map"].values(), self.routing.get("default")}:
            raise ValueError(
                f"--teacher-name {self.teacher}: the routing in run.json sends no rows to it "
                f"(teachers: {sorted(set(self.routing['map'].values()))}, default "
                f"{self.routing.get('default')!r})"
            )
        return record

    # ---------------------------------------------------------------- what to do
    def pending_shards(self) -> list[ShardInfo]:
        """This worker's rollout shards without this teacher's part, oldest first (stale ones included).

        One poll lists the partitions of the versions still worth annotating (`ShardWatch`): the staleness
        window below LATEST (older shards published late come in through the watch's sweep, one old version
        per poll).
        """
        shards = self._watch.poll(*staleness_window(self.store.latest_version(), self.max_staleness))
        self._scored_since_poll = set()
        if self.leases is not None:
            self.leases.poll()
        parts = self._watch.parts
        return [
            s
            for s in shards
            if self.teacher not in parts.get(s.shard_id, ())
            and shard_owner(s.shard_id, self.cfg.num_workers) == self.cfg.worker_index
        ]

    def demand_covered(self) -> bool:
        """Demand-aware pacing (issue #14): shards with this teacher's part cover the trainer's remaining steps.

        Coverage is their rows less those the trainer is done with (consumed, expired, lost); it must reach what the
        remaining steps train, `samples_needed_total` less trained. No demand known (no trainer progress, a
        token budget per step) or the trainer DONE: False, annotate works as before.
        """
        progress = self.store.read_progress()
        needed = progress.get("samples_needed_total")
        if needed is None or self.store.is_done():
            return False
        for shard in self._watch.shards:  # the last poll's: the first one listed the whole history
            if self.teacher not in self._watch.parts.get(shard.shard_id, ()):
                if shard.shard_id not in self._scored_since_poll:
                    self.scored_rows.pop(shard.shard_id, None)  # its part was quarantined: to be scored again
            elif shard.shard_id not in self.scored_rows:
                try:
                    self.scored_rows[shard.shard_id] = count_rows(self.store, shard.path)
                except (OSError, pa.ArrowInvalid):
                    self.scored_rows[shard.shard_id] = 0  # unreadable: quarantined, never trained
        # done with: consumed, expired, or lost (a damaged rollout shard the trainer quarantined)
        used = sum(int(progress.get(key, 0)) for key in ("consumed_samples", "expired_samples", "lost_samples"))
        return sum(self.scored_rows.values()) - used >= int(needed) - int(progress.get("trained_samples", 0))

    def too_stale(self, info: ShardInfo, latest_version: int) -> bool:
        """The trainer (at version >= latest) can no longer use rows from this shard's policy version."""
        return is_too_stale(info.policy_version, latest_version, self.max_staleness)

    # ---------------------------------------------------------------- the loop
    def run(self) -> AnnotateStats:
        """Annotate until nothing is pending (or `max_shards`); with `follow`, until the trainer's DONE marker."""
        columns = [
            TextColumn(f"[bold]annotate[/] {self.teacher}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("shards  {task.fields[tps]:,.0f} tok/s  backlog {task.fields[backlog]}"),
            TimeElapsedColumn(),
        ]
        with Progress(*columns, console=self.console, disable=not self.show_progress) as progress:
            task = progress.add_task("annotate", total=None, tps=0.0, backlog=0)
            try:
                self._loop(progress, task)
            finally:
                self.metrics.flush()
        return self.stats

    def _loop(self, progress: Progress, task) -> None:
        stale_seen: set[str] = set()
        while True:
            if self.cfg.follow and self.store.is_done():
                return
            pending = [s for s in self.pending_shards() if s.shard_id not in stale_seen]
            self._print_progress(backlog=len(pending))
            worked = False
            for i, info in enumerate(pending):
                if self._limit_reached() or (self.cfg.follow and self.store.is_done()):
                    return
                backlog = len(pending) - i
                progress.update(task, total=len(self.stats.annotated) + backlog, backlog=backlog)
                if self.too_stale(info, self.store.latest_version()):
                    stale_seen.add(info.shard_id)
                    self.stats.skipped_stale.append(info.shard_id)
                    self.metrics.log(
                        {"event": "skipped_stale", "shard_id": info.shard_id, "policy_version": info.policy_version}
                    )
                    continue
                if self.demand_covered():
                    break  # the trainer's remaining steps are covered: look again after the next poll
                worked |= self.annotate_shard(info, backlog=backlog - 1)
                progress.update(
                    task, completed=len(self.stats.annotated), tps=self.stats.tokens_per_second, backlog=backlog - 1
                )
                self._print_progress(backlog=backlog - 1)
            if self._limit_reached() or (not worked and not self.cfg.follow):
                return
            if not worked:
                time.sleep(self.cfg.poll_seconds)

    def _print_progress(self, backlog: int) -> None:
        if self.plain_progress is not None and self.plain_progress.due():
            self.console.print(
                f"annotate {self.teacher}: {len(self.stats.annotated)} shards, {self.stats.rows} rows, "
                f"{self.stats.tokens_per_second:,.0f} tok/s, {backlog} pending",
                highlight=False,
                soft_wrap=True,
            )

    def _limit_reached(self) -> bool:
        return self.cfg.max_shards is not None and len(self.stats.annotated) >= self.cfg.max_shards

    # ---------------------------------------------------------------- one shard
    def annotate_shard(self, info: ShardInfo, backlog: int = 0) -> bool:
        """Score one rollout shard and publish this teacher's part; False if there was nothing to do."""
        part = layout.annotated_path(info.shard_id, self.teacher)
        if self.store.exists(part):  # written since the listing (a restarted or duplicate worker)
            return False
        if self.leases is None:
            return self._score_shard(info, part, backlog, lease=None)
        lease = self.leases.claim(info.shard_id)
        if lease is None:
            return False  # another live worker holds its lease
        with lease:  # renewed while scoring, deleted afterwards
            return self._score_shard(info, part, backlog, lease)

    def _score_shard(self, info: ShardInfo, part: str, backlog: int, lease) -> bool:
        start = time.perf_counter()
        try:
            table, meta = read_shard(self.store, info.path, kind=ROLLOUT, run=self.run_info)
            if meta.shard_id != info.shard_id:
                raise ShardError(f"{self.store.path(info.path)}: its metadata names shard {meta.shard_id!r}")
            rows = self._routed_rows(table)
            prompts, responses, support = self._token_arrays(rows, info)
        except FileNotFoundError:
            return False  # moved away (e.g. quarantined by another process) since the listing
        except ShardError as e:
            self.store.quarantine(info.path, str(e))
            self.stats.quarantined.append(info.shard_id)
            self.metrics.log({"event": "quarantined", "shard_id": info.shard_id, "reason": str(e)}, flush=True)
            self.console.print(f"[yellow]quarantined[/] {info.path}: {e}", highlight=False, soft_wrap=True)
            return True

        scores = self.scorer.score(prompts, responses, self.top_k, support)
        out = annotated_table(
            sample_ids=rows["sample_id"].to_pylist(),
            lengths=scores.lengths,
            topk_ids=scores.topk_ids,
            topk_logprobs=scores.topk_logprobs,
            token_logprob=scores.token_logprob,
            logprob_dtype=self.cfg.dtype,
            support_logprobs=scores.support_logprobs,
        )
        out_meta = ShardMeta(
            kind=ANNOTATED,
            run_id=self.run_info.run_id,
            tokenizer_fingerprint=self.run_info.tokenizer_fingerprint,
            shard_id=info.shard_id,
            policy_version=meta.policy_version,
            top_k=self.top_k,
            teacher=self.teacher,
            student_topk=meta.student_topk if support is not None else 0,
            **engine_fields(self.scorer),
        )
        if self.cfg.codec == "packed":
            out, codec_meta = encode_annotation(out, self.vocab_size)
            out_meta.codec, out_meta.codec_id_bits = "packed", int(codec_meta[META_ID_BITS])
        compression = None if self.cfg.compression == "none" else self.cfg.compression
        if lease is not None and (not lease.still_mine() or self.store.exists(part)):
            # frozen past the expiry and taken over: only the current holder publishes (annotate/leases.py)
            self.metrics.log({"event": "lease_lost", "shard_id": info.shard_id}, flush=True)
            self.console.print(f"lease lost: {info.shard_id} (taken over by another worker)", highlight=False)
            return False
        write_shard(self.store, part, out, out_meta, compression=compression)
        self.scored_rows[info.shard_id] = table.num_rows  # coverage for pacing before the next listing shows it
        self._scored_since_poll.add(info.shard_id)

        seconds = time.perf_counter() - start
        self.stats.annotated.append(info.shard_id)
        self.stats.rows += rows.num_rows
        self.stats.tokens += scores.num_tokens
        self.stats.seconds += seconds
        self.metrics.log(
            {
                "event": "annotated",
                "shard_id": info.shard_id,
                "policy_version": meta.policy_version,
                "rows": rows.num_rows,
                "tokens": scores.num_tokens,
                "seconds": round(seconds, 4),
                "tokens_per_s": round(scores.num_tokens / max(seconds, 1e-9), 1),
                "backlog": backlog,
            }
        )
        return True

    def _routed_rows(self, table: pa.Table) -> pa.Table:
        """The rows this teacher annotates, in rollout order (all of them without routing)."""
        if not self.routing:
            return table
        key = self.routing["key"]
        if key not in table.schema.names:
            raise ValueError(
                f"routing key {key!r} is not a column of the rollout shards "
                f"(columns: {', '.join(table.schema.names)}); set annotate.routing_key"
            )
        values = pc.cast(table[key], pa.string())
        mine = [v for v, t in self.routing["map"].items() if t == self.teacher]
        mask = pc.fill_null(pc.is_in(values, value_set=pa.array(mine, pa.string())), False)
        if self.routing.get("default") == self.teacher:
            unlisted = pc.invert(
                pc.fill_null(pc.is_in(values, value_set=pa.array(list(self.routing["map"]), pa.string())), False)
            )
            mask = pc.or_(mask, unlisted)
        return table.filter(mask)

    def _token_arrays(self, rows: pa.Table, info: ShardInfo):
        """Per-row id arrays (views into the Arrow buffers), after checking every id is in the vocabulary."""
        columns = ["prompt_ids", "response_ids"]
        if "student_topk_ids" in rows.schema.names:
            if self.union_support:
                columns.append("student_topk_ids")
            elif not self._warned_no_support:
                self._warned_no_support = True
                self.console.print(
                    f"[yellow]note:[/] {info.path} has student_topk_ids, but --engine {self.cfg.engine} "
                    f"cannot score them; parts get no teacher_support_logprobs (use --engine hf for "
                    f"union support)",
                    highlight=False,
                    soft_wrap=True,
                )
        arrays = []
        for name in columns:
            flat = flat_values(rows[name])
            if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
                bad = int(flat.max()) if flat.max() >= self.vocab_size else int(flat.min())
                raise ShardError(
                    f"{self.store.path(info.path)}: column {name!r} holds token id {bad}, outside the "
                    f"vocabulary 0..{self.vocab_size - 1}"
                )
            boundaries = np.cumsum(list_lengths(rows[name]))[:-1]
            arrays.append(np.split(flat, boundaries) if rows.num_rows else [])
        prompts, responses = arrays[0], arrays[1]
        return prompts, responses, (arrays[2] if len(arrays) == 3 else None)


# ---------------------------------------------------------------- engines and entry point
def make_scorer(cfg: AnnotateConfig, top_k: int, vocab_size: int):
    """The configured scoring engine, loaded once per worker."""
    if cfg.engine == "vllm":
        from opd_cache.annotate.vllm_score import VLLMScorer

        return VLLMScorer(
            cfg.teacher,
            max_top_k=top_k,
            model_dtype=cfg.model_dtype,
            tensor_parallel_size=cfg.tensor_parallel_size,
            trust_remote_code=cfg.trust_remote_code,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            vocab_limit=vocab_size,
        )
    from opd_cache.annotate.hf_score import HFScorer

    return HFScorer.load(
        cfg.teacher,
        model_dtype=cfg.model_dtype,
        device=cfg.device,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
        max_tokens_per_batch=cfg.max_tokens_per_batch,
        head_chunk_tokens=cfg.head_chunk_tokens,
        padding_side=cfg.padding_side,
        vocab_limit=vocab_size,
    )


def annotate(store: Store, cfg: AnnotateConfig, **kwargs) -> AnnotateStats:
    """Run one annotate worker to completion (see `Annotator`)."""
    return Annotator(store, cfg, **kwargs).run()
