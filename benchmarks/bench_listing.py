"""What one poll of each stage costs as the run's history grows: the flat layout's full listings vs ShardWatch.

    python benchmarks/bench_listing.py            # 500, 2,000, 8,000, 32,000 shards; local directory and moto S3
    python benchmarks/bench_listing.py --quick    # 500 and 2,000 shards (a smoke run)

A store holds N rollout shards, 8 per policy version (4 workers x 2 flushes), each with its teacher's part
except the newest version's (work still pending), so 2N objects; LATEST names the newest version; the
staleness window is 2 versions. The objects are empty placeholders: a listing never reads them. Both layouts
are grown in place from one size to the next (the history grows, as in a run):

  today   the flat layout and the listing code before issue #19, replicated here: every poll lists all of
          `rollouts/` and, recursively, all of `annotated/`
          (trainer, annotate: both listings; rollout's backlog gauge: the rollout listing and progress.json)
  new     version partitions (`rollouts/v000123/`, `annotated/v000123/`) and the stages' own code:
          trainer `ShardStream.refresh`, annotate `ShardSelection.pending`, rollout `BacklogGauge.backlog`,
          each after its first (catch-up) poll: the window's partitions plus one of the amortised sweep

The ratio to the poll at 500 shards is timed against a twin store that stays at 500 shards, polled
alternately with the grown one, so that both see the same load of a shared machine.

Requests are counted by wrapping the store's filesystem: LIST = the pages an object store needs for a
listing call (one per 1,000 keys, at least one), HEAD = one file's info, GET = one read; `keys` is the
number of entries the listings returned. On S3 the requests are those moto's server logged. Time: the best of
several polls (15 new, 3 today; today's at 8,000 shards and more on S3: one, they take seconds).

S3 is moto's server in this process on 127.0.0.1 (placeholders go straight into its backend: 2N PUTs over
HTTP would take ~10 ms each here). Moto answers every LIST by scanning all keys of the bucket
(moto/s3/models.py `list_objects`), so on moto even a LIST of a tiny prefix grows with the store; the table
shows that floor (`LIST of an empty prefix`) beside the polls. Real object stores index keys.

Targets (issue #19): at 32,000 shards a poll costs <= 1.5x what it costs at 500, and <= 0.05x today's.
Results: a table on stdout and benchmarks/results/bench_listing.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opd_cache.annotate.selection import ShardSelection
from opd_cache.rollout.pacing import BacklogGauge
from opd_cache.storage import layout
from opd_cache.storage.store import COMPLETE_MARKER, Store, make_shard_id, parse_shard_id
from opd_cache.testing import CountingFileSystem
from opd_cache.train.shard_data import ShardCache
from opd_cache.train.stream import ShardStream

RESULTS = ROOT / "benchmarks" / "results" / "bench_listing.json"
WORKERS, PER_VERSION, STALENESS = 4, 8, 2
STAGES = ("trainer", "annotate", "rollout")


class ServerRequests(logging.Handler):
    """The requests moto's server handled, from its request log: what an object store would bill."""

    def __init__(self):
        super().__init__()
        self.requests = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        line = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())  # werkzeug colours some status codes
        if '"GET /' in line:
            self.requests["LIST" if "list-type=" in line else "GET"] += 1
        elif '"HEAD /' in line:
            self.requests["HEAD"] += 1
        elif '"PUT /' in line:
            self.requests["PUT"] += 1


SERVER_LOG = ServerRequests()


# ---------------------------------------------------------------- the flat layout's polls (before issue #19)
def today_rollout_shards(store: Store) -> list:
    shards = []
    for info in store.list_files("rollouts"):
        if info.base_name.endswith(".arrow"):
            shards.append(parse_shard_id(info.base_name[: -len(".arrow")]))
    return sorted(shards)


def today_annotated_parts(store: Store) -> dict:
    parts: dict[str, set[str]] = {}
    prefix = store.path("annotated") + "/"
    for info in store.list_files("annotated", recursive=True):
        rel = info.path[len(prefix) :]
        if rel.count("/") == 1 and rel.endswith(".arrow"):
            shard_id, teacher = rel[: -len(".arrow")].split("/")
            parts.setdefault(shard_id, set()).add(teacher)
    return parts


def today_polls(store: Store) -> dict:
    def listing():
        today_annotated_parts(store)
        today_rollout_shards(store)

    def rollout():
        today_rollout_shards(store)
        store.read_progress()

    return {"trainer": listing, "annotate": listing, "rollout": rollout}


# ---------------------------------------------------------------- the stages' polls now
def new_polls(store: Store, latest: int, shard_ids: list[str]) -> dict:
    run = {"run_id": "bench", "teachers": {"teacher": "t"}}
    stream = ShardStream(
        store, run, ShardCache(store, run, ["teacher"]), max_staleness=STALENESS, batch_samples=8, batch_tokens=None
    )
    selection = ShardSelection(store, "teacher", max_staleness=STALENESS)  # an annotator's, without its teacher
    gauge = BacklogGauge(store, window=STALENESS)
    for shard_id in shard_ids:  # counted before (placeholders hold 0 rows)
        gauge.rows[shard_id] = 0
    # Each stage as after its first poll, which lists the whole history once per process (a restart's catch-up,
    # what every poll cost before): measured here are the polls of a running stage.
    for watch in (stream._watch, selection.watch, gauge._watch):
        watch.listed_below = latest - STALENESS
    polls = {"trainer": lambda: stream.refresh(latest), "annotate": selection.pending, "rollout": gauge.backlog}
    for poll in polls.values():
        poll()  # warm-up
    return polls


# ---------------------------------------------------------------- placeholder stores
def shard_id_of(i: int) -> str:
    return make_shard_id(i // PER_VERSION, f"w{i % WORKERS:02d}", i // WORKERS)


class Placeholders:
    """Empty objects at the paths of shards [start, end) in one layout, local or straight into moto."""

    def __init__(self, store: Store, layout: str, moto_backend=None):
        self.store, self.layout, self.backend = store, layout, moto_backend

    def rels(self, shard_id: str, annotated: bool) -> list[str]:
        if self.layout == "flat":
            rels = [f"rollouts/{shard_id}.arrow"] + ([f"annotated/{shard_id}/teacher.arrow"] if annotated else [])
        else:
            rels = [layout.rollout_path(shard_id)] + ([layout.annotated_path(shard_id, "teacher")] if annotated else [])
        return rels

    def put(self, rel: str) -> None:
        if self.backend is None:
            path = self.store.local_path(rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        else:
            bucket, _, prefix = self.store.root.partition("/")
            self.backend.put_object(bucket, f"{prefix}/{rel}", b"")

    def grow(self, start: int, end: int) -> int:
        """Shards [start, end); the parts of the previous newest version, which was pending, too."""
        latest = (end - 1) // PER_VERSION
        previous_latest = (start - 1) // PER_VERSION if start else -1
        for i in range(max(0, previous_latest * PER_VERSION), start):  # annotated now
            self.put(self.rels(shard_id_of(i), True)[1])
        for i in range(start, end):
            for rel in self.rels(shard_id_of(i), annotated=i // PER_VERSION < latest):
                self.put(rel)
        self.store.write_bytes(f"{layout.policy_dir(latest)}/{COMPLETE_MARKER}", b"")
        self.store.write_bytes("policy/LATEST", f"{latest}\n".encode())
        return latest


# ---------------------------------------------------------------- measuring
def measure(store: Store, poll, repeats: int) -> dict:
    """Best-of-`repeats` time of one poll (noise on a shared machine only adds), median, and its requests:
    on S3 those moto's server handled, locally the filesystem calls (LIST pages counted per 1,000 keys)."""
    counting = CountingFileSystem(store.fs)
    store.fs = counting
    times, requests = [], None
    try:
        for _ in range(repeats):
            counting.requests, SERVER_LOG.requests = Counter(), Counter()
            tic = time.perf_counter()
            poll()
            times.append(time.perf_counter() - tic)
            time.sleep(0.05)  # the server logs a request just after answering it
            requests = dict(counting.requests)
            if not store.is_local:
                requests = {**dict(SERVER_LOG.requests), "keys": counting.requests["keys"]}
    finally:
        store.fs = counting.fs
    return {
        "ms": min(times) * 1e3,
        "ms_median": statistics.median(times) * 1e3,
        "ms_all": [t * 1e3 for t in times],
        "requests": requests,
    }


def empty_prefix_ms(store: Store) -> float:
    """One LIST of an empty prefix: on moto it scans every key of the bucket, the floor of any LIST."""
    times = []
    for _ in range(5):
        tic = time.perf_counter()
        store.list_files("no-such-prefix")
        times.append(time.perf_counter() - tic)
    return min(times) * 1e3


def index_moto_listings() -> None:
    """Make moto answer a LIST from a sorted key index, as object stores do, instead of scanning the bucket.

    moto's `list_objects` visits every key of the bucket and keeps those under the prefix; here it is handed a
    stand-in bucket holding only the keys under the prefix (found by bisection in a sorted copy of the names,
    rebuilt when the bucket's key count changes). Everything else (folding by delimiter, pages, tokens) is
    moto's own code.
    """
    import bisect

    from moto.s3.models import S3Backend

    original = S3Backend.list_objects
    index: dict[int, tuple[int, list[str]]] = {}

    class PrefixOnly:
        def __init__(self, bucket, keys):
            self._bucket, self.keys = bucket, keys

        def __getattr__(self, name):
            return getattr(self._bucket, name)

    def list_objects(self, bucket, prefix, delimiter, marker, max_keys):
        if not prefix:
            return original(self, bucket, prefix, delimiter, marker, max_keys)
        count, names = index.get(id(bucket), (-1, []))
        if count != len(bucket.keys):
            names = sorted(bucket.keys.keys())
            index[id(bucket)] = (len(names), names)
        lo, hi = bisect.bisect_left(names, prefix), bisect.bisect_left(names, prefix + "\U0010ffff")
        subset = {name: bucket.keys[name] for name in names[lo:hi]}
        return original(self, PrefixOnly(bucket, subset), prefix, delimiter, marker, max_keys)

    S3Backend.list_objects = list_objects


def start_moto():
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(SERVER_LOG)
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False  # counted, not printed
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}", s3_backends[DEFAULT_ACCOUNT_ID]["global"]


def measure_alternating(a: tuple[Store, object], b: tuple[Store, object], repeats: int) -> tuple[dict, dict]:
    """Polls of two stores, one after the other `repeats` times: both see the same load on a shared machine."""
    runs_a, runs_b = [], []
    for _ in range(repeats):
        runs_a.append(measure(*a, 1))
        runs_b.append(measure(*b, 1))

    def merged(runs: list[dict]) -> dict:
        times = [r["ms"] for r in runs]
        return {
            "ms": min(times),
            "ms_median": statistics.median(times),
            "ms_all": times,
            "requests": runs[-1]["requests"],
        }

    return merged(runs_a), merged(runs_b)


def run_backend(name: str, sizes: list[int], make_store) -> list[dict]:
    rows = []
    stores = {layout: make_store(layout) for layout in ("flat", "partitioned")}
    # a store that stays at the smallest size: each poll is timed alternately with its twin on the grown store
    reference, reference_placeholders = make_store("reference")
    reference_latest = reference_placeholders.grow(0, sizes[0])
    reference_polls = new_polls(reference, reference_latest, [shard_id_of(i) for i in range(sizes[0])])
    grown = 0
    for size in sizes:
        tic = time.perf_counter()
        for _layout, (_store, placeholders) in stores.items():
            latest = placeholders.grow(grown, size)
        grown = size
        print(
            f"[{name}] {size:,} shards ({latest + 1:,} versions): placeholders in {time.perf_counter() - tic:.1f} s",
            flush=True,
        )
        flat, _ = stores["flat"]
        partitioned, _ = stores["partitioned"]
        slow = name.startswith("s3") and size >= 8000
        today = today_polls(flat)
        new = new_polls(partitioned, latest, [shard_id_of(i) for i in range(size)])
        floor = empty_prefix_ms(partitioned)
        for stage in STAGES:
            new_ms, reference_ms = measure_alternating(
                (partitioned, new[stage]), (reference, reference_polls[stage]), 15
            )
            row = {
                "backend": name,
                "shards": size,
                "versions": latest + 1,
                "stage": stage,
                "today": measure(flat, today[stage], 1 if slow else 3),
                "new": new_ms,
                "new_at_smallest_alternating": reference_ms,
                "empty_prefix_ms": floor,
            }
            rows.append(row)
            print(
                f"  {stage:8s} today {row['today']['ms']:9.1f} ms {row['today']['requests']}   "
                f"new {row['new']['ms']:7.1f} ms {row['new']['requests']}",
                flush=True,
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| store | stage | shards | today: ms | today: LIST / keys | new: ms | new: LIST / HEAD / GET / keys "
        "| new ÷ today (ms) | new ÷ new at 500, timed alternately | one empty LIST, ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, n = r["today"], r["new"]
        tr, nr = t["requests"], n["requests"]
        lines.append(
            f"| {r['backend']} | {r['stage']} | {r['shards']:,} | {t['ms']:,.1f} | {tr.get('LIST', 0)} / "
            f"{tr.get('keys', 0):,} | {n['ms']:,.1f} | "
            f"{nr.get('LIST', 0)} / {nr.get('HEAD', 0)} / {nr.get('GET', 0)} / {nr.get('keys', 0)} | "
            f"{n['ms'] / t['ms']:.3f} | {n['ms'] / r['new_at_smallest_alternating']['ms']:.2f} | "
            f"{r['empty_prefix_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="500 and 2,000 shards only")
    parser.add_argument(
        "--backends",
        default="local,s3,s3-indexed",
        help="comma-separated: local, s3 (stock moto), s3-indexed (moto listing from a key index)",
    )
    args = parser.parse_args()
    sizes = [500, 2000] if args.quick else [500, 2000, 8000, 32000]
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-listing-") as tmp:
        if "local" in args.backends:

            def local_store(layout):
                store = Store(Path(tmp) / layout)
                return store, Placeholders(store, layout)

            rows += run_backend("local", sizes, local_store)
        s3_sizes = {"s3-indexed": sizes, "s3": sizes}
        s3_backends = [b for b in ("s3", "s3-indexed") if b in args.backends.split(",")]
        if s3_backends:
            server, endpoint, backend = start_moto()
            try:
                for name in s3_backends:
                    if name == "s3-indexed":
                        index_moto_listings()

                    def s3_store(layout, name=name):
                        bucket = f"bench-listing-{name}-{layout}"
                        store = Store(f"s3://{bucket}/run", s3_endpoint=endpoint)
                        store.fs.create_dir(bucket)
                        return store, Placeholders(store, layout, backend)

                    rows += run_backend(name, s3_sizes[name], s3_store)
            finally:
                server.stop()
    print()
    print(table(rows))
    print()
    smallest = min(sizes)
    verdicts = []
    for r in rows:
        largest = max(x["shards"] for x in rows if x["backend"] == r["backend"])
        if r["shards"] != largest:
            continue
        first = next(
            x for x in rows if x["shards"] == smallest and x["backend"] == r["backend"] and x["stage"] == r["stage"]
        )
        flat_ms = r["new"]["ms"] / r["new_at_smallest_alternating"]["ms"]
        flat_list = r["new"]["requests"].get("LIST", 0) / max(first["new"]["requests"].get("LIST", 0), 1)
        vs_today = r["new"]["ms"] / r["today"]["ms"]
        verdicts.append(
            {
                "backend": r["backend"],
                "stage": r["stage"],
                "shards": largest,
                "new_vs_500_ms": flat_ms,
                "new_vs_500_list": flat_list,
                "new_vs_today_ms": vs_today,
                "meets_flat": flat_ms <= 1.5,
                "meets_vs_today": vs_today <= 0.05,
            }
        )
        print(
            f"{r['backend']:10s} {r['stage']:8s} at {largest:,}: {flat_ms:.2f}x the poll at {smallest:,} "
            f"(LIST requests {flat_list:.2f}x), {vs_today:.4f}x today's  "
            f"{'ok' if flat_ms <= 1.5 and vs_today <= 0.05 else 'MISSES the target'}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "sizes": sizes,
                "shards_per_version": PER_VERSION,
                "staleness": STALENESS,
                "rows": rows,
                "verdicts": verdicts,
                "seconds": time.perf_counter() - started,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {RESULTS} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
