"""The commands that read a whole store (`opd inspect STORE`, `opd export`, `opd replay`) on a damaged file.

Without `--skip-damaged` each stops with one line naming the file, `opd verify` and `--skip-damaged`, and
writes nothing; with it each leaves the file out and counts it. Also: replay's defaults that come from the
source run (its learning rate) and its step lines (no staleness: the source's versions mean nothing here).
Source: the annotated store of tests/test_export.py (11 rows in 3 shards, routed to teachers tA and tB).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from opd_cache.observe.metrics import MetricsLog
from opd_cache.storage import layout
from opd_cache.storage.schema import read_shard
from opd_cache.storage.store import Store, make_shard_id
from tests.faults import flip_bytes
from tests.test_cli_inspect import opd
from tests.test_export import annotated_store  # noqa: F401  (the module-scoped source store)
from tests.test_replay import ledger_rows, replay

DAMAGED_SHARD = make_shard_id(0, "w00", 0)  # 6 rows: 3 scored by tA, 3 by tB
DAMAGED_PART = layout.annotated_path(DAMAGED_SHARD, "tA")


@pytest.fixture
def damaged_store(annotated_store, tmp_path) -> Store:  # noqa: F811
    """A copy of the annotated store whose tA part of one shard has 8 bytes flipped in its middle."""
    store = Store(shutil.copytree(annotated_store.root, tmp_path / "damaged"))
    part = store.local_path(DAMAGED_PART)
    flip_bytes(part, part.stat().st_size // 2, 8)
    return store


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def assert_names_the_damage(stderr: str, store: Store) -> None:
    line = one_line(stderr)
    assert f"{DAMAGED_SHARD}/tA.arrow failed its checksum" in line, line
    assert f"`opd verify {store.uri}` lists every damaged file, and --skip-damaged goes on without them" in line


def rows_of(store: Store, teacher: str) -> int:
    return sum(
        read_shard(store, layout.annotated_path(s.shard_id, teacher))[0].num_rows for s in store.shards.rollouts()
    )


def test_inspect_store_stops_at_a_damaged_file_or_skips_and_counts_it(damaged_store, annotated_store):  # noqa: F811
    out = opd("inspect", damaged_store.uri)
    assert out.returncode == 2
    assert_names_the_damage(out.stderr, damaged_store)

    out = opd("inspect", damaged_store.uri, "--skip-damaged")
    assert out.returncode == 0, out.stderr
    assert "damaged: 1 file left out (--skip-damaged)" in " ".join(out.stdout.split())
    summary = json.loads(opd("inspect", damaged_store.uri, "--skip-damaged", "--json").stdout)
    intact = json.loads(opd("inspect", annotated_store.uri, "--json").stdout)
    assert list(summary["damaged"]) == [DAMAGED_PART] and "failed its checksum" in summary["damaged"][DAMAGED_PART]
    assert summary["teachers"]["tA"]["parts"] == intact["teachers"]["tA"]["parts"] - 1
    assert summary["teachers"]["tA"]["rows"] == intact["teachers"]["tA"]["rows"] - 3
    assert summary["teachers"]["tB"] == intact["teachers"]["tB"]
    assert intact["damaged"] == {}


def test_export_stops_at_a_damaged_part_leaving_nothing_or_skips_and_counts_it(
    damaged_store,
    annotated_store,  # noqa: F811
    tmp_path,
):
    to = tmp_path / "export"
    out = opd("export", damaged_store.uri, "--to", str(to))
    assert out.returncode == 2
    assert_names_the_damage(out.stderr, damaged_store)
    assert not to.exists()  # an aborted export leaves no folder, no temporary table

    out = opd("export", damaged_store.uri, "--to", str(to), "--skip-damaged")
    assert out.returncode == 0, out.stderr
    assert "skipped 1 damaged shard part (--skip-damaged): v000000-w00-000000 (tA)" in " ".join(out.stdout.split())
    manifest = json.loads((to / "export.json").read_text())
    assert list(manifest["skipped_damaged"]) == [f"{DAMAGED_SHARD} (tA)"]
    assert pq.read_table(to / "tA.parquet").num_rows == rows_of(annotated_store, "tA") - 3
    assert pq.read_table(to / "tB.parquet").num_rows == rows_of(annotated_store, "tB")


def test_replay_stops_at_a_damaged_source_shard_or_skips_and_counts_it(damaged_store, tmp_path):
    out = replay([damaged_store], tmp_path / "dst", max_steps=None)
    assert out.returncode == 2
    assert_names_the_damage(out.stderr, damaged_store)
    assert not (tmp_path / "dst").exists()

    out = replay([damaged_store], tmp_path / "dst", "--skip-damaged", max_steps=None)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert f"skipped damaged shard {DAMAGED_SHARD} of --from {damaged_store.uri}" in text
    assert "skipped 1 damaged source shard (--skip-damaged)" in text
    rows = ledger_rows(tmp_path / "dst")
    assert len(rows) == 11 - 6 and not any(sid.startswith(DAMAGED_SHARD) for _, sid in rows)


def test_replay_trains_at_the_source_runs_learning_rate_unless_given(annotated_store, tmp_path):  # noqa: F811
    source = Store(shutil.copytree(annotated_store.root, tmp_path / "source"))

    def printed_lr(*extra: str) -> float:
        args = ["replay", "--from", source.uri, "--store", str(tmp_path / "dst"), *extra, "--print-config"]
        out = opd(*args)
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout)["train"]["lr"]

    assert printed_lr() == 1e-5  # no training metrics in the source: the trainer's default
    metrics = MetricsLog(source, "train", "0")
    for step, lr in enumerate([1e-3, 2e-3, 2e-3, 1.5e-3], start=1):  # warm-up, then a cosine decay
        metrics.log({"step": step, "lr": lr, "loss": 1.0})
    metrics.flush()
    assert printed_lr() == 2e-3  # the peak: train.lr of the source run
    assert printed_lr("--lr", "3e-4") == 3e-4
    assert printed_lr("--set", "train.lr=4e-4") == 4e-4
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  lr: 5.0e-4\n")
    assert printed_lr("--config", str(config)) == 5e-4


def test_replay_step_lines_show_no_staleness(annotated_store, tmp_path):  # noqa: F811
    out = replay([annotated_store], tmp_path / "dst", max_steps="2")
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(re.search(r" tok/s wait \d+\.\d+s$", line) for line in steps), steps  # whole
    assert "staleness" not in out.stdout
    assert Path(tmp_path / "dst" / "metrics" / "train-0.jsonl").exists()
