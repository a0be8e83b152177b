"""`opd replay`: train a new student on the annotations of existing stores, read in place.

A replay is a training run without rollout or teacher: its data are the annotated shards of one or more
source stores (`--from`), which it only reads (through the trainer's validated `ShardCache`), never writes,
quarantines or annotates. Everything the run writes — run.json, policy versions, resume states, the
consumed ledger, metrics — goes to its own store (`--store`), exactly as `opd train` writes them.

It is off-policy for the new student, so the staleness bound does not apply: every selected row is used.
The data are `epochs` passes over the selected rows; each pass visits the shards in an order shuffled with
(seed, epoch) and the rows of a shard in an order shuffled with (seed, epoch, shard), or in store order with
shuffle off. Selection: a policy-version range, teachers (their parts only), data sources.

Exactly once per epoch: the stream's cursor (epoch, position in that epoch's shard order, rows of the
current shard handed out) is saved in every resume state with the step it belongs to, and the order is a
pure function of the seed, so a killed replay resumed from its last state hands out the same rows after it;
the trainer's consumed ledger (train/consumed/step-N.jsonl) then holds each epoch's rows once, in order.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console

from opd_cache.config import Config
from opd_cache.storage.damage import DAMAGE_ERRORS, DamagedFiles
from opd_cache.storage.store import RUN_JSON, RunManifest, ShardInfo, Store
from opd_cache.train.distributed import DistEnv, init_distributed
from opd_cache.train.shard_data import ShardCache, ShardData, required_teachers
from opd_cache.train.stream import GlobalBatch, StopKind, StreamCursor, StreamEnd
from opd_cache.train.trainer import Trainer, TrainResult


@dataclass
class ReplaySpec:
    """What to replay: recorded in the replay store's run.json, so a resume with other choices is refused."""

    sources: list[str]
    epochs: int = 1
    seed: int = 0
    shuffle: bool = True
    min_version: int | None = None
    max_version: int | None = None
    teachers: list[str] | None = None  # None: the teachers each source's run requires
    data_sources: list[str] | None = None  # None: every row
    skip_damaged: bool = False  # a damaged source shard is left out (counted) instead of stopping the replay

    def to_dict(self) -> dict:
        """The selection, as run.json records it (skip_damaged is how to read it, not what it selects)."""
        selection = asdict(self)
        del selection["skip_damaged"]
        return selection


@dataclass
class Source:
    store: Store
    run: RunManifest
    teachers: list[str]
    shards: list[ShardInfo] = field(default_factory=list)  # annotated by every teacher, inside the version range


def open_sources(spec: ReplaySpec) -> list[Source]:
    """Each `--from` store with its selected shards; one-line errors for what cannot be replayed."""
    if not spec.sources:
        raise ValueError("opd replay needs at least one --from STORE")
    if spec.epochs < 1:
        raise ValueError(f"--epochs {spec.epochs}: must be >= 1")
    sources = []
    for uri in spec.sources:
        store = Store(uri)
        if not store.manifest.exists():
            raise ValueError(f"--from {uri}: {store.manifest.no_run_reason()}")
        run = store.manifest.require()
        shards, parts = store.shards.dataset()
        teachers = required_teachers(run)
        if spec.teachers:
            present = set(run.teachers or {}) | {t for names in parts.values() for t in names}
            missing = sorted(set(spec.teachers) - present)
            if len(missing) == len(set(spec.teachers)):
                raise ValueError(
                    f"--teacher {', '.join(spec.teachers)}: {store.path('')} has annotations from "
                    f"{', '.join(sorted(present)) or 'no teacher'}"
                )
            teachers = sorted(set(spec.teachers) & present)
        # a shard trains once every selected teacher has scored it (the trainer's rule, shard_data.py)
        selected = [
            s
            for s in shards
            if teachers
            and set(teachers) <= parts.get(s.shard_id, set())
            and (spec.min_version is None or s.policy_version >= spec.min_version)
            and (spec.max_version is None or s.policy_version <= spec.max_version)
        ]
        if not selected:
            annotated = sum(1 for s in shards if s.shard_id in parts)
            hint = "run `opd annotate` on it first" if not annotated else "widen --min-version/--max-version/--teacher"
            raise ValueError(
                f"--from {uri}: no annotated shards to replay ({len(shards)} rollout shards, "
                f"{annotated} annotated, none selected by the version range and teachers): {hint}"
            )
        sources.append(Source(store, run, teachers, selected))
    first = sources[0]
    for other in sources[1:]:
        for key in ("tokenizer_fingerprint", "top_k"):
            if getattr(other.run, key) != getattr(first.run, key):
                raise ValueError(
                    f"--from {other.store.uri}: {key} is {getattr(other.run, key)!r}, but "
                    f"{first.store.uri} has {getattr(first.run, key)!r}; replay sources must share one "
                    f"tokenizer and top-k"
                )
    return sources


def prepare_replay_store(store: Store, spec: ReplaySpec, sources: list[Source], student: str | None) -> RunManifest:
    """Create (or check, on resume) the replay store's run.json before the trainer opens it."""
    source_roots = {s.store.path("") for s in sources}
    if store.path("") in source_roots:
        raise ValueError(
            f"--store {store.uri} is one of the --from stores: a replay writes to a new store and only "
            f"reads its sources"
        )
    run = store.manifest.read()
    if run is not None and run.replay is None:
        raise ValueError(
            f"--store {store.uri} holds a run that is not a replay ({store.path(RUN_JSON)}); use a new folder"
        )
    first = sources[0].run
    teachers = {}
    for s in sources:
        teachers.update({t: (s.run.teachers or {}).get(t, s.store.uri) for t in s.teachers})
    return store.manifest.ensure(  # replay first: a resume with another selection is refused naming it
        replay={**spec.to_dict(), "source_run_ids": [s.run.run_id for s in sources]},
        student=student or first.student,
        tokenizer_fingerprint=first.tokenizer_fingerprint,
        top_k=first.top_k,
        vocab_size=first.vocab_size,
        teachers=teachers,
    )


class ReplayCache:
    """The ShardCaches of the sources behind one `get(key)`: keys are `<source index>:<shard id>`.

    Shard ids repeat across stores (every run starts at v000000-w00-000000), so the key names its source.
    """

    def __init__(self, sources: list[Source], skip_damaged: bool = False):
        self.caches = [ShardCache(s.store, s.run, s.teachers) for s in sources]
        self.teachers = sorted({t for s in sources for t in s.teachers})
        # a damaged shard stops the replay naming it (storage/damage.py), or is left out and counted
        self.damaged = [DamagedFiles(s.store.uri, skip=skip_damaged) for s in sources]

    def get(self, key: str) -> ShardData | None:
        """The shard's data; None for a damaged one when skipping them (a source is only read: no quarantine)."""
        index, _, shard_id = key.partition(":")
        damaged = self.damaged[int(index)]
        if shard_id in damaged.files:
            return None
        try:
            return self.caches[int(index)].get(shard_id)
        except DAMAGE_ERRORS as e:
            damaged.met(shard_id, e)  # raises unless skipping
            return None

    def skipped(self) -> int:
        return sum(len(d.files) for d in self.damaged)

    def refresh_run(self) -> None:  # the trainer's loader calls it when no teacher is known: never for a replay
        pass


@dataclass
class ReplayCursor(StreamCursor):
    """The trainer's counters (StreamCursor's fields) plus where the replay is: `current` is the key
    (`<source index>:<shard id>`) of the shard being read, `current_rows` its selected rows handed out."""

    epoch: int = 0
    position: int = 0  # index of `current` in the epoch's shard order


class ReplayStream:
    """Global batches from `epochs` passes over the selected rows. Runs on rank 0 only (in the loader thread)."""

    def __init__(
        self,
        sources: list[Source],
        cache: ReplayCache,
        spec: ReplaySpec,
        *,
        batch_samples: int | None,
        batch_tokens: int | None,
        cursor: ReplayCursor | None = None,
    ):
        self.cache, self.spec = cache, spec
        self.batch_samples, self.batch_tokens = batch_samples, batch_tokens
        self.keys = [f"{i}:{s.shard_id}" for i, source in enumerate(sources) for s in source.shards]
        self.cursor = cursor or ReplayCursor()
        self.on_event = lambda message: None
        self.on_wait = None
        self._orders: dict[int, list[str]] = {}
        self._skipped: set[str] = set()  # damaged shards already reported
        self._source_uris = [source.store.uri for source in sources]

    def source_of(self, key: str) -> str:
        return self._source_uris[int(key.partition(":")[0])]

    def order(self, epoch: int) -> list[str]:
        """The shards of `epoch`, in the order they are read."""
        if epoch not in self._orders:
            keys = list(self.keys)
            if self.spec.shuffle:
                keys = [keys[i] for i in np.random.default_rng([self.spec.seed, epoch]).permutation(len(keys))]
            self._orders = {epoch: keys}  # one epoch at a time is all the stream looks at
        return self._orders[epoch]

    def rows(self, key: str, data: ShardData, epoch: int) -> np.ndarray:
        """The selected rows of a shard (routed to a selected teacher, of a selected data source), in read order."""
        keep = data.teacher_of_row >= 0
        if self.spec.data_sources:
            keep &= pc.fill_null(
                pc.is_in(data.data_source, value_set=pa.array(self.spec.data_sources, pa.string())), False
            ).to_numpy(zero_copy_only=False)
        rows = np.nonzero(keep)[0].astype(np.int64)
        if self.spec.shuffle:
            rng = np.random.default_rng([self.spec.seed, epoch, zlib.crc32(key.encode())])
            rows = rows[rng.permutation(len(rows))]
        return rows

    def next_batch(self, step: int, version: int) -> GlobalBatch | StreamEnd:
        c = self.cursor
        parts: list[tuple[str, np.ndarray, ShardData]] = []
        taken_rows = taken_tokens = 0
        while c.epoch < self.spec.epochs:
            order = self.order(c.epoch)
            if c.position >= len(order):
                c.epoch, c.position, c.current_rows = c.epoch + 1, 0, 0
                continue
            key = order[c.position]
            data = self.cache.get(key)
            if data is None:  # damaged, left out with --skip-damaged
                if key not in self._skipped:
                    self._skipped.add(key)
                    self.on_event(f"skipped damaged shard {key.partition(':')[2]} of --from {self.source_of(key)}")
                c.position, c.current_rows = c.position + 1, 0
                continue
            selected = self.rows(key, data, c.epoch)
            remaining = selected[c.current_rows :]
            if self.batch_samples is not None:
                rows = remaining[: self.batch_samples - taken_rows]
            else:
                cum = np.cumsum(data.prompt_lengths[remaining] + data.response_lengths[remaining])
                fits = int(np.searchsorted(cum, self.batch_tokens - taken_tokens, side="right"))
                rows = remaining[: max(fits, 1 if taken_rows == 0 else 0)]  # one over-long row still trains, alone
            if len(rows):
                parts.append((key, rows, data))
                taken_rows += len(rows)
                taken_tokens += int((data.prompt_lengths[rows] + data.response_lengths[rows]).sum())
            c.current, c.current_rows = key, c.current_rows + len(rows)
            if c.current_rows >= len(selected):
                c.position, c.current_rows = c.position + 1, 0
            if self.batch_samples is not None:
                full = taken_rows >= self.batch_samples
            else:
                full = len(rows) < len(remaining) or taken_tokens >= self.batch_tokens
            if full:
                break
        c.trained_samples += taken_rows
        if not taken_rows:
            return StreamEnd("epochs_done", f"replayed {self.spec.epochs} epoch(s)", c.copy())
        return self._assemble(step, version, parts)

    def _assemble(self, step: int, version: int, parts: list) -> GlobalBatch:
        sample_ids, teachers = [], []
        for _, rows, data in parts:
            sample_ids += data.sample_ids.take(pa.array(rows)).to_pylist()
            teachers += list(np.asarray(data.teacher_names, dtype=object)[data.teacher_of_row[rows]])
        return GlobalBatch(
            step=step,
            version=version,
            shard_ids=[key for key, _, _ in parts],
            row_shard=np.concatenate([np.full(len(rows), i, dtype=np.int32) for i, (_, rows, _) in enumerate(parts)]),
            row_index=np.concatenate([rows for _, rows, _ in parts]),
            prompt_lengths=np.concatenate([data.prompt_lengths[rows] for _, rows, data in parts]),
            response_lengths=np.concatenate([data.response_lengths[rows] for _, rows, data in parts]),
            trained_lengths=np.concatenate([data.trained_lengths[rows] for _, rows, data in parts]),
            row_version=np.concatenate(
                [np.full(len(rows), data.policy_version, dtype=np.int32) for _, rows, data in parts]
            ),
            sample_ids=sample_ids,
            teachers=teachers,
            cursor=self.cursor.copy(),
        )


def source_lr(uri: str) -> float | None:
    """The learning rate a source store's run trained with: the peak `lr` of its trainer's metrics (the schedule
    reaches train.lr after its warm-up, then holds or decays it); None without training metrics."""
    from opd_cache.observe.metrics import read_metrics

    store = Store(uri)
    if not store.manifest.exists():
        return None  # open_sources says what is wrong with it
    rates = [r["lr"] for records in read_metrics(store, "train").values() for r in records if "lr" in r]
    return max(rates) if rates else None


def steps_for_epochs(sources: list[Source], spec: ReplaySpec, batch_samples: int) -> int:
    """Optimizer steps of `batch_samples` rows that every epoch of the selection needs (reads each shard once)."""
    cache = ReplayCache(sources, skip_damaged=spec.skip_damaged)
    stream = ReplayStream(sources, cache, spec, batch_samples=batch_samples, batch_tokens=None)
    rows = sum(len(stream.rows(key, data, 0)) for key in stream.keys if (data := cache.get(key)) is not None)
    return max(1, -(-rows * spec.epochs // batch_samples))


class ReplayTrainer(Trainer):
    """`Trainer` with its data from the replay's sources instead of its own store's stream."""

    cursor_type = ReplayCursor
    # the rows' policy versions are the source run's: their distance to this run's versions means nothing
    step_line_staleness = False
    spec: ReplaySpec
    sources: list[Source]
    cache: ReplayCache | None = None  # built by make_data

    def __init__(
        self,
        config: Config,
        store: Store,
        env: DistEnv,
        spec: ReplaySpec,
        sources: list[Source],
        *,
        stop: threading.Event | None = None,
        console: Console | None = None,
    ):
        self.spec, self.sources = spec, sources
        super().__init__(config, store, env, stop=stop, console=console)

    def make_data(self) -> tuple[ReplayCache, ReplayStream | None]:
        cache = self.cache = ReplayCache(self.sources, skip_damaged=self.spec.skip_damaged)
        stream = None
        if self.env.rank == 0:
            stream = ReplayStream(
                self.sources,
                cache,
                self.spec,
                batch_samples=self.cfg.global_batch_samples,
                batch_tokens=self.cfg.global_batch_tokens,
                cursor=self.position.cursor.copy(),  # the stream moves its own copy ahead
            )
        return cache, stream

    def _finish(self, kind: StopKind, reason: str) -> TrainResult:
        result = super()._finish(kind, reason)
        skipped = self.cache.skipped() if self.cache is not None else 0
        if skipped and self.console:
            self.console.print(
                f"skipped {skipped} damaged source shard{'s' if skipped != 1 else ''} (--skip-damaged); "
                f"`opd verify` on the --from stores says what is wrong with each"
            )
        return result


def run_replay(
    config: Config,
    store: Store,
    spec: ReplaySpec,
    *,
    stop: threading.Event | None = None,
    console: Console | None = None,
    steps_from_epochs: bool = False,
) -> TrainResult:
    """Check the sources, create the replay store's run.json in `store`, and train (single process or a torchrun
    rank): `run_train`'s signature, plus what to replay. When every epoch is done the run is finished (train/DONE).

    `steps_from_epochs`: no step limit was given, so train.max_steps becomes what the epochs need.
    """
    if config.train.support == "union":
        raise ValueError("--support union is not available for replay yet: use --support teacher")
    sources = open_sources(spec)
    if steps_from_epochs and config.train.global_batch_samples is not None:
        config.train.max_steps = steps_for_epochs(sources, spec, config.train.global_batch_samples)
    env = init_distributed(config.train.device)
    try:
        if env.rank == 0:
            prepare_replay_store(store, spec, sources, config.train.student)
        env.barrier()
        return ReplayTrainer(config, store, env, spec, sources, stop=stop, console=console).run()
    finally:
        env.close()
