"""Per-stage metrics as JSON lines in the store, one log per `<stage>-<worker>`; every flush appends.

Rewriting the whole log on each flush would cost O(records) per flush, O(N^2) over a run. Instead:

- Local stores append for real to `metrics/<stage>-<worker>.jsonl`: each flush is ONE `write` of whole
  lines to a file opened with O_APPEND, so a reader sees a prefix of the records; a final line without
  "\\n" (a writer killed mid-write) is ignored by readers and cut off by the next writer.
- Object stores cannot append, so a log is a folder of segments, `metrics/<stage>-<worker>/<seq>.jsonl`.
  A flush re-PUTs only the current segment (atomic), and starts a new one once it holds `SEGMENT_BYTES`:
  a flush costs O(SEGMENT_BYTES) whatever the run length. Sealed segments are compacted like an LSM tree:
  every `MERGE` segments in a row become one object `<first>-<last>.jsonl`, every MERGE of those one
  bigger object, and so on, so a reader LISTs and GETs at most (MERGE - 1) objects per level (a
  10,000-step run's ~7 MB train log: ~15 objects), and all the merging writes O(bytes x levels). A merge
  PUTs the merged object before deleting its parts; a reader skips any object whose range another covers.
  A rewrite (the trainer dropping the records of steps after the state it resumed from) PUTs
  `<seq>.full.jsonl`, which replaces everything numbered up to `seq` (readers skip those), then deletes
  what it replaced: crash-safe in any order.
- A store written before segments existed (a single `metrics/<stage>-<worker>.jsonl` on an object store)
  stays readable: that file is the log's first part, until a rewrite replaces it.

A restarted worker first reads what its previous incarnation published and continues after it (a new
segment on object stores, so it never overwrites a record it did not read).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable

from opd_cache.storage import layout
from opd_cache.storage.store import Store, validate_name

SEGMENT_BYTES = 32 * 1024  # object stores: start a new segment once the current one holds this much
MERGE = 8  # object stores: this many consecutive objects of one level are merged into one of the next
_SEGMENT = re.compile(r"^(\d{8})(?:-(\d{8}))?(\.full)?\.jsonl$")


def _complete_lines(data: bytes) -> list[str]:
    """The non-empty complete lines of a JSON-lines file; a last line without "\\n" is still being written."""
    end = data.rfind(b"\n") + 1
    return [line for line in data[:end].decode().splitlines() if line.strip()]


def _parse_segments(names: list[str]) -> list[tuple[int, int, bool, str]]:
    """(first seq, last seq, is a `.full` rewrite, name) of the segment objects among `names`."""
    out = []
    for name in names:
        if m := _SEGMENT.match(name):
            first = int(m.group(1))
            out.append((first, int(m.group(2) or first), bool(m.group(3)), name))
    return out


def _segment_parts(names: list[str]) -> tuple[int, list[tuple[int, str]]]:
    """(seq of the newest `.full` rewrite or -1, the `(first seq, name)` objects a reader reads, in order).

    A `.full` replaces everything up to its seq; a merged object replaces the objects inside its range
    (both may still exist: a writer killed before deleting them)."""
    parsed = _parse_segments(names)
    full = max((last for _, last, is_full, _ in parsed if is_full), default=-1)
    live = [(first, last, name) for first, last, is_full, name in parsed if first > full or (is_full and last == full)]
    covered = [
        (first, last, name)
        for first, last, name in live
        if not any(lo <= first and last <= hi and (lo, hi) != (first, last) for lo, hi, _ in live)
    ]
    return full, sorted((first, name) for first, _, name in covered)


def _read_log(store: Store, stem: str, has_file: bool, segments: list[str]) -> list[str]:
    """The lines of one log: the single file (unless a rewrite replaced it), then its segments in order."""
    full, parts = _segment_parts(segments)
    lines = []
    if has_file and full < 0:
        try:
            lines += _complete_lines(store.read_bytes(layout.metrics_path(stem)))
        except FileNotFoundError:  # a rewrite deleted it after our listing
            pass
    for _, name in parts:
        try:
            lines += _complete_lines(store.read_bytes(layout.metrics_path(stem, name)))
        except FileNotFoundError:  # replaced by a rewrite between our LIST and GET: read the log again
            return _read_log(store, stem, *_list_log(store, stem))
    return lines


def _list_log(store: Store, stem: str) -> tuple[bool, list[str]]:
    has_file = store.exists(layout.metrics_path(stem))
    return has_file, [info.base_name for info in store.list_files(layout.metrics_dir(stem))]


class MetricsLog:
    def __init__(self, store: Store, stage: str, worker: str = "0", flush_seconds: float = 5.0):
        self.store = store
        self.stem = f"{validate_name('stage', stage)}-{validate_name('worker', worker)}"
        self.rel = layout.metrics_path(self.stem)
        self.flush_seconds = flush_seconds
        has_file, segments = _list_log(store, self.stem)
        # local stores append; a local copy of an object store's log keeps its segments
        self.appends = store.appends_in_place and not segments
        if self.appends:
            self._cut_partial_line()
        self.lines = _read_log(store, self.stem, has_file, segments)
        self._flushed = len(self.lines)  # lines[:_flushed] are in the store
        # object stores: this incarnation writes segments after every existing one
        self._full_seq = _segment_parts(segments)[0]
        self._seq = max((last for _, last, _, _ in _parse_segments(segments)), default=-1) + 1
        self._segment: list[str] = []  # the lines of segment `_seq` so far
        self._segment_bytes = 0
        self._last_flush = time.monotonic()
        self._cpu_mark = time.process_time()

    def cpu_lap(self) -> float:
        """This process's CPU seconds (every thread) since the previous lap, or since the log was opened.

        A stage puts it in its per-unit record (a rollout shard, an annotated shard, a step) as `cpu_s`: the
        cores the stage took for that unit, waiting loops and background threads included, which is what
        `opd plan --from-store` needs to model stages that share cores (flow/calibrate.py)."""
        now = time.process_time()
        lap, self._cpu_mark = now - self._cpu_mark, now
        return round(lap, 4)

    def log(self, record: dict, flush: bool = False) -> None:
        self.lines.append(json.dumps({"time": round(time.time(), 3), **record}, default=float))
        if flush or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.lines]

    def flush(self) -> None:
        """Write the records logged since the last flush (and only those)."""
        new = self.lines[self._flushed :]
        self._last_flush = time.monotonic()
        if not new:
            return
        if self.appends:
            self._append(new)
        else:
            self._write_segment(new)
        self._flushed = len(self.lines)

    def rewrite(self, keep: Callable[[dict], bool]) -> None:
        """Keep only the records `keep` accepts, in the store too (one full rewrite, e.g. on resume)."""
        self.flush()
        kept = [line for line in self.lines if keep(json.loads(line))]
        if kept == self.lines:
            return
        data = "".join(line + "\n" for line in kept).encode()
        if self.appends:
            self.store.write_bytes(self.rel, data)  # atomic replace; this process is the log's only writer
        else:
            # `<seq>.full` replaces every part numbered up to seq (and the single file): readers skip
            # them from the moment it exists, so deleting them afterwards is only tidying up
            full_seq = self._seq
            self.store.write_bytes(layout.metrics_path(self.stem, f"{full_seq:08d}.full.jsonl"), data)
            names = [info.base_name for info in self.store.list_files(layout.metrics_dir(self.stem))]
            for _first, last, _, name in _parse_segments(names):
                if last < full_seq:
                    self.store.delete(layout.metrics_path(self.stem, name))
            self.store.delete(self.rel)
            self._seq, self._segment, self._segment_bytes = full_seq + 1, [], 0
            self._full_seq = full_seq
        self.lines = kept
        self._flushed = len(kept)

    # ------------------------------------------------------------------ writing
    def _append(self, new: list[str]) -> None:
        # one write: readers see all of these lines or none (a short write, disk full: they skip the cut line)
        self.store.append_bytes(self.rel, "".join(line + "\n" for line in new).encode())

    def _cut_partial_line(self) -> None:
        """Drop the half line a killed writer left at the end, so our first append starts a line of its own."""
        path = self.store.local_path(self.rel)  # a log that `appends` is a file of this machine
        try:
            with open(path, "rb") as f:  # read-only: a store that is fine is not written to here
                size = f.seek(0, os.SEEK_END)
                if size == 0:
                    return
                f.seek(size - 1)
                if f.read(1) == b"\n":
                    return
                f.seek(0)
                keep = f.read().rfind(b"\n") + 1
        except FileNotFoundError:
            return
        with self.store.writing("repair", path), open(path, "rb+") as f:
            f.truncate(keep)

    def _write_segment(self, new: list[str]) -> None:
        unwritten = False  # the current segment holds lines its stored copy lacks
        for line in new:
            if self._segment and self._segment_bytes + len(line) + 1 > SEGMENT_BYTES:
                if unwritten:
                    self._put_segment()  # full: it stays as it is, the next lines start segment seq+1
                self._compact(self._seq)
                self._seq, self._segment, self._segment_bytes = self._seq + 1, [], 0
            self._segment.append(line)
            self._segment_bytes += len(line) + 1
            unwritten = True
        self._put_segment()

    def _compact(self, sealed: int) -> None:
        """Segment `sealed` is complete: merge each aligned run of MERGE^k segments it completes into one object."""
        size = MERGE
        while (sealed + 1) % size == 0:
            first = sealed + 1 - size
            if first <= self._full_seq:
                return  # the run straddles a rewrite: what lies below it is gone
            folder = layout.metrics_dir(self.stem)
            names = [info.base_name for info in self.store.list_files(folder)]
            parts = [(f, name) for f, name in _segment_parts(names)[1] if first <= f <= sealed]
            data = b"".join(self.store.read_bytes(layout.metrics_path(self.stem, name)) for _, name in parts)
            self.store.write_bytes(layout.metrics_path(self.stem, f"{first:08d}-{sealed:08d}.jsonl"), data)
            for _, name in parts:  # a reader skips them from the moment the merged object exists
                self.store.delete(layout.metrics_path(self.stem, name))
            size *= MERGE

    def _put_segment(self) -> None:
        data = "".join(line + "\n" for line in self._segment).encode()
        self.store.write_bytes(layout.metrics_path(self.stem, f"{self._seq:08d}.jsonl"), data)


def read_metrics(store: Store, stage: str | None = None) -> dict[str, list[dict]]:
    """All metrics logs (optionally of one stage), keyed by `<stage>-<worker>`; one LIST of `metrics/`."""
    files, segments = set(), {}
    for info in store.list_files(layout.metrics_dir(), recursive=True):
        rel = info.path[len(store.path(layout.metrics_dir())) + 1 :]
        parts = rel.split("/")
        if len(parts) == 1 and rel.endswith(".jsonl"):
            files.add(rel.removesuffix(".jsonl"))
        elif len(parts) == 2 and _SEGMENT.match(parts[1]):
            segments.setdefault(parts[0], []).append(parts[1])
    out = {}
    for stem in sorted(files | set(segments)):
        if stage is None or stem.startswith(f"{stage}-"):
            out[stem] = [json.loads(line) for line in _read_log(store, stem, stem in files, segments.get(stem, []))]
    return out
