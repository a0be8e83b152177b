"""`opd replay`: a new student trained on existing annotations, the sources read in place and never changed.

Source: the annotated store of tests/test_export.py (real `annotate` output of two routed tiny teachers; 11
rows: 5 scored by tA, 6 by tB, in two policy versions). Exactly once per epoch is checked on the trainer's
consumed ledger: in step order, the rows of each epoch are the selected rows, each once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from opd_cache.storage import layout
from opd_cache.storage.schema import read_shard
from opd_cache.storage.store import Store
from opd_cache.train.checkpoint import read_ledger
from tests.test_cli_inspect import opd
from tests.test_export import annotated_store, packed_copy, store_hashes  # noqa: F401  (the module-scoped source store)


def replay(src: list[Store], dst: Path, *extra: str, max_steps: str | None = "100"):
    args = [
        "replay",
        *[a for s in src for a in ("--from", s.uri)],
        "--store",
        str(dst),
        "--global-batch-samples",
        "4",
        *(["--max-steps", max_steps] if max_steps else []),
        "--lr",
        "1e-3",
        *extra,
    ]
    return opd(*args)


def sample_ids(store: Store, teacher: str | None = None) -> list[str]:
    """Every annotated sample of `store` (of one teacher's parts, or of all)."""
    ids = []
    for shard in store.shards.rollouts():
        for t in [teacher] if teacher else ["tA", "tB"]:
            ids += read_shard(store, layout.annotated_path(shard.shard_id, t))[0]["sample_id"].to_pylist()
    return ids


def ledger_rows(dst: Path) -> list[tuple[str, str]]:
    """(shard key, sample id) of every trained row, in step order."""
    import json

    rows = []
    trained, _ = read_ledger(Store(dst))
    for step in trained:
        for line in (dst / "train" / "consumed" / f"step-{step:06d}.jsonl").read_text().splitlines():
            r = json.loads(line)
            rows.append((r["shard_id"], r["sample_id"]))
    return rows


def test_replay_one_source_one_epoch_trains_every_row_once_and_leaves_the_source_unchanged(annotated_store, tmp_path):
    before = store_hashes(annotated_store)
    out = replay([annotated_store], tmp_path / "dst", max_steps=None)  # no limit: the steps the epoch needs
    assert out.returncode == 0, out.output
    assert store_hashes(annotated_store) == before
    rows = ledger_rows(tmp_path / "dst")
    assert sorted(sid for _, sid in rows) == sorted(sample_ids(annotated_store))  # 11 rows, each once
    assert len(rows) == 11 and "step     3/3 v3" in out.stdout and "stopped (max_steps) at step 3" in out.stdout
    dst = Store(tmp_path / "dst")
    assert dst.latest_version() == 3 and dst.manifest.require()["replay"]["sources"] == [annotated_store.uri]
    assert not dst.shards.rollouts()  # no rollout, no teacher: nothing but the training run
    assert dst.is_done()


def test_replay_filtered_two_epochs_killed_and_resumed_is_exactly_once_per_epoch(annotated_store, tmp_path):
    before = store_hashes(annotated_store)
    selected = sorted(sample_ids(annotated_store, "tA"))
    extra = (
        "--teacher",
        "tA",
        "--epochs",
        "2",
        "--seed",
        "3",
        "--global-batch-samples",
        "2",
        "--set",
        "train.save_every=2",
    )
    # uninterrupted: 10 rows in 5 steps of 2
    full = replay([annotated_store], tmp_path / "full", *extra)
    assert full.returncode == 0, full.output
    assert "stopped (replayed 2 epoch(s)) at step 5" in full.stdout  # --max-steps 100: the data ended first
    assert Store(tmp_path / "full").read_bytes("train/DONE").decode().startswith("replayed 2 epoch(s) at step 5")
    uninterrupted = ledger_rows(tmp_path / "full")
    assert len(uninterrupted) == 10
    for epoch in (uninterrupted[:5], uninterrupted[5:]):
        assert sorted(sid for _, sid in epoch) == selected
    assert uninterrupted[:5] != uninterrupted[5:]  # each epoch has its own order

    # stopped after step 3 (an epoch boundary inside it), its last state lost as if killed before saving it
    dst = tmp_path / "dst"
    first = replay([annotated_store], dst, *extra[:-2], "--max-steps", "3", "--set", "train.save_every=2")
    assert first.returncode == 0, first.output
    shutil.rmtree(dst / "train" / "state" / "step-000003")
    assert len(ledger_rows(dst)) == 6  # step 3 was trained and logged
    resumed = replay([annotated_store], dst, *extra)
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.stdout and "(step 2," in resumed.stdout
    assert ledger_rows(dst) == uninterrupted  # the same rows, in the same order, each epoch once
    assert store_hashes(annotated_store) == before

    # a resume with another selection is refused, naming it
    other = replay([annotated_store], dst, "--teacher", "tB")
    assert other.returncode == 2
    assert "run.json: replay is {" in other.stderr and "use a new store for a different replay" in " ".join(
        other.stderr.split()
    )


def test_replay_from_two_stores(annotated_store, tmp_path):
    second = tmp_path / "second"
    shutil.copytree(annotated_store.root, second)  # same shard ids: the sources must not be confused
    src2 = Store(second)
    before = store_hashes(annotated_store), store_hashes(src2)
    out = replay([annotated_store, src2], tmp_path / "dst", "--data-source", "math")
    assert out.returncode == 0, out.output
    rows = ledger_rows(tmp_path / "dst")
    math = sorted(sample_ids(annotated_store, "tA"))  # routing sent exactly the math rows to tA
    assert sorted(sid for key, sid in rows if key.startswith("0:")) == math
    assert sorted(sid for key, sid in rows if key.startswith("1:")) == math
    assert (store_hashes(annotated_store), store_hashes(src2)) == before


def test_replay_refusals_are_one_line_and_write_nothing(annotated_store, tmp_path, tokenizer_path):
    from tests.test_export import write_rollout

    bare = Store(tmp_path / "bare")
    run = bare.manifest.ensure(student=str(tokenizer_path), tokenizer_fingerprint="fp")
    write_rollout(bare, run, "v000000-w00-000000", ["math"], seed=0)
    out = replay([bare], tmp_path / "dst")
    assert out.returncode == 2
    assert (
        f"--from {bare.uri}: no annotated shards to replay (1 rollout shards, 0 annotated, none selected by the "
        f"version range and teachers): run `opd annotate` on it first"
    ) in " ".join(out.stderr.split())
    out = replay([annotated_store], tmp_path / "dst", "--min-version", "5")
    assert out.returncode == 2 and (
        "no annotated shards to replay (3 rollout shards, 3 annotated, none selected by "
        "the version range and teachers): widen --min-version/--max-version/--teacher"
    ) in " ".join(out.stderr.split())
    out = replay([annotated_store], tmp_path / "dst", "--teacher", "tC")
    assert out.returncode == 2 and "--teacher tC: " in out.stderr and "has annotations from tA, tB" in out.stderr
    assert not (tmp_path / "dst").exists()
    out = replay([annotated_store], Path(annotated_store.root))
    assert out.returncode == 2 and "is one of the --from stores" in " ".join(out.stderr.split())
    other_run = tmp_path / "other_run"
    shutil.copytree(annotated_store.root, other_run)
    before = store_hashes(Store(other_run))
    out = replay([annotated_store], other_run)
    assert out.returncode == 2
    assert f"--store {other_run} holds a run that is not a replay ({other_run}/run.json); use a new folder" in " ".join(
        out.stderr.split()
    )
    assert store_hashes(Store(other_run)) == before
    out = replay([annotated_store], tmp_path / "dst", "--set", "train.support=union")
    assert out.returncode == 2 and "--support union is not available for replay yet" in out.stderr
    assert not (tmp_path / "dst").exists()


def test_replay_sources_with_another_tokenizer_are_refused(annotated_store, tmp_path):
    import json

    other = tmp_path / "other"
    shutil.copytree(annotated_store.root, other)
    run = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**run, "tokenizer_fingerprint": "0123456789abcdef"}))
    out = replay([annotated_store, Store(other)], tmp_path / "dst")
    assert out.returncode == 2
    assert (
        f"--from {other}: tokenizer_fingerprint is '0123456789abcdef', but {annotated_store.uri} has "
        f"{run['tokenizer_fingerprint']!r}; replay sources must share one tokenizer and top-k"
    ) in " ".join(out.stderr.split())
    assert not (tmp_path / "dst").exists()


def test_replay_from_an_s3_store_leaves_its_objects_unchanged(
    annotated_store, s3_store, s3_endpoint, monkeypatch, tmp_path
):
    import hashlib

    import pyarrow.fs as pafs

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # the --from stores: Store(uri), as pyarrow opens it
    root = Path(annotated_store.root)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            s3_store.write_bytes(str(p.relative_to(root)), p.read_bytes())

    def objects() -> dict[str, str]:
        infos = s3_store.fs.get_file_info(pafs.FileSelector(s3_store.root, recursive=True))
        return {
            i.path: hashlib.sha256(s3_store.fs.open_input_stream(i.path).read()).hexdigest()
            for i in infos
            if i.type == pafs.FileType.File
        }

    before = objects()
    out = replay([s3_store], tmp_path / "dst")
    assert out.returncode == 0, out.output
    assert objects() == before and len(before) == len(store_hashes(annotated_store))
    assert sorted(sid for _, sid in ledger_rows(tmp_path / "dst")) == sorted(sample_ids(annotated_store))


def test_replay_sigkilled_mid_epoch_resumes_exactly_once_per_epoch(annotated_store, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    args = [
        "--teacher",
        "tA",
        "--epochs",
        "6",
        "--seed",
        "1",
        "--global-batch-samples",
        "1",
        "--set",
        "train.save_every=3",
    ]
    full = replay([annotated_store], tmp_path / "full", *args)  # 30 steps of one row
    assert full.returncode == 0, full.output
    uninterrupted = ledger_rows(tmp_path / "full")
    assert len(uninterrupted) == 30

    dst = tmp_path / "dst"
    cmd = [
        sys.executable,
        "-m",
        "opd_cache.cli",
        "replay",
        "--from",
        annotated_store.uri,
        "--store",
        str(dst),
        "--max-steps",
        "100",
        "--lr",
        "1e-3",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    hang_guard = time.monotonic() + 600  # the event is step 8's ledger file; the guard only stops a hung replay
    while not (dst / "train" / "consumed" / "step-000008.jsonl").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < hang_guard, "the replay did not reach step 8 in 600 s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    resumed = replay([annotated_store], dst, *args)
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.stdout
    assert ledger_rows(dst) == uninterrupted  # every epoch's 5 rows once, in the uninterrupted order


def test_replay_weights_rows_by_truncated_importance_from_the_stored_behavior_logprobs(annotated_store, tmp_path):
    """`train.importance_cap` in a replay: min(exp(s - s_behavior), c) with s the new student's log-prob and
    s_behavior the one stored in the source's rollout shards; the step's logged means equal an independent
    forward of the student over the step's rows."""
    import json

    import numpy as np
    import torch

    from opd_cache.models import load_causal_lm
    from opd_cache.observe.metrics import read_metrics

    cap = 0.015  # the tiny student's log-probs (~ -log 99) against stored ones in [-1, 0]: both sides of the cap
    out = replay([annotated_store], tmp_path / "dst", "--importance-cap", str(cap), max_steps="1")
    assert out.returncode == 0, out.output
    logs = read_metrics(Store(tmp_path / "dst"), "train")
    (record,) = [r for log in logs.values() for r in log if r.get("step") == 1 and "importance_weight" in r]

    trained = {json.loads(line)["sample_id"] for line in (tmp_path / "dst/train/consumed/step-000001.jsonl").open()}
    student = load_causal_lm(annotated_store.manifest.require().student).eval()
    weights, clipped = [], []
    for shard in annotated_store.shards.rollouts():
        table, _ = read_shard(annotated_store, shard.path)
        for row in table.to_pylist():
            if row["sample_id"] not in trained:
                continue
            ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(student(input_ids=ids).logits[0].double(), -1)
            p = len(row["prompt_ids"])
            s = logp[p - 1 : -1].gather(1, torch.tensor(row["response_ids"])[:, None])[:, 0].numpy()
            ratio = np.exp(s - np.asarray(row["behavior_logprobs"]))
            weights += list(np.minimum(ratio, cap))
            clipped += list(ratio > cap)
    assert len(weights) == record["tokens"]
    assert 0 < np.mean(clipped) < 1  # the cap truncated some tokens and not others
    np.testing.assert_allclose(record["importance_weight"], np.mean(weights), rtol=1e-4)
    np.testing.assert_allclose(record["importance_clipped"], np.mean(clipped), rtol=1e-6)


def from_the_future(table, meta, pa):
    import dataclasses

    return table, dataclasses.replace(meta, codec_version=99)


def truncated_codes(table, meta, pa):
    from tests.helpers import truncate_packed_field

    return truncate_packed_field(table, "lp_codes"), meta


def test_replay_reads_packed_parts_and_refuses_damaged_ones_in_one_line(annotated_store, tmp_path):
    packed = packed_copy(annotated_store, tmp_path / "packed")
    before = store_hashes(packed)
    out = replay([packed], tmp_path / "dst", "--epochs", "1", max_steps=None)
    assert out.returncode == 0, out.stderr
    assert sorted(sid for _, sid in ledger_rows(tmp_path / "dst")) == sorted(sample_ids(annotated_store))
    assert store_hashes(packed) == before

    for name, damage, message in (
        ("future", from_the_future, "packed codec version 99 is newer than this opd_cache reads (version 3)"),
        ("truncated", truncated_codes, "packed column 'teacher_topk_packed.lp_codes' is truncated: 3 bytes per"),
    ):
        source = packed_copy(annotated_store, tmp_path / name, damage)
        out = replay([source], tmp_path / f"dst-{name}", max_steps=None)
        assert out.returncode == 2, (name, out.returncode, out.stderr[-2000:])
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and message in " ".join(out.stderr.split()), (name, out.stderr)
        assert not (tmp_path / f"dst-{name}").exists()
