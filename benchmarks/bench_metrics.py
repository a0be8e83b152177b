"""What N metrics flushes cost: the old MetricsLog (republish the whole file each flush) vs appends (issue #14).

    python benchmarks/bench_metrics.py            # N = 100, 400, 1,600 (local), 100, 400, 1,000 (moto S3)
    python benchmarks/bench_metrics.py --quick    # N = 100, 400 local, 100 S3 (a smoke run)

Each flush follows one trainer-like record (~700 bytes of JSON, the shape `Trainer._log` writes), the
trainer's pattern with a flush per step. `old` is the MetricsLog before issue #14, replicated here: every
flush writes all records so far atomically (local: temporary file, fsync, rename; S3: one PUT). `new` is
opd_cache.observe.metrics.MetricsLog: local stores append the new lines (one write), object stores re-PUT only the
current segment (<= SEGMENT_BYTES). Reported: wall time of all N flushes, bytes written, the time of the last
10% of flushes per flush (what a long run pays per step), and the `read_metrics` time of the final log.
S3 is moto's server on 127.0.0.1 in a subprocess (every request is HTTP to localhost).
Results: a table on stdout and benchmarks/results/bench_metrics.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import write_results

from opd_cache.observe.metrics import SEGMENT_BYTES, MetricsLog, read_metrics
from opd_cache.storage.store import Store

RESULTS = ROOT / "benchmarks" / "results" / "bench_metrics.json"


class OldMetricsLog:
    """opd_cache/observe/metrics.py before issue #14: the whole file, republished atomically on every flush."""

    def __init__(self, store: Store, stage: str, worker: str = "0"):
        self.store, self.rel, self.lines = store, f"metrics/{stage}-{worker}.jsonl", []

    def log(self, record: dict, flush: bool = False) -> None:
        self.lines.append(json.dumps({"time": round(time.time(), 3), **record}, default=float))
        if flush:
            self.flush()

    def flush(self) -> None:
        self.store.write_bytes(self.rel, ("\n".join(self.lines) + "\n").encode() if self.lines else b"")


def trainer_record(step: int) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "trained_version": step - 1,
        "lr": 3e-4 * 0.999**step,
        "loss": 6.92 / step,
        "grad_norm": 1.2345678,
        "samples": 64,
        "tokens": 8192,
        "input_tokens": 12000,
        "micro_batches": 4,
        "step_time_s": 0.2512345,
        "tokens_per_s": 32611.1234,
        "data_wait_s": 0.0012345,
        "stream_wait_s": 0.0,
        "decode_s": 0.0031234,
        "expired_rows": 0,
        "expired_total": 0,
        "lost_total": 0,
        "lost_shards": 0,
        "staleness": {"0": 48, "1": 16},
        "loss_min": 0.0012345,
        "loss_max": 12.345678,
        "teacher_mass_support": 0.99908071756,
        "student_mass_support": 0.5123456,
        "topk_overlap": 0.40427741,
        "teacher_tail_mass": 0.00091925211,
        "student_tail_mass": 0.4876543,
    }


def run_flushes(store: Store, which: str, n: int) -> dict:
    written = []
    write_bytes = store.write_bytes
    store.write_bytes = lambda rel, data: (written.append(len(data)), write_bytes(rel, data))
    log = OldMetricsLog(store, "train") if which == "old" else MetricsLog(store, "train", "0")
    tail_from = n - max(1, n // 10)
    tic = time.perf_counter()
    for step in range(1, n + 1):
        if step == tail_from + 1:
            tail_tic = time.perf_counter()
        log.log(trainer_record(step), flush=True)
    total = time.perf_counter() - tic
    tail = (time.perf_counter() - tail_tic) / (n - tail_from)
    del store.write_bytes
    if which == "new" and store.is_local:  # appends bypass write_bytes: count the file itself
        written = [len(store.read_bytes("metrics/train-0.jsonl"))]
    tic = time.perf_counter()
    records = read_metrics(store, "train")["train-0"]
    read_s = time.perf_counter() - tic
    assert [r["step"] for r in records] == list(range(1, n + 1))
    objects = len(store.list_files("metrics", recursive=True))
    return {
        "total_s": total,
        "tail_ms_per_flush": tail * 1e3,
        "bytes_written": sum(written),
        "read_s": read_s,
        "objects": objects,
    }


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ[key] = value
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = {"local": [100, 400] if args.quick else [100, 400, 1600], "s3": [100] if args.quick else [100, 400, 1000]}
    moto, endpoint = start_moto()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for backend, ns in sizes.items():
                for n in ns:
                    row = {"backend": backend, "n": n}
                    for which in ("old", "new"):
                        if backend == "local":
                            store = Store(Path(tmp) / f"{which}-{n}")
                        else:
                            bucket = f"bench-{which}-{n}-{int(time.time() * 1000) % 100000}"
                            store = Store(f"s3://{bucket}/run", s3_endpoint=endpoint)
                            store.fs.create_dir(bucket)
                        row[which] = run_flushes(store, which, n)
                    rows.append(row)
                    print(f"  {backend} N={n}: done", file=sys.stderr, flush=True)
    finally:
        moto.terminate()
        moto.wait(timeout=10)

    print(f"\nMetrics flushes, one ~700-byte trainer record per flush (SEGMENT_BYTES = {SEGMENT_BYTES:,})\n")
    print(
        "| store | N flushes | old total | new total | new / old | old last-10% per flush | new | "
        "old MB written | new MB written | read (new) | objects (new) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        old, new = r["old"], r["new"]
        print(
            f"| {r['backend']} | {r['n']:,} | {old['total_s']:.2f} s | {new['total_s']:.2f} s | "
            f"**{new['total_s'] / old['total_s']:.3f}×** | {old['tail_ms_per_flush']:.2f} ms | "
            f"{new['tail_ms_per_flush']:.2f} ms | {old['bytes_written'] / 1e6:.1f} | "
            f"{new['bytes_written'] / 1e6:.2f} | {new['read_s'] * 1e3:.0f} ms | {new['objects']} |"
        )
    write_results(
        RESULTS,
        {"machine": platform.platform(), "cpus": os.cpu_count(), "segment_bytes": SEGMENT_BYTES, "rows": rows},
    )


if __name__ == "__main__":
    main()
