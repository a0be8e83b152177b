"""The run manifest (opd_cache/storage/manifest.py): run.json as a typed record, teachers in create-if-absent records.

Stores written before the teacher records (teachers, top_k and routing inside run.json) must read the same, and
run.json must stay byte-compatible: the keys of every earlier version, unknown keys kept.
"""

from __future__ import annotations

import json
import re
import threading

import pytest

from opd_cache.storage.manifest import ManifestError, RunManifest, TeacherRecord
from opd_cache.storage.store import Store, StoreError

ROUTING = {"key": "data_source", "map": {"math": "tA", "code": "tB"}, "default": "tB"}


def teacher(name="teacher", model="/models/teacher", top_k=8, **kwargs) -> TeacherRecord:
    return TeacherRecord(name=name, model=model, top_k=top_k, tokenizer_fingerprint="fp", vocab_size=100, **kwargs)


@pytest.fixture(params=["local", "s3"])
def store(request, local_store):
    store = local_store if request.param == "local" else request.getfixturevalue("s3_store")
    store.manifest.ensure(student="/models/student", tokenizer_fingerprint="fp", vocab_size=100)
    return store


def written_by_an_earlier_version(store: Store, **fields) -> bytes:
    """run.json as opd_cache wrote it before the teacher records (json.dumps, sorted keys, indent 2)."""
    run = {
        "created": "2026-01-02T03:04:05Z",
        "run_id": "0123456789ab",
        "schema_version": 1,
        "student": "/models/student",
        "tokenizer_fingerprint": "fp",
        "vocab_size": 100,
        **fields,
    }
    data = (json.dumps(run, indent=2, sort_keys=True) + "\n").encode()
    store.write_bytes("run.json", data)
    return data


def test_every_key_of_an_earlier_run_json_is_a_typed_field_and_is_written_back_byte_for_byte(local_store):
    data = written_by_an_earlier_version(
        local_store,
        teachers={"tA": "/models/a", "tB": "/models/b"},
        top_k=8,
        routing=ROUTING,
        student_topk=3,
        max_staleness=2,
        replay={"sources": ["runs/a"], "epochs": 1, "source_run_ids": ["r1"]},
        from_a_newer_version={"kept": True},
    )
    run = local_store.manifest.require()
    assert run.run_id == "0123456789ab" and run.student_topk == 3 and run.top_k == 8 and run.max_staleness == 2
    assert run.teachers == {"tA": "/models/a", "tB": "/models/b"}
    assert run.routing.map == {"math": "tA", "code": "tB"} and run.routing.default == "tB"
    assert run.replay["source_run_ids"] == ["r1"]
    assert run.required_teachers() == ["tA", "tB"]
    assert run.to_json() == data  # same keys, same bytes: the unknown key of a newer version is kept
    # a rollout worker that fills in a missing field rewrites run.json without losing anything
    local_store.write_bytes("run.json", data.replace(b'  "student_topk": 3,\n', b""))
    local_store.manifest.ensure(student_topk=3)
    assert local_store.read_bytes("run.json") == data


def test_a_run_json_of_the_wrong_types_is_refused_naming_the_key(local_store):
    written_by_an_earlier_version(local_store, top_k="eight")
    with pytest.raises(StoreError, match=r"run\.json: top_k: Input should be a valid integer"):
        local_store.manifest.read()
    local_store.write_bytes("run.json", b"[1, 2]\n")
    with pytest.raises(ManifestError, match=r"run\.json holds a list, not an object"):
        local_store.manifest.read()


def test_a_teacher_records_itself_once_and_run_json_is_never_rewritten(store):
    before = store.read_bytes("run.json")
    run = store.manifest.register_teacher(teacher(codec="packed"))
    assert run.teachers == {"teacher": "/models/teacher"} and run.top_k == 8 and run.required_teachers() == ["teacher"]
    record = json.loads(store.read_bytes("run/teachers/teacher.json"))
    assert record == {
        "codec": "packed",
        "model": "/models/teacher",
        "name": "teacher",
        "tokenizer_fingerprint": "fp",
        "top_k": 8,
        "vocab_size": 100,
    }
    # its other workers (and restarts) find the record and agree; what the first one wrote stays
    assert store.manifest.register_teacher(teacher(codec="none")).teachers == {"teacher": "/models/teacher"}
    assert json.loads(store.read_bytes("run/teachers/teacher.json"))["codec"] == "packed"
    assert store.read_bytes("run.json") == before
    assert store.manifest.require()["teachers"] == {"teacher": "/models/teacher"}  # run.json's key names still read


def test_a_contradicting_registration_fails_naming_the_record_and_changes_nothing(store):
    store.manifest.register_teacher(teacher("tA", routing=ROUTING))
    record = store.path("run/teachers/tA.json")
    with pytest.raises(
        StoreError,
        match=re.escape(f"{record}: teacher 'tA' is '/models/teacher' in this store but '/models/other' was given; "),
    ):
        store.manifest.register_teacher(teacher("tA", model="/models/other", routing=ROUTING))
    with pytest.raises(StoreError, match=re.escape(f"{record}: top_k is 8 in this store but 16 was given; use a new")):
        store.manifest.register_teacher(teacher("tB", top_k=16, routing=ROUTING))  # top_k is one per run
    with pytest.raises(
        StoreError, match=re.escape(f"{record}: routing is {{'key': 'data_source',") + r".* but .*None\}"
    ):
        store.manifest.register_teacher(teacher("tB", routing={**ROUTING, "default": None}))
    with pytest.raises(StoreError, match=r"run\.json: tokenizer_fingerprint is 'fp' in this store but 'other'"):
        store.manifest.register_teacher(
            teacher("tB", routing=ROUTING).model_copy(update={"tokenizer_fingerprint": "other"})
        )
    assert [r.name for r in store.manifest.teachers()] == ["tA"]
    run = store.manifest.register_teacher(teacher("tB", model="/models/b", routing=ROUTING))
    assert run.teachers == {"tA": "/models/teacher", "tB": "/models/b"} and run.required_teachers() == ["tA", "tB"]


def test_a_store_with_its_teachers_in_run_json_reads_and_registers_as_before(local_store):
    before = written_by_an_earlier_version(local_store, teachers={"teacher": "/models/teacher"}, top_k=8)
    run = local_store.manifest.require()
    assert run.teachers == {"teacher": "/models/teacher"} and run.top_k == 8
    where = local_store.path("run.json")
    with pytest.raises(StoreError, match=re.escape(f"{where}: top_k is 8 in this store but 4 was given")):
        local_store.manifest.register_teacher(teacher(top_k=4))
    with pytest.raises(StoreError, match=re.escape(f"{where}: teacher 'teacher' is '/models/teacher' in this")):
        local_store.manifest.register_teacher(teacher(model="/models/other"))
    # the same teacher again, and a second one: recorded beside run.json, which stays as it was
    local_store.manifest.register_teacher(teacher())
    run = local_store.manifest.register_teacher(teacher("second", model="/models/second"))
    assert run.teachers == {"teacher": "/models/teacher", "second": "/models/second"}
    assert local_store.read_bytes("run.json") == before


def test_concurrent_workers_of_one_teacher_all_register(store):
    errors, runs = [], []
    start = threading.Barrier(6)

    def worker():
        start.wait()
        try:
            runs.append(store.manifest.register_teacher(teacher()))
        except Exception as e:  # noqa: BLE001 - the test reports every failure
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(runs) == 6
    assert all(run.teachers == {"teacher": "/models/teacher"} for run in runs)
    assert [r.name for r in store.manifest.teachers()] == ["teacher"]


def test_two_teachers_registering_contradicting_top_k_at_once_never_both_succeed(local_store):
    for attempt in range(5):
        store = Store(local_store.path(f"race-{attempt}"))
        store.manifest.ensure(student="s", tokenizer_fingerprint="fp")
        outcome = {}
        start = threading.Barrier(2)

        def register(name, top_k):
            start.wait()
            try:
                store.manifest.register_teacher(TeacherRecord(name=name, model=f"/models/{name}", top_k=top_k))
                outcome[name] = "ok"
            except StoreError as e:
                assert "top_k is" in str(e) and "in this store but" in str(e)
                outcome[name] = "refused"

        threads = [threading.Thread(target=register, args=args) for args in (("tA", 4), ("tB", 8))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert list(outcome.values()).count("ok") <= 1, outcome
        # a refused registration leaves no record behind; an accepted one is the run's
        assert sorted(r.name for r in store.manifest.teachers()) == sorted(n for n, o in outcome.items() if o == "ok")


def test_a_tampered_teacher_record_is_refused(local_store):
    local_store.manifest.ensure(student="s", tokenizer_fingerprint="fp")
    local_store.write_json("run/teachers/tA.json", {"name": "tB", "model": "m", "top_k": 4})
    with pytest.raises(StoreError, match=r"tA\.json names teacher 'tB', not its file name"):
        local_store.manifest.read()
    local_store.write_json("run/teachers/tA.json", {"name": "../x", "model": "m", "top_k": 4})
    with pytest.raises(StoreError, match=re.escape("invalid teacher name '../x'")):
        local_store.manifest.read()
    with pytest.raises(ValueError, match=re.escape("invalid teacher name '../x'")):
        RunManifest.model_validate({"teachers": {"../x": "m"}})
