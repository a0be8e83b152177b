"""MetricsLog appends: each flush writes only its new records, on local stores and on S3 (moto).

Readers (`read_metrics`, a restarted MetricsLog) see exactly the records logged, in order, never a
half-written one; a rewrite on resume (the trainer's) replaces the log once and survives a crash.
"""

from __future__ import annotations

import json

import pytest

from opd_cache.observe import metrics as metrics_module
from opd_cache.observe.metrics import MetricsLog, read_metrics
from opd_cache.storage.store import Store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store(tmp_path / "store")
    return request.getfixturevalue("s3_store")


def log_steps(log: MetricsLog, steps: range) -> None:
    for step in steps:
        log.log({"step": step, "loss": 1.0 / step}, flush=True)


def steps_of(records: list[dict]) -> list[int]:
    return [r["step"] for r in records]


def test_each_flush_writes_only_the_new_records(store, monkeypatch):
    monkeypatch.setattr(metrics_module, "SEGMENT_BYTES", 400)
    written = []
    write_bytes = store.write_bytes
    monkeypatch.setattr(store, "write_bytes", lambda rel, data: (written.append(len(data)), write_bytes(rel, data)))
    log = MetricsLog(store, "train", "0")
    log_steps(log, range(1, 41))
    assert steps_of(read_metrics(store)["train-0"]) == list(range(1, 41))
    if store.is_local:
        assert written == []  # appended in place, never republished
        assert store.read_bytes("metrics/train-0.jsonl").count(b"\n") == 40
    else:
        # one PUT per flush, of the current segment only: bounded by its size, not by the log's
        line_sizes = [len(line) + 1 for line in log.lines]
        rewrite_all = sum(sum(line_sizes[:k]) for k in range(1, 41))  # what republishing the file costs
        assert len(written) == 40 and max(written) <= 400
        assert sum(written) < rewrite_all / 4, (sum(written), rewrite_all)


def test_object_store_segments_are_bounded_in_size_and_compacted(s3_store, monkeypatch):
    monkeypatch.setattr(metrics_module, "SEGMENT_BYTES", 200)
    monkeypatch.setattr(metrics_module, "MERGE", 2)
    log = MetricsLog(s3_store, "rollout", "w00")
    log_steps(log, range(1, 121))
    names = sorted(i.base_name for i in s3_store.list_files("metrics/rollout-w00"))
    sizes = {name: len(s3_store.read_bytes(f"metrics/rollout-w00/{name}")) for name in names}
    sealed = log._seq  # segments 0 .. sealed - 1 are complete, `sealed` is the current one
    assert sealed >= 24, sealed  # ~4 records per 200-byte segment
    # merged pairwise level by level: one object per set bit of the sealed count, plus the current segment
    assert len(names) == bin(sealed).count("1") + 1, names
    assert all(size <= 200 for name, size in sizes.items() if "-" not in name), sizes
    assert steps_of(read_metrics(s3_store, "rollout")["rollout-w00"]) == list(range(1, 121))
    assert steps_of(MetricsLog(s3_store, "rollout", "w00").records()) == list(range(1, 121))


def test_a_merge_killed_before_deleting_its_parts_reads_the_same(s3_store, monkeypatch):
    monkeypatch.setattr(metrics_module, "SEGMENT_BYTES", 200)
    monkeypatch.setattr(metrics_module, "MERGE", 2)
    monkeypatch.setattr(s3_store, "delete", lambda rel: None)  # every merge "killed" after its PUT
    log = MetricsLog(s3_store, "rollout", "w00")
    log_steps(log, range(1, 61))
    assert any("-" in i.base_name for i in s3_store.list_files("metrics/rollout-w00"))
    assert steps_of(read_metrics(s3_store, "rollout")["rollout-w00"]) == list(range(1, 61))
    restarted = MetricsLog(s3_store, "rollout", "w00")
    log_steps(restarted, range(61, 81))
    assert steps_of(read_metrics(s3_store, "rollout")["rollout-w00"]) == list(range(1, 81))


def test_a_restarted_worker_continues_without_duplicates_or_losses(store):
    first = MetricsLog(store, "annotate", "t-0")
    log_steps(first, range(1, 6))
    first.log({"step": 6, "loss": 0.0})  # logged, never flushed: the worker was killed
    second = MetricsLog(store, "annotate", "t-0")
    assert steps_of(second.records()) == [1, 2, 3, 4, 5]
    log_steps(second, range(6, 9))
    third = MetricsLog(store, "annotate", "t-0")
    log_steps(third, range(9, 11))
    assert steps_of(read_metrics(store, "annotate")["annotate-t-0"]) == list(range(1, 11))
    assert steps_of(MetricsLog(store, "annotate", "t-0").records()) == list(range(1, 11))


def test_rewrite_on_resume_drops_later_steps_once(store):
    log = MetricsLog(store, "train", "0")
    log_steps(log, range(1, 11))
    resumed = MetricsLog(store, "train", "0")
    resumed.rewrite(lambda r: r["step"] <= 6)  # the trainer resumed from the state of step 6
    assert steps_of(read_metrics(store, "train")["train-0"]) == [1, 2, 3, 4, 5, 6]
    log_steps(resumed, range(7, 9))
    assert steps_of(read_metrics(store, "train")["train-0"]) == [1, 2, 3, 4, 5, 6, 7, 8]
    again = MetricsLog(store, "train", "0")
    assert steps_of(again.records()) == [1, 2, 3, 4, 5, 6, 7, 8]
    again.rewrite(lambda r: r["step"] <= 3)
    log_steps(again, range(4, 6))
    assert steps_of(read_metrics(store, "train")["train-0"]) == [1, 2, 3, 4, 5]
    if not store.is_local:  # the replaced segments are gone: a reader's LIST stays short
        names = sorted(i.base_name for i in store.list_files("metrics/train-0"))
        assert len(names) == 2 and names[0].endswith(".full.jsonl"), names


def test_a_rewrite_killed_before_its_cleanup_reads_the_same(s3_store, monkeypatch):
    log = MetricsLog(s3_store, "train", "0")
    log_steps(log, range(1, 6))
    monkeypatch.setattr(s3_store, "delete", lambda rel: None)  # killed right after the .full PUT
    MetricsLog(s3_store, "train", "0").rewrite(lambda r: r["step"] <= 2)
    assert len(s3_store.list_files("metrics/train-0")) == 2  # the old segment is still there ...
    assert steps_of(read_metrics(s3_store, "train")["train-0"]) == [1, 2]  # ... and skipped
    resumed = MetricsLog(s3_store, "train", "0")
    log_steps(resumed, range(3, 5))
    assert steps_of(read_metrics(s3_store, "train")["train-0"]) == [1, 2, 3, 4]


def test_a_half_written_last_line_is_invisible_and_cut_by_the_next_writer(tmp_path):
    store = Store(tmp_path / "store")
    log_steps(MetricsLog(store, "train", "0"), range(1, 4))
    path = store.local_path("metrics/train-0.jsonl")
    with open(path, "ab") as f:
        f.write(b'{"step": 4, "lo')  # a writer killed mid-line
    assert steps_of(read_metrics(store)["train-0"]) == [1, 2, 3]
    log_steps(MetricsLog(store, "train", "0"), range(4, 6))
    assert steps_of(read_metrics(store)["train-0"]) == [1, 2, 3, 4, 5]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_a_single_file_log_of_an_older_store_stays_readable_and_grows(s3_store):
    old = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)).encode()
    s3_store.write_bytes("metrics/train-0.jsonl", old)  # how metrics were written before segments
    s3_store.write_bytes("metrics/tensorboard/events.out.tfevents.1", b"not metrics")
    assert steps_of(read_metrics(s3_store)["train-0"]) == [1, 2, 3]
    log = MetricsLog(s3_store, "train", "0")
    log_steps(log, range(4, 6))
    assert s3_store.read_bytes("metrics/train-0.jsonl") == old  # never rewritten by a flush
    assert read_metrics(s3_store).keys() == {"train-0"}
    assert steps_of(read_metrics(s3_store)["train-0"]) == [1, 2, 3, 4, 5]
    MetricsLog(s3_store, "train", "0").rewrite(lambda r: r["step"] != 2)
    assert not s3_store.exists("metrics/train-0.jsonl")
    assert steps_of(read_metrics(s3_store)["train-0"]) == [1, 3, 4, 5]
