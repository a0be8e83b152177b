"""Per-stage metrics as JSON lines in the store: `metrics/<stage>-<worker>.jsonl`.

Object stores cannot append, so the log keeps its records in memory and
republishes the whole (small) file atomically at most every `flush_seconds`.
A restarted worker first reads what its previous incarnation published, so the
file only ever grows.
"""

from __future__ import annotations

import json
import time

from opd_cache.store import Store, iter_jsonl, validate_name


class MetricsLog:
    def __init__(self, store: Store, stage: str, worker: str = "0", flush_seconds: float = 5.0):
        self.store = store
        self.rel = f"metrics/{validate_name('stage', stage)}-{validate_name('worker', worker)}.jsonl"
        self.flush_seconds = flush_seconds
        try:
            self.lines = [json.dumps(r) for r in iter_jsonl(store.read_bytes(self.rel))]
        except FileNotFoundError:
            self.lines = []
        self._last_flush = time.monotonic()

    def log(self, record: dict, flush: bool = False) -> None:
        self.lines.append(json.dumps({"time": round(time.time(), 3), **record}, default=float))
        if flush or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.lines]

    def flush(self) -> None:
        self.store.write_bytes(self.rel, ("\n".join(self.lines) + "\n").encode() if self.lines else b"")
        self._last_flush = time.monotonic()


def read_metrics(store: Store, stage: str | None = None) -> dict[str, list[dict]]:
    """All metrics files (optionally of one stage), keyed by file stem."""
    out = {}
    for info in store.list_files("metrics"):
        stem = info.base_name.removesuffix(".jsonl")
        if stage is None or stem.startswith(f"{stage}-"):
            out[stem] = list(iter_jsonl(store.read_bytes(f"metrics/{info.base_name}")))
    return out
