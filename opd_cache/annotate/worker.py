"""`opd annotate`: the batch teacher job (docs/design.md §2, §3, §5, §6).

A worker finds rollout shards that have no part for its teacher yet, scores
them with the teacher, and publishes `annotated/v<version>/<shard_id>/<teacher>.arrow`:
per response position, the teacher's top-k ids and log-probs, the log-prob of
the sampled token, and (when the rollout recorded the student's top-k ids)
the teacher's log-probs at those ids.

    list rollouts -> keep mine (stable hash) and unannotated -> skip too-stale      (selection.py)
      -> read + validate (corrupt: quarantine) -> route rows -> score -> write atomically

Properties the rest of the system relies on:
- **Before any shard is scored** (and before the teacher's weights load when
  run.json is already there; `opd run` starts every stage at once, so there
  the teacher loads while rollout creates run.json, then waits for it) the
  teacher's tokenizer is checked against the run's
  (the student's; teacher_checks.py), and the teacher records itself (model, top_k, routing) in
  `run/teachers/<name>.json` (a create-if-absent object, never run.json) so
  that a contradicting worker fails instead of writing incompatible parts.
- **No coordinator:** workers claim shards through leases in the store
  (annotate/leases.py), so they can join and leave at any time; or, with
  `num_workers` n > 1, worker i takes the shards whose crc32(shard_id) % n is i
  (annotate/selection.py).
- **Idempotent:** the output name depends only on (shard, teacher); a part that exists is never rewritten, and
  rewriting one would give the same bytes. Killed mid-shard, a worker leaves at most an ignored `*.tmp-*` file.
- **Routing:** with `routing` configured, a teacher annotates only the rows whose key column routes to it, in
  rollout order; a shard with none of its rows still gets a (zero-row) part, so "annotated by every teacher" is
  decidable from a listing.
- **Multi-turn rows** are re-rendered for a teacher with its own chat template or tokenizer (rerender.py).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from opd_cache.annotate import rerender
from opd_cache.annotate.cross_annotate import CrossTokenizerAnnotation, cross_tokenizer_annotation
from opd_cache.annotate.engines import make_scorer
from opd_cache.annotate.leases import LeaseBook
from opd_cache.annotate.selection import ShardSelection, shard_owner
from opd_cache.annotate.teacher_checks import check_teacher_tokenizer, embedding_size_of
from opd_cache.annotate.trained_positions import keep_trained_positions
from opd_cache.config import AnnotateConfig, Config
from opd_cache.engine import Scorer, engine_fields
from opd_cache.observe.metrics import MetricsLog
from opd_cache.observe.progress import Every
from opd_cache.storage import layout
from opd_cache.storage.codec import META_ID_BITS, encode_annotation
from opd_cache.storage.manifest import Routing
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
from opd_cache.storage.store import RunManifest, ShardInfo, Store, TeacherRecord, validate_name
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint

__all__ = ["AnnotateStats", "Annotator", "make_scorer", "run_annotate", "shard_owner"]


@dataclass
class AnnotateStats:
    annotated: list[str] = field(default_factory=list)  # shard ids this run wrote a part for
    skipped_stale: list[str] = field(default_factory=list)  # too old for the trainer: left unannotated
    skipped_expired: list[str] = field(default_factory=list)  # past the trainer's deadline (#25): left unannotated
    skipped_expired_rows: int = 0
    quarantined: list[str] = field(default_factory=list)  # unreadable rollout shards moved to quarantine/
    rows: int = 0
    tokens: int = 0  # response tokens scored
    seconds: float = 0.0  # wall time spent on shards (read, score, write)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class TokenArrays(NamedTuple):
    """The token ids of the rows a teacher scores, one array per row (views into the Arrow buffers)."""

    prompts: list[np.ndarray]
    responses: list[np.ndarray]
    support: list[np.ndarray] | None  # the student's top-k ids per position (union support); None: not scored


# ---------------------------------------------------------------- the worker
class Annotator:
    """One annotate worker: `__init__` checks the teacher against the run and loads it (phases 1-3), `run()`
    annotates. `scorer=` injects an already loaded engine."""

    # the configuration
    cfg: AnnotateConfig  # config.annotate
    max_staleness: int  # the configuration's one bound (flow/staleness.py): shards past it are skipped
    store: Store
    teacher: str  # this teacher's name: its parts are annotated/v<version>/<shard>/<teacher>.arrow
    teacher_path: str  # its checkpoint (absolute when a local folder), as recorded
    console: Console  # messages (quarantined shards, lost leases) and the progress
    stop: threading.Event  # set: the worker returns after the shard it is scoring
    # 1. agreement with the run: tokenizer, k and routing, checked before any weights load when run.json exists
    vocab_size: int  # the teacher tokenizer's
    cross: CrossTokenizerAnnotation | None  # a teacher of another tokenizer (cross_annotate.py); None: the same
    ids_vocab_size: int  # the vocabulary of the rollouts' and the parts' ids: the student's (= vocab_size unless cross)
    rendering: rerender.ConversationRendering | None  # multi-turn rows in the teacher's own rendering
    top_k: int  # teacher log-probs kept per token: the flag's, else the store's
    routing: Routing | None  # which rows go to which teacher (None: every row to this one)
    # 2. the engine
    scorer: Scorer  # annotate.engine (engines.py)
    # 3. the run with this teacher registered, and how this worker takes its shards
    run_info: RunManifest
    union_support: bool  # also score the student's top-k ids (the hf engine only)
    metrics: MetricsLog
    leases: LeaseBook | None  # claims each shard (one worker of any number); None: the static split, or none
    selection: ShardSelection  # which shards are pending; the rows scored, for pacing (selection.py)
    # 4. progress
    show_progress: bool  # the rich bar
    plain_progress: Every | None  # not on a terminal: a plain line every ~10 s instead
    stats: AnnotateStats  # what this worker did
    _warned_no_support: bool  # the note that this engine cannot score union support was printed (once)

    def __init__(
        self,
        config: Config,
        store: Store,
        *,
        scorer: Scorer | None = None,
        stop: threading.Event | None = None,
        console: Console | None = None,
        progress: bool | None = None,
    ):
        cfg = self.cfg = config.annotate
        self.max_staleness, self.store = config.max_staleness, store
        self.teacher = validate_name("teacher name", cfg.teacher_name)
        if not cfg.teacher:
            raise ValueError("--teacher: no teacher model given (a checkpoint folder or hub id)")
        self.teacher_path = os.path.abspath(cfg.teacher) if os.path.isdir(cfg.teacher) else cfg.teacher
        self.console = console or Console(stderr=True)
        self.stop = stop or threading.Event()
        self.bell = store.bell(layout.ROLLOUTS, layout.TRAIN)  # new shards; the trainer's schedule, DONE
        # with --follow a store without run.json yet is waited for (`opd run` starts every stage at once)
        run = store.manifest.read() if cfg.follow else store.manifest.require()

        # 1. tokenizer compatibility and k: checked against run.json before any weights are loaded, when it
        #    exists; otherwise the teacher loads while rollout creates it, and nothing is scored before the check
        teacher_tok = load_tokenizer(cfg.teacher, trust_remote_code=cfg.trust_remote_code)
        embedding_size = embedding_size_of(cfg.teacher, cfg.trust_remote_code)
        self.vocab_size = self.ids_vocab_size = len(teacher_tok)
        self.cross = None
        record = self._agree_with_run(run, teacher_tok, embedding_size) if run is not None else None

        # 2. the engine. vLLM's is sized by top_k, which an unflagged worker takes from the store: it waits first
        if scorer is None and (record is not None or cfg.engine != "vllm" or "top_k" in cfg.model_fields_set):
            scorer = make_scorer(cfg, record.top_k if record is not None else cfg.top_k, self.vocab_size)
        if record is None:
            run = store.manifest.wait(cfg.poll_seconds, say=lambda line: self.console.print(line, soft_wrap=True))
            record = self._agree_with_run(run, teacher_tok, embedding_size)
        self.top_k, self.routing = record.top_k, record.routing
        self.rendering = rerender.conversation_rendering(config, teacher_tok, self.cross)  # multi-turn rows
        self.scorer = scorer if scorer is not None else make_scorer(cfg, self.top_k, self.vocab_size)

        # 3. record this teacher (a store changed meanwhile by a contradicting worker fails here), then how this
        #    worker takes shards: one worker of n (static split) takes its shards unasked; otherwise every shard is
        #    claimed by a lease
        self.run_info = store.manifest.register_teacher(record)
        self.union_support = cfg.engine == "hf"  # vLLM cannot gather log-probs at arbitrary ids
        worker = cfg.worker_id or f"{self.teacher}-{cfg.worker_index}"
        self.metrics = MetricsLog(store, "annotate", worker)
        leased = cfg.num_workers == 1 and cfg.lease_seconds is not None
        self.leases = LeaseBook(store, self.teacher, worker, cfg.lease_seconds) if leased else None
        self.selection = ShardSelection(
            store,
            self.teacher,
            max_staleness=self.max_staleness,
            worker_index=cfg.worker_index,
            num_workers=cfg.num_workers,
            leases=self.leases,
        )

        # 4. progress: not on a terminal (the log file of `opd run`), a plain line every ~10 s instead of the bar
        self.show_progress = self.console.is_terminal if progress is None else progress
        self.plain_progress = Every() if progress is None and not self.console.is_terminal else None
        self.stats = AnnotateStats()
        self._warned_no_support = False

    def _agree_with_run(self, run: RunManifest, teacher_tok, embedding_size: int | None) -> TeacherRecord:
        """This teacher's record (its k and routing), checked against the run: tokenizer, k and routing."""
        cfg, store = self.cfg, self.store
        self.cross = cross_tokenizer_annotation(
            store,
            run,
            teacher_tok,
            enabled=cfg.cross_tokenizer,
            topk_rule=cfg.cross_tokenizer_topk,
            teacher=cfg.teacher,
        )
        if self.cross is None:
            check_teacher_tokenizer(store, run, teacher_tok, cfg.teacher, embedding_size)
        cross_fields = self.cross.record_fields() if self.cross is not None else {}
        self.ids_vocab_size = cross_fields.get("vocab_size", self.vocab_size)
        # flags/YAML win; otherwise an existing store keeps its top_k and routing
        given = cfg.model_fields_set
        top_k = cfg.top_k if "top_k" in given or run.top_k is None else run.top_k
        if top_k > self.vocab_size:
            raise ValueError(
                f"--top-k {top_k} is larger than the vocabulary of teacher {cfg.teacher} ({self.vocab_size} tokens)"
            )
        routing = Routing(key=cfg.routing_key, map=cfg.routing, default=cfg.default_teacher) if cfg.routing else None
        # what this worker assumes must agree with the store: checked before the slow model load where it can
        # be, but recorded only after it, so a teacher that cannot be loaded leaves the store untouched
        record = TeacherRecord(
            name=self.teacher,
            model=self.teacher_path,
            top_k=top_k,
            routing=routing or run.routing,
            tokenizer_fingerprint=tokenizer_fingerprint(teacher_tok),
            vocab_size=self.vocab_size,
            codec=cfg.codec,
        ).model_copy(update={**cross_fields, **rerender.template_record_fields(cfg)})  # cross: the student's tokenizer
        store.manifest.check_teacher(record)
        if record.routing is not None and self.teacher not in record.routing.teachers():
            raise ValueError(
                f"--teacher-name {self.teacher}: the routing in run.json sends no rows to it "
                f"(teachers: {sorted(set(record.routing.map.values()))}, default "
                f"{record.routing.default!r})"
            )
        return record

    # ---------------------------------------------------------------- the loop
    def run(self) -> AnnotateStats:
        """Annotate until nothing is pending (or `max_shards`, or `stop`); with `follow`, until the trainer's DONE."""
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
            schedule = self.selection.read_schedule()
            if self._stopped():  # after the schedule's read: see the loop below
                return
            pending = [s for s in self.selection.pending() if s.shard_id not in stale_seen]
            pending = self.selection.by_deadline(pending, schedule)  # the shard that expires first, first (#25)
            listed = time.monotonic()
            self._print_progress(backlog=len(pending))
            worked = False
            for i, info in enumerate(pending):
                if i:
                    schedule = self.selection.read_schedule()  # the trainer moved on while the last shard scored
                # after the schedule's read: a DONE between the two looks drops it, and the shard is scored for no step
                if self._limit_reached() or self._stopped():
                    return
                backlog = len(pending) - i
                progress.update(task, total=len(self.stats.annotated) + backlog, backlog=backlog)
                if self.selection.expired(info, schedule):
                    stale_seen.add(info.shard_id)
                    self._skip_expired(info, schedule)
                    continue
                if self.selection.too_stale(info, self.store.latest_version()):
                    stale_seen.add(info.shard_id)
                    self.stats.skipped_stale.append(info.shard_id)
                    self.metrics.log(
                        {"event": "skipped_stale", "shard_id": info.shard_id, "policy_version": info.policy_version}
                    )
                    continue
                if schedule is None and self.selection.demand_covered():
                    break  # the trainer's remaining steps are covered: look again after the next poll
                worked |= self.annotate_shard(info, backlog=backlog - 1)
                progress.update(
                    task, completed=len(self.stats.annotated), tps=self.stats.tokens_per_second, backlog=backlog - 1
                )
                self._print_progress(backlog=backlog - 1)
                if worked and time.monotonic() - listed >= self.cfg.poll_seconds:
                    break  # list again: a shard with an earlier deadline (a late one) may be out
            if self._limit_reached() or (not worked and not self.cfg.follow):
                return
            if not worked:
                self.bell.wait(self.cfg.poll_seconds, self.stop)

    def _skip_expired(self, info: ShardInfo, schedule) -> None:
        """A shard no remaining step can train: left unscored, recorded with its rows (#25)."""
        try:
            rows = count_rows(self.store, info.path)
        except (OSError, pa.ArrowInvalid):
            rows = 0  # unreadable: the trainer quarantines it when it comes to it
        self.stats.skipped_expired.append(info.shard_id)
        self.stats.skipped_expired_rows += rows
        self.metrics.log(
            {
                "event": "skipped_expired",
                "shard_id": info.shard_id,
                "policy_version": info.policy_version,
                "rows": rows,
                "deadline_step": schedule.deadline_step(info.policy_version),
                "trainer_next_step": schedule.next_step,
            }
        )

    def _print_progress(self, backlog: int) -> None:
        if self.plain_progress is not None and self.plain_progress.due():
            expired = self.stats.skipped_expired
            self.console.print(
                f"annotate {self.teacher}: {len(self.stats.annotated)} shards, {self.stats.rows} rows, "
                f"{self.stats.tokens_per_second:,.0f} tok/s, {backlog} pending"
                + (f", {len(expired)} skipped expired ({self.stats.skipped_expired_rows} rows)" if expired else ""),
                highlight=False,
                soft_wrap=True,
            )

    def _limit_reached(self) -> bool:
        return self.cfg.max_shards is not None and len(self.stats.annotated) >= self.cfg.max_shards

    def _stopped(self) -> bool:
        """The caller's stop, or (with follow) the trainer's train/DONE."""
        return self.stop.is_set() or (self.cfg.follow and self.store.is_done())

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
            tokens = self._token_arrays(rows, info)
        except FileNotFoundError:
            return False  # moved away (e.g. quarantined by another process) since the listing
        except ShardError as e:
            self.store.quarantine(info.path, str(e))
            self.stats.quarantined.append(info.shard_id)
            self.metrics.log({"event": "quarantined", "shard_id": info.shard_id, "reason": str(e)}, flush=True)
            self.console.print(f"[yellow]quarantined[/] {info.path}: {e}", highlight=False, soft_wrap=True)
            return True

        targets = None
        if self.rendering is not None and rerender.has_conversations(rows):  # in the teacher's rendering
            targets = self.rendering.score(self.scorer, rows, tokens.prompts, tokens.responses, self.top_k)
        elif self.cross is not None:  # scored in the teacher's tokenization, targets at the student's positions
            targets = self.cross.score(self.scorer, tokens.prompts, tokens.responses, self.top_k)
        if targets is not None:
            scores, flags = targets.scores, targets.target_flags
        else:
            scores = self.scorer.score(tokens.prompts, tokens.responses, self.top_k, tokens.support)
            scores, flags = keep_trained_positions(scores, rows), None  # the conversation scored, its trained kept
        out = annotated_table(
            sample_ids=rows["sample_id"].to_pylist(),
            lengths=scores.lengths,
            topk_ids=scores.topk_ids,
            topk_logprobs=scores.topk_logprobs,
            token_logprob=scores.token_logprob,
            logprob_dtype=self.cfg.dtype,
            support_logprobs=scores.support_logprobs,
            target_flags=flags,
        )
        out_meta = ShardMeta(
            kind=ANNOTATED,
            run_id=self.run_info.run_id,
            tokenizer_fingerprint=self.run_info.tokenizer_fingerprint,
            shard_id=info.shard_id,
            policy_version=meta.policy_version,
            top_k=self.top_k,
            teacher=self.teacher,
            student_topk=meta.student_topk if tokens.support is not None else 0,
            **engine_fields(self.scorer),
        )
        if self.cfg.codec == "packed":
            out, codec_meta = encode_annotation(out, self.ids_vocab_size)
            out_meta.codec, out_meta.codec_id_bits = "packed", int(codec_meta[META_ID_BITS])
        compression = None if self.cfg.compression == "none" else self.cfg.compression
        if lease is not None and (not lease.still_mine() or self.store.exists(part)):
            # frozen past the expiry and taken over: only the current holder publishes (annotate/leases.py)
            self.metrics.log({"event": "lease_lost", "shard_id": info.shard_id}, flush=True)
            self.console.print(f"lease lost: {info.shard_id} (taken over by another worker)", highlight=False)
            return False
        write_shard(self.store, part, out, out_meta, compression=compression)
        self.selection.scored(info.shard_id, table.num_rows)  # coverage for pacing before a listing shows it

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
                "cpu_s": self.metrics.cpu_lap(),
                **({"alignment": targets.stats.summary()} if targets is not None else {}),
            }
        )
        return True

    def _routed_rows(self, table: pa.Table) -> pa.Table:
        """The rows this teacher annotates, in rollout order (all of them without routing)."""
        if self.routing is None:
            return table
        key = self.routing.key
        if key not in table.schema.names:
            raise ValueError(
                f"routing key {key!r} is not a column of the rollout shards "
                f"(columns: {', '.join(table.schema.names)}); set annotate.routing_key"
            )
        values = pc.cast(table[key], pa.string())
        mine = [v for v, t in self.routing.map.items() if t == self.teacher]
        mask = pc.fill_null(pc.is_in(values, value_set=pa.array(mine, pa.string())), False)
        if self.routing.default == self.teacher:
            unlisted = pc.invert(
                pc.fill_null(pc.is_in(values, value_set=pa.array(list(self.routing.map), pa.string())), False)
            )
            mask = pc.or_(mask, unlisted)
        return table.filter(mask)

    def _token_arrays(self, rows: pa.Table, info: ShardInfo) -> TokenArrays:
        """Per-row id arrays of the prompts, responses and (union support) the student's top-k ids."""
        support = False
        if "student_topk_ids" in rows.schema.names and self.cross is None:
            support = self.union_support
            if not support and not self._warned_no_support:
                self._warned_no_support = True
                self.console.print(
                    f"[yellow]note:[/] {info.path} has student_topk_ids, but --engine {self.cfg.engine} "
                    f"cannot score them; parts get no teacher_support_logprobs (use --engine hf for "
                    f"union support)",
                    highlight=False,
                    soft_wrap=True,
                )
        return TokenArrays(
            prompts=self._row_ids(rows, "prompt_ids", info),
            responses=self._row_ids(rows, "response_ids", info),
            support=self._row_ids(rows, "student_topk_ids", info) if support else None,
        )

    def _row_ids(self, rows: pa.Table, name: str, info: ShardInfo) -> list[np.ndarray]:
        """Column `name` as one id array per row (views into the Arrow buffers), every id in the vocabulary."""
        flat = flat_values(rows[name])
        if flat.size and (flat.min() < 0 or flat.max() >= self.ids_vocab_size):
            bad = int(flat.max()) if flat.max() >= self.ids_vocab_size else int(flat.min())
            raise ShardError(
                f"{self.store.path(info.path)}: column {name!r} holds token id {bad}, outside the "
                f"vocabulary 0..{self.ids_vocab_size - 1}"
            )
        boundaries = np.cumsum(list_lengths(rows[name]))[:-1]
        return np.split(flat, boundaries) if rows.num_rows else []


# ---------------------------------------------------------------- the entry point
def run_annotate(
    cfg: Config, store: Store, *, stop: threading.Event | None = None, console: Console | None = None
) -> AnnotateStats:
    """Run one annotate worker to completion (see `Annotator`): until nothing is pending, `max_shards`, `stop`, or
    with `follow` the trainer's train/DONE.

    `console`: where the progress goes (a bar on a terminal, else a plain line every ~10 s); None: no progress
    (messages still go to stderr).
    """
    return Annotator(cfg, store, stop=stop, console=console, progress=None if console is not None else False).run()
