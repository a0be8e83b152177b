"""Integrity: every stored byte is checked before it is used; damaged files are quarantined, never trained on.

Fault injection for each file kind (rollout shard, annotated part, policy weights, resume state): bytes flipped at
seeded random offsets in the header, the middle and the footer, and truncation at random lengths. Each test checks
that the damage is caught with a message naming the file, that the run goes on (or recovers), that the damaged
file lands in quarantine/ with its reason, and that `opd verify` reports what is still damaged in place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

import opd_cache.cli  # noqa: F401  (registers every command on `app`)
from opd_cache.cli.common import app
from opd_cache.config import AnnotateConfig, Config
from opd_cache.models import build_tiny_model, load_causal_lm, save_causal_lm
from opd_cache.rollout.policy import CorruptPolicyError, PolicyFiles
from opd_cache.storage import integrity, layout
from opd_cache.storage.schema import ROLLOUT, CorruptShardError, ShardMeta, read_shard
from opd_cache.storage.store import Store, make_shard_id
from opd_cache.testing import write_synthetic_shard
from opd_cache.tokenizer import tokenizer_fingerprint
from opd_cache.train import run_train
from opd_cache.train.checkpoint import complete_states, read_ledger, verify_ledger
from tests.conftest import write_random_rollout_shard
from tests.faults import damage_offsets, flip_bytes, truncate
from tests.test_train_stream import make_stream
from tests.test_trainer import K, assert_same_weights, config, final_weights

DAMAGE = ["header", "middle", "footer", "truncate"]


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory, tokenizer):
    model = build_tiny_model(vocab_size=len(tokenizer), seed=1, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("teacher") / "teacher"
    save_causal_lm(model, tokenizer, path)
    return path


@pytest.fixture
def student_path(tiny_model_factory):
    return tiny_model_factory("student", seed=0)


def make_store(
    root: Path,
    student_path: Path,
    tokenizer,
    teacher_path: Path,
    *,
    shards: int = 3,
    rows: int = 8,
    skip: tuple[str, ...] = (),
) -> Store:
    """Shards v000000-w00-00000{0..}, annotated by the tiny teacher; `skip` names files never written."""
    store = Store(root)
    run = store.manifest.ensure(
        student=str(student_path),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=len(tokenizer),
        top_k=K,
        teachers={"teacher": str(teacher_path)},
    )
    teacher, behavior = load_causal_lm(teacher_path), load_causal_lm(student_path)
    for seq in range(shards):
        shard_id = make_shard_id(0, "w00", seq)
        write_synthetic_shard(
            store,
            run,
            shard_id,
            num_rows=rows,
            vocab_size=len(tokenizer),
            top_k=K,
            seed=seq,
            teachers={"teacher": teacher},
            behavior=behavior,
        )
        for rel in (layout.rollout_path(shard_id), layout.annotated_path(shard_id, "teacher")):
            if rel in skip:
                store.delete(rel)
    return store


def damage(path: Path, how: str, seed: int) -> None:
    """Flip 8 bytes at a seeded random offset of one region, or truncate at a seeded random length."""
    rng = np.random.default_rng(seed)
    size = path.stat().st_size
    if how == "truncate":
        truncate(path, int(rng.integers(1, size)))
    else:
        flip_bytes(path, damage_offsets(size, rng)[how], count=8)


def verify(store: Store, *args: str):
    return CliRunner().invoke(app, ["verify", store.uri, *args])


def quarantine_reason(store: Store, rel: str) -> str:
    return store.list_quarantine()[rel.replace("/", "__")]


# ------------------------------------------------------------------ shards, unit
@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("kind", ["rollout", "annotated"])
def test_damaged_shard_is_refused_with_a_message_naming_it(local_store, how, kind):
    run = local_store.manifest.ensure(student="s", tokenizer_fingerprint="fp")
    write_synthetic_shard(local_store, run, "v000000-w00-000000", num_rows=16, vocab_size=50, top_k=4)
    rel = (
        layout.rollout_path("v000000-w00-000000")
        if kind == "rollout"
        else layout.annotated_path("v000000-w00-000000", "teacher")
    )
    read_shard(local_store, rel)  # control: intact, it reads
    path = local_store.local_path(rel)
    for seed in range(3):  # three seeded offsets (or lengths) per region
        intact = path.read_bytes()
        damage(path, how, seed)
        with pytest.raises(CorruptShardError) as caught:
            read_shard(local_store, rel)
        message = str(caught.value)
        if how == "truncate":
            assert re.fullmatch(
                re.escape(f"shard {path} failed its checksum (")
                + r".+"
                + re.escape("no valid trailer: truncated, or its last bytes are damaged)"),
                message,
            ) or message.startswith(f"{path}: truncated or not an Arrow IPC stream ("), message
        else:
            assert message.startswith(f"shard {path} failed its checksum ("), message
        assert caught.value.rel == rel
        path.write_bytes(intact)


def test_checksum_message_says_stored_and_computed(local_store):
    write_random_rollout_shard(local_store, shard_id="v000000-w00-000000", num_rows=8)
    rel = layout.rollout_path("v000000-w00-000000")
    path = local_store.local_path(rel)
    stored = path.read_bytes()[-integrity.TRAILER_SIZE : -16][::-1].hex()  # the trailer's little-endian checksum
    flip_bytes(path, path.stat().st_size // 2, count=64)
    computed = integrity.checksum(path.read_bytes()[: -integrity.TRAILER_SIZE])
    with pytest.raises(
        CorruptShardError, match=re.escape(f"shard {path} failed its checksum (stored {stored}, computed {computed})")
    ):
        read_shard(local_store, rel)


def test_trailer_is_invisible_to_other_arrow_readers(local_store):
    import datasets

    table = write_random_rollout_shard(local_store, shard_id="v000000-w00-000000", num_rows=5)
    path = local_store.local_path(layout.rollout_path("v000000-w00-000000"))
    assert path.read_bytes().endswith(integrity.TRAILER_MAGIC)
    assert pa.ipc.open_stream(str(path)).read_all().equals(table.replace_schema_metadata(None), check_metadata=False)
    assert datasets.Dataset.from_file(str(path))["sample_id"] == table["sample_id"].to_pylist()


def test_old_shards_without_checksum_read_with_one_warning(local_store, capsys, monkeypatch):
    monkeypatch.setattr(integrity, "_warned", set())
    run = local_store.manifest.ensure(student="s", tokenizer_fingerprint="fp")
    for seq in range(2):  # written as opd_cache wrote shards before checksums: a bare Arrow stream
        shard_id = make_shard_id(0, "w00", seq)
        table = write_random_rollout_shard(local_store, shard_id=shard_id, run=run)
        meta = ShardMeta(
            kind=ROLLOUT, run_id=run["run_id"], tokenizer_fingerprint="fp", shard_id=shard_id, policy_version=0
        )
        with pa.ipc.new_stream(
            str(local_store.local_path(layout.rollout_path(shard_id))),
            table.schema.with_metadata(meta.to_metadata()),
        ) as writer:
            writer.write_table(table)
    capsys.readouterr()
    for seq in range(2):
        assert read_shard(local_store, layout.rollout_path(make_shard_id(0, "w00", seq)))[0].num_rows == 4
    err = capsys.readouterr().err
    assert err.count("has no checksum (written before opd_cache recorded them)") == 1, err
    result = verify(local_store)
    assert result.exit_code == 0, result.output
    assert "0 ok, 0 corrupt, 0 missing, 2 without checksum" in " ".join(result.output.split())


# ------------------------------------------------------------------ shards, in training
@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory, tiny_model_factory, tokenizer, teacher_path):
    """Trained weights of stores where the file that a test damages never existed (computed once per file)."""
    cache = {}

    def get(missing: str) -> dict:
        if missing not in cache:
            root = tmp_path_factory.mktemp("reference")
            store = make_store(
                root / "store",
                tiny_model_factory("student", seed=0),
                tokenizer,
                teacher_path,
                skip=(missing,)
                if missing.startswith("annotated")
                else (missing, missing.replace("rollouts/", "annotated/").replace(".arrow", "/teacher.arrow")),
            )
            run_train(config(store, max_steps=3, lr=3e-3), store)
            cache[missing] = final_weights(store)
        return cache[missing]

    return get


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_annotated_part_is_quarantined_never_trained_and_rescored(
    tmp_path, student_path, tokenizer, teacher_path, reference_weights, how, capsys
):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher_path)
    shard_id = make_shard_id(0, "w00", 1)
    rel = layout.annotated_path(shard_id, "teacher")
    damage(store.local_path(rel), how, seed=DAMAGE.index(how))
    result = run_train(config(store, max_steps=3, lr=3e-3), store)
    assert result.stopped == "no more admissible data" and result.trained_samples == 16  # the two intact shards
    assert_same_weights(final_weights(store), reference_weights(rel))  # as if the part never existed
    assert not store.exists(rel)
    reason = quarantine_reason(store, rel)
    assert reason.startswith(f"{rel}: ") and str(store.local_path(rel)) in reason
    assert f"{store.local_path(rel)}" in capsys.readouterr().err
    verdict = verify(store)
    assert verdict.exit_code == 0, verdict.output  # the damage left the live store: it is only in quarantine/
    assert f"quarantined {rel.replace('/', '__')}: {rel}:" in " ".join(verdict.output.split())

    if how != "middle":
        return
    # annotate re-scores the shard (its rollout shard is intact), and the trainer then trains it
    from opd_cache.annotate import run_annotate

    stats = run_annotate(
        Config(annotate=AnnotateConfig(teacher=str(teacher_path), teacher_name="teacher", top_k=K)), store
    )
    assert stats.annotated == [shard_id]
    read_shard(store, rel)
    more = run_train(config(store, max_steps=4, lr=3e-3), store)
    assert more.trained_samples == 24
    assert verify_ledger(store)["duplicates"] == [] and verify_ledger(store)["trained"] == 24


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_rollout_shard_is_quarantined_and_its_rows_counted_as_lost(
    tmp_path, student_path, tokenizer, teacher_path, reference_weights, how
):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher_path)
    shard_id = make_shard_id(0, "w00", 1)
    rel = layout.rollout_path(shard_id)
    damage(store.local_path(rel), how, seed=10 + DAMAGE.index(how))
    result = run_train(config(store, max_steps=3, lr=3e-3), store)
    assert result.trained_samples == 16
    assert_same_weights(final_weights(store), reference_weights(rel))
    progress = store.read_progress()
    assert progress["lost_samples"] == 8 and progress["lost_shards"] == 1
    assert json.loads(store.read_bytes("metrics/train-0.jsonl").decode().splitlines()[-1])["lost_total"] == 8
    _, skipped = read_ledger(store)
    assert sorted(s for s, why in skipped.items() if why == "lost") == sorted(f"{shard_id}-{i}" for i in range(8))
    assert quarantine_reason(store, rel).startswith(f"{rel}: ")
    assert not store.exists(rel)


# ------------------------------------------------------------------ resume states
@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_newest_resume_state_falls_back_to_the_previous_one(
    tmp_path, student_path, tokenizer, teacher_path, how, capsys
):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher_path)
    run_train(config(store, max_steps=2, publish_every=1, save_every=1, keep_states=2, lr=3e-3), store)
    assert complete_states(store) == [1, 2]
    state = store.local_path("train/state/step-000002")
    victim = {"header": ".metadata", "middle": "__0_0.distcp", "footer": "trainer.json", "truncate": "__0_0.distcp"}[
        how
    ]
    damage(state / victim, how, seed=20 + DAMAGE.index(how))
    capsys.readouterr()
    run_train(config(store, max_steps=3, publish_every=1, save_every=1, keep_states=2, lr=3e-3), store)
    assert "warning: resume state step 2 is damaged (" in capsys.readouterr().err
    assert f"train__state__step-000002__{victim}" in store.list_quarantine()
    assert "failed its checksum (stored" in quarantine_reason(store, f"train/state/step-000002/{victim}")

    straight = make_store(tmp_path / "straight", student_path, tokenizer, teacher_path)
    run_train(config(straight, max_steps=3, publish_every=1, save_every=1, keep_states=2, lr=3e-3), straight)
    assert_same_weights(final_weights(store), final_weights(straight))  # resumed from step 1: nothing corrupt loaded
    assert read_ledger(store) == read_ledger(straight)


# ------------------------------------------------------------------ policy versions
@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_policy_version_is_never_loaded(tmp_path, student_path, tokenizer, teacher_path, how, capsys):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher_path)
    run_train(config(store, max_steps=2, publish_every=1, save_every=1, lr=3e-3), store)
    assert store.latest_version() == 2
    weights = store.local_path("policy/v000002/model.safetensors")
    v2 = final_weights(store)
    damage(weights, how, seed=30 + DAMAGE.index(how))

    policies = PolicyFiles(store, str(student_path))
    with pytest.raises(
        CorruptPolicyError, match=re.escape(f"policy version 2 is not loaded: {weights} failed its checksum (stored ")
    ):
        policies.path(2)
    assert "failed its checksum" in quarantine_reason(store, "policy/v000002/model.safetensors")
    capsys.readouterr()
    assert policies.newest_intact(2) == (1, str(store.local_path("policy/v000001")))  # rollout falls back
    assert "policy version 2 is not loaded" in capsys.readouterr().err
    verdict = verify(store)
    assert verdict.exit_code == 1
    assert f"missing policy/v000002/model.safetensors: {weights} is missing" in " ".join(verdict.output.split())

    # A trainer that resumes before version 2 publishes it again (the same weights: deterministic on CPU).
    store.delete("train/state/step-000002/_COMPLETE")
    run_train(config(store, max_steps=3, publish_every=1, save_every=1, lr=3e-3), store)
    assert policies.path(2) == str(store.local_path("policy/v000002"))
    with torch.no_grad():
        republished = load_causal_lm(store.local_path("policy/v000002")).state_dict()
    assert_same_weights(republished, v2)
    assert store.latest_version() == 3


def test_rollout_keeps_its_version_when_the_new_one_is_damaged(tmp_path, student_path, tokenizer, teacher_path):
    from opd_cache.config import Config, RolloutConfig, SamplingConfig
    from opd_cache.rollout import run_rollout
    from tests.test_rollout import questions, write_prompts

    store = make_store(tmp_path / "store", student_path, tokenizer, teacher_path, shards=1)
    run_train(config(store, max_steps=1, publish_every=1, lr=3e-3), store)
    flip_bytes(store.local_path("policy/v000001/model.safetensors"), 200, count=4)
    prompts = write_prompts(tmp_path / "p.jsonl", questions(4))
    result = run_rollout(
        Config(
            max_staleness=5,
            rollout=RolloutConfig(
                student=str(student_path),
                prompts=str(prompts),
                n=2,
                worker_id="w01",
                sampling=SamplingConfig(max_new_tokens=4),
                flush_rows=4,
                max_samples=4,
            ),
        ),
        store,
    )
    assert result.policy_version == 0 and result.shards == ["v000000-w01-000000"]
    assert "failed its checksum (stored" in quarantine_reason(store, "policy/v000001/model.safetensors")


# ------------------------------------------------------------------ opd verify
def test_verify_reports_each_damaged_file_and_exits_non_zero(tmp_path, student_path, tokenizer, teacher_path):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher_path)
    run_train(config(store, max_steps=2, publish_every=1, save_every=1, lr=3e-3), store)
    clean = verify(store)
    assert clean.exit_code == 0, clean.output
    summary = " ".join(clean.output.split())
    # 3 rollout shards + 3 parts + 2 versions and 2 states (each file of their manifests)
    assert re.search(r": (\d+) ok, 0 corrupt, 0 missing, 0 without checksum", summary), summary

    damaged = [
        layout.rollout_path(make_shard_id(0, "w00", 0)),
        layout.annotated_path(make_shard_id(0, "w00", 2), "teacher"),
        "policy/v000001/model.safetensors",
        "train/state/step-000002/trainer.json",
    ]
    for i, rel in enumerate(damaged):
        flip_bytes(store.local_path(rel), 100 + i, count=2)
    store.delete("policy/v000002/config.json")
    result = verify(store)
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    for rel in damaged:
        assert f"corrupt {rel}: " in text and "failed its checksum (stored" in text, rel
    assert f"missing policy/v000002/config.json: {store.path('policy/v000002/config.json')} is missing" in text
    assert re.search(r"\d+ ok, 4 corrupt, 1 missing, 0 without checksum", text), text
    report = json.loads(verify(store, "--json").output)
    assert (report["corrupt"], report["missing"]) == (4, 1)


def test_verify_works_on_s3(s3_store, s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # `opd verify` reads no configuration: pyarrow reads it
    run = s3_store.manifest.ensure(student="s", tokenizer_fingerprint="fp")
    for seq in range(2):
        write_synthetic_shard(s3_store, run, make_shard_id(0, "w00", seq), num_rows=6, vocab_size=40, top_k=4, seed=seq)
    ok = verify(s3_store)
    assert ok.exit_code == 0 and "4 ok, 0 corrupt" in " ".join(ok.output.split()), ok.output
    rel = layout.rollout_path(make_shard_id(0, "w00", 1))
    data = bytearray(s3_store.read_bytes(rel))
    data[len(data) // 2] ^= 0x40
    s3_store.write_bytes(rel, bytes(data))  # a damaged object (e.g. a faulty copy between buckets)
    bad = verify(s3_store)
    assert bad.exit_code == 1
    assert f"corrupt {rel}: shard {s3_store.path(rel)} failed its checksum (stored" in " ".join(bad.output.split())
    with pytest.raises(CorruptShardError):
        read_shard(s3_store, rel)


# ------------------------------------------------------------------ a part damaged mid-shard
def test_damaged_part_of_a_partly_trained_shard_waits_for_annotate(local_store):
    """The stream cannot leave a partly consumed shard: it quarantines the part and waits until it is back."""
    import threading

    from opd_cache.train.stream import StreamEnd

    run = local_store.manifest.ensure(
        student="s", tokenizer_fingerprint="fp", vocab_size=32, top_k=4, teachers={"teacher": "t"}
    )
    shard_id = make_shard_id(0, "w00", 0)
    write_synthetic_shard(local_store, run, shard_id, num_rows=8, vocab_size=32, top_k=4)
    rel = layout.annotated_path(shard_id, "teacher")
    intact = local_store.local_path(rel).read_bytes()
    stream, cache = make_stream(local_store, run, follow=True, poll_seconds=0.02, idle_timeout=30)
    events = []
    stream.on_event = events.append
    first = stream.next_batch(1, 0)
    assert first.sample_ids == [f"{shard_id}-{i}" for i in range(4)] and stream.cursor.current_rows == 4
    cache._shards.clear()  # the shard left the cache ...
    flip_bytes(local_store.local_path(rel), 100, count=8)  # ... and its part got damaged on disk
    rewrite = threading.Timer(0.3, lambda: local_store.write_bytes(rel, intact))  # annotate scores it again
    rewrite.start()
    second = stream.next_batch(2, 0)
    rewrite.join()
    assert second.sample_ids == [f"{shard_id}-{i}" for i in range(4, 8)]  # the same rows, none repeated
    assert events and events[0].startswith(f"shard {local_store.path(rel)} failed its checksum (stored ")
    assert events[0].endswith(": quarantined; waiting for annotate to write it again")
    assert rel.replace("/", "__") in local_store.list_quarantine()

    # without --follow the stream ends instead, naming the file
    stream, _ = make_stream(local_store, run)
    stream.on_event = events.append
    stream.next_batch(1, 0)
    stream.cache._shards.clear()
    flip_bytes(local_store.local_path(rel), 100, count=8)
    end = stream.next_batch(2, 0)
    assert isinstance(end, StreamEnd)
    assert end.reason == f"{local_store.path(rel)} is missing (quarantined): annotate it again"


# ------------------------------------------------------------------ a rollout shard damaged mid-shard
@pytest.mark.parametrize("who", ["trainer", "rollout worker"])
def test_damaged_rollout_shard_of_a_partly_trained_shard_loses_only_its_untrained_rows(local_store, who):
    """The trainer took rows 0-3 of a shard, then its rollout shard is damaged (found by the trainer itself, or
    by its rollout worker on restart, which quarantines it): rows 4-7 are lost, counted, and the stream goes on."""

    run = local_store.manifest.ensure(
        student="s", tokenizer_fingerprint="fp", vocab_size=32, top_k=4, teachers={"teacher": "t"}
    )
    first, second = make_shard_id(0, "w00", 0), make_shard_id(0, "w00", 1)
    for seed, shard_id in enumerate((first, second)):
        write_synthetic_shard(local_store, run, shard_id, num_rows=8, vocab_size=32, top_k=4, seed=seed)
    rel = layout.rollout_path(first)
    stream, _ = make_stream(local_store, run)
    events = []
    stream.on_event = events.append
    assert stream.next_batch(1, 0).sample_ids == [f"{first}-{i}" for i in range(4)]
    stream.cache._shards.clear()  # the shard left the cache (or the trainer resumed here) ...
    flip_bytes(local_store.local_path(rel), local_store.local_path(rel).stat().st_size // 2, count=8)  # ... damaged
    if who == "rollout worker":
        local_store.quarantine(rel, "shard … failed its checksum")
    batch = stream.next_batch(2, 0)
    assert batch.sample_ids == [f"{second}-{i}" for i in range(4)]  # the run goes on with the next shard
    cursor = stream.cursor
    assert (cursor.lost_samples, cursor.lost_shards, cursor.trained_samples) == (4, 1, 8)
    assert first in cursor.finished and cursor.current == second
    skipped = [json.loads(line) for line in local_store.read_bytes(f"train/skipped/{first}.jsonl").splitlines()]
    assert skipped == [{"sample_id": f"{first}-{i}", "reason": "lost"} for i in range(4, 8)]  # 0-3 trained: not lost
    assert not local_store.exists(rel)
    if who == "trainer":
        assert events == [f"{quarantine_reason(local_store, rel).split(': ', 1)[1]}: quarantined"]
        assert events[0].startswith(f"shard {local_store.local_path(rel)} failed its checksum (stored ")
    else:
        assert events == [
            f"{local_store.path(rel)} was quarantined by its rollout worker: 4 rows not trained yet are lost"
        ]


def test_partly_trained_damaged_shard_with_routing_keeps_every_row_in_the_ledger_once(local_store):
    """Rows 0-4 handed out (row 2 unrouted), then the rollout shard is damaged: the unrouted row before the
    cursor is recorded as unrouted, the routed rows after it as lost, and nothing of it twice."""
    from opd_cache.train.shard_data import ShardCache
    from opd_cache.train.stream import ShardStream, StreamEnd

    run = local_store.manifest.ensure(
        student="s",
        tokenizer_fingerprint="fp",
        vocab_size=32,
        top_k=4,
        teachers={"math": "m", "code": "c"},
        routing={"key": "data_source", "map": {"gsm8k": "math", "mbpp": "code"}, "default": None},
    )
    sources = ["gsm8k", "mbpp", "other", "mbpp", "gsm8k", "other", "gsm8k", "mbpp"]
    shard_id = make_shard_id(0, "w00", 0)
    write_synthetic_shard(
        local_store,
        run,
        shard_id,
        num_rows=8,
        vocab_size=32,
        top_k=4,
        seed=3,
        teachers={"math": None, "code": None},
        routing={"gsm8k": "math", "mbpp": "code"},
        data_sources=sources,
    )
    stream = ShardStream(
        local_store,
        run,
        ShardCache(local_store, run, ["code", "math"]),
        max_staleness=10,
        batch_samples=4,
        batch_tokens=None,
    )
    stream.on_event = lambda message: None
    first = stream.next_batch(1, 0)
    assert first.sample_ids == [f"{shard_id}-{i}" for i in (0, 1, 3, 4)] and stream.cursor.current_rows == 5
    stream.cache._shards.clear()
    rel = layout.rollout_path(shard_id)
    flip_bytes(local_store.local_path(rel), local_store.local_path(rel).stat().st_size // 2, count=8)
    assert isinstance(stream.next_batch(2, 0), StreamEnd)  # nothing else to train: the stream ends, no error
    skipped = dict(
        (r["sample_id"], r["reason"])
        for r in map(json.loads, local_store.read_bytes(f"train/skipped/{shard_id}.jsonl").splitlines())
    )
    assert skipped == {f"{shard_id}-2": "unrouted", f"{shard_id}-6": "lost", f"{shard_id}-7": "lost"}
    assert set(skipped).isdisjoint(first.sample_ids)  # every row of the shard recorded once, row 5 unknowable
    assert (stream.cursor.lost_samples, stream.cursor.unrouted_samples, stream.cursor.lost_shards) == (2, 1, 1)
    assert rel.replace("/", "__") in local_store.list_quarantine()


def test_resumed_trainer_loses_the_untrained_rows_of_a_damaged_shard_and_goes_on(
    tmp_path, student_path, tokenizer, teacher_path
):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher_path)
    run_train(config(store, max_steps=1, global_batch_samples=4, save_every=1, lr=3e-3), store)  # rows 0-3 of shard 0
    shard_id = make_shard_id(0, "w00", 0)
    rel = layout.rollout_path(shard_id)
    damage(store.local_path(rel), "middle", seed=30)
    result = run_train(config(store, max_steps=6, global_batch_samples=4, save_every=1, lr=3e-3), store)
    assert result.trained_samples == 20  # 4 before the damage, then the two intact shards
    progress = store.read_progress()
    assert progress["lost_samples"] == 4 and progress["lost_shards"] == 1
    assert json.loads(store.read_bytes("metrics/train-0.jsonl").decode().splitlines()[-1])["lost_total"] == 4
    trained, skipped = read_ledger(store)
    assert trained[1] == [f"{shard_id}-{i}" for i in range(4)]
    assert sorted(s for s, why in skipped.items() if why == "lost") == [f"{shard_id}-{i}" for i in range(4, 8)]
    ledger = verify_ledger(store)
    assert ledger["duplicates"] == [] and ledger["trained_and_skipped"] == [] and ledger["trained"] == 20
    assert quarantine_reason(store, rel).startswith(f"{rel}: shard {store.local_path(rel)} failed its checksum (")


# ------------------------------------------------------------------ a rollout worker's own newest shard
def test_rollout_worker_quarantines_its_damaged_newest_shard_and_samples_its_prompts_again(
    tiny_model_factory, tmp_path, capsys
):
    from opd_cache.config import Config, RolloutConfig, SamplingConfig
    from opd_cache.observe.metrics import read_metrics
    from opd_cache.rollout import run_rollout
    from opd_cache.rollout.resume import resume_point
    from tests.test_rollout import questions, write_prompts

    store = Store(tmp_path / "store")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(8))
    cfg = dict(
        student=str(tiny_model_factory("student")),
        prompts=str(prompts),
        n=2,
        flush_rows=4,
        sampling=SamplingConfig(max_new_tokens=4),
    )
    run_rollout(
        Config(rollout=RolloutConfig(**cfg, max_samples=8)), store
    )  # shards 0 and 1: 2 prompts each, cursor 2 and 4
    run = store.manifest.require()

    def damage_shard(seq: int) -> tuple[str, Path, str]:
        rel = layout.rollout_path(make_shard_id(0, "w00", seq))
        path = store.local_path(rel)
        stored = path.read_bytes()[-integrity.TRAILER_SIZE : -16][::-1].hex()
        flip_bytes(path, path.stat().st_size // 2, count=8)
        computed = integrity.checksum(path.read_bytes()[: -integrity.TRAILER_SIZE])
        return rel, path, f"shard {path} failed its checksum (stored {stored}, computed {computed}): quarantined"

    rel = layout.rollout_path(make_shard_id(0, "w00", 1))
    lost_prompts = read_shard(store, rel, kind=ROLLOUT, run=run)[0]["prompt_index"].to_pylist()
    rel, path, message = damage_shard(1)
    capsys.readouterr()
    result = run_rollout(
        Config(rollout=RolloutConfig(**cfg, max_samples=12)), store
    )  # restarts: resumes from shard 0, goes on
    assert message in capsys.readouterr().err.splitlines()
    assert result.shards == [make_shard_id(0, "w00", 2), make_shard_id(0, "w00", 3)]  # seq 1 is never used again
    again = read_shard(store, layout.rollout_path(result.shards[0]), kind=ROLLOUT, run=run)[0]
    assert again["prompt_index"].to_pylist() == lost_prompts  # the damaged shard's prompts, sampled again
    assert result.cursor == 6 and result.total_samples == 12
    assert not store.exists(rel)
    assert quarantine_reason(store, rel) == f"{rel}: {message.removesuffix(': quarantined')}"
    events = [r for r in read_metrics(store, "rollout")["rollout-w00"] if r.get("event") == "shard_quarantined"]
    assert [(e["shard"], e["resumed_from"], e["cursor"]) for e in events] == [
        (make_shard_id(0, "w00", 1), make_shard_id(0, "w00", 0), 2)
    ]

    # a worker restarted before it wrote anything new still skips the quarantined seq
    rel, path, message = damage_shard(3)
    point = resume_point(store, "w00", run, 0, 8)
    assert message in capsys.readouterr().err.splitlines()
    assert (point.cursor, point.samples, point.last_shard) == (4, 8, make_shard_id(0, "w00", 2))
    assert point.next_seq == 4 and point.quarantined == [make_shard_id(0, "w00", 3)]
    assert resume_point(store, "w00", run, 0, 8).next_seq == 4


# ------------------------------------------------------------------ progress.json
def test_torn_progress_read_is_retried_and_a_damaged_one_counts_as_not_yet_written(local_store, monkeypatch, capsys):
    """On S3 a read racing the trainer's overwrite gets a torn file (the new content padded to the old size with
    uninitialised bytes: "Extra data"); retried, it reads whole. Damaged for good, it reads as not yet written."""
    local_store.write_progress({"consumed_samples": 8})
    good = local_store.read_bytes("train/progress.json")
    torn = good + b"\x86\x00" * 20
    reads = iter([torn, good])
    real = local_store.read_bytes
    monkeypatch.setattr(
        local_store, "read_bytes", lambda rel: next(reads) if rel == "train/progress.json" else real(rel)
    )
    assert local_store.read_progress() == {"consumed_samples": 8}
    assert capsys.readouterr().err == ""
    monkeypatch.undo()

    local_store.local_path("train/progress.json").write_bytes(torn)
    assert local_store.read_progress() == {}
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {local_store.path('train/progress.json')} is not valid JSON: ")
    assert err.strip().endswith("treating it as not yet written (the trainer rewrites it every step)")
    local_store.write_progress({"consumed_samples": 16})  # the trainer's next step
    assert local_store.read_progress() == {"consumed_samples": 16}
