"""The run manifest: what every stage must agree on, as typed records, read and written by `ManifestFiles`
(a store's `store.manifest`).

Two kinds of object make it up (docs/design.md §2):

    <root>/run.json                  created once by the first rollout worker (or `opd replay`): the run id, the
                                     student and its tokenizer; a later rollout worker fills in what is missing
    <root>/run/teachers/<name>.json  one per teacher, created (if absent) by its first annotate worker: the model,
                                     top_k and routing it annotates with; never rewritten

so annotate workers never read-modify-write a shared file: each teacher's record is one create-if-absent object,
and `store.manifest.read()` combines run.json with them into one `RunManifest`. Stores written before the teacher
records held `teachers`, `top_k` and `routing` in run.json itself; they read the same.

The JSON keys are those of run.json since its first version, so existing stores, `opd migrate`, `opd verify` and
`opd inspect` read them unchanged; keys this version does not know (a newer opd_cache wrote them) are kept.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from opd_cache.storage.filestore import FileStore
from opd_cache.storage.layout import RUN_JSON, SCHEMA_VERSION, TEACHERS_DIR, StoreError, teacher_path, validate_name


def student_id(student: str) -> str:
    """How run.json names the student: a local folder as an absolute path, so that a restart from another
    directory agrees with it; a hub id as it is. (Here, not in rollout/, so that `opd run`'s launcher can
    check run.json without importing torch and transformers: ~3 CPU-s and ~2.4 s of start-up, issue #25.)"""
    return os.path.abspath(student) if os.path.exists(student) else student


class ManifestError(StoreError):
    """run.json or a teacher record that does not parse (the message names the file and the key)."""


class Routing(BaseModel):
    """Multi-teacher routing: the rows whose `key` column value is in `map` go to that teacher, others to `default`."""

    model_config = ConfigDict(extra="allow", frozen=True)

    key: str
    map: dict[str, str]
    default: str | None = None

    def teachers(self) -> list[str]:
        """The teachers this routing sends rows to: the values of its map plus its default."""
        return sorted({*self.map.values(), *([self.default] if self.default else [])})


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    def to_json(self) -> bytes:
        """The record as stored: keys sorted, fields that were never set (None) left out."""
        data = {key: value for key, value in self.model_dump(mode="json").items() if value is not None}
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: Any, where: str):
        if not isinstance(data, dict):
            raise ManifestError(f"{where} holds a {type(data).__name__}, not an object")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in item['loc']) or '(record)'}: {item['msg']}" for item in e.errors()
            )
            raise ManifestError(f"{where}: {problems}") from None


class TeacherRecord(_Record):
    """`run/teachers/<name>.json`: one teacher of the run, written once by its first annotate worker."""

    name: str
    model: str  # the checkpoint folder (absolute) or hub id
    top_k: int
    routing: Routing | None = None
    tokenizer_fingerprint: str | None = None
    vocab_size: int | None = None
    codec: str | None = None  # the annotation codec of the worker that registered it (each part names its own)
    registered: str | None = None
    # a teacher of another tokenizer (docs/cross-tokenizer.md): tokenizer_fingerprint and vocab_size stay the
    # student's (the stored ids are student ids); these name the teacher's tokenizer, the map and the top-k rule
    teacher_tokenizer_fingerprint: str | None = None
    vocab_map_fingerprint: str | None = None
    vocab_map_size: int | None = None
    cross_tokenizer_topk: str | None = None
    # a teacher that reads multi-turn rows in its own chat template (annotate.chat_template): its fingerprint
    chat_template_fingerprint: str | None = None

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return validate_name("teacher name", value)

    # what a second registration of the same teacher must repeat (the others describe the first one)
    CHECKED: ClassVar[tuple[str, ...]] = (
        "model",
        "top_k",
        "routing",
        "tokenizer_fingerprint",
        "vocab_size",
        "vocab_map_fingerprint",
        "cross_tokenizer_topk",
        "chat_template_fingerprint",
    )


class RunManifest(_Record):
    """The run as every stage sees it: run.json plus the teacher records (see the module docstring)."""

    run_id: str | None = None
    created: str | None = None
    schema_version: int | None = None
    # written by `opd rollout`
    student: str | None = None
    tokenizer_fingerprint: str | None = None
    vocab_size: int | None = None
    student_topk: int | None = None
    # the teachers: `run/teachers/*.json` (run.json itself in stores written before them, and in replay stores)
    teachers: dict[str, str] | None = None  # name -> model
    top_k: int | None = None
    routing: Routing | None = None
    # written by `opd replay`: what it replays (ReplaySpec) and the run ids of its sources
    replay: dict[str, Any] | None = None
    # written by trainers before the top-level max_staleness (no longer read: the configuration holds it)
    max_staleness: int | None = None

    @field_validator("teachers")
    @classmethod
    def _safe_teacher_names(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for name in value or {}:
            validate_name("teacher name", name)
        return value

    @classmethod
    def new(cls, schema_version: int, **fields: Any) -> RunManifest:
        return cls(
            run_id=uuid.uuid4().hex[:12],
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            schema_version=schema_version,
            **fields,
        )

    def with_teachers(self, records: list[TeacherRecord]) -> RunManifest:
        """run.json combined with the teacher records: their names and models, and the top_k / routing they
        share (run.json's own values first: registration refuses a record that contradicts them)."""
        if not records:
            return self
        teachers = {**(self.teachers or {}), **{r.name: r.model for r in records}}
        first = records[0]
        return self.model_copy(
            update={
                "teachers": teachers,
                "top_k": self.top_k if self.top_k is not None else first.top_k,
                "routing": self.routing if self.routing is not None else first.routing,
            }
        )

    def required_teachers(self) -> list[str]:
        """The teachers whose part must exist before a shard can train: those of the routing, else every
        teacher of the run (by convention, one)."""
        if self.routing:
            return self.routing.teachers()
        return sorted(self.teachers or {})

    # --- read-only access under run.json's key names (check_run; scripts and tests written against the dict)
    def _value(self, key: str) -> Any:
        value = getattr(self, key, None) if key in type(self).model_fields else (self.model_extra or {}).get(key)
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else value

    def keys(self) -> list[str]:
        return list(json.loads(self.to_json()))

    def items(self) -> list[tuple[str, Any]]:
        return list(json.loads(self.to_json()).items())

    def __getitem__(self, key: str) -> Any:
        value = self._value(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._value(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self._value(key)
        return default if value is None else value


def as_manifest(run: RunManifest | dict) -> RunManifest:
    """A manifest given as run.json's dict (scripts, tests) as the typed record."""
    return run if isinstance(run, RunManifest) else RunManifest.model_validate(run)


def contradiction(where: str, key: str, recorded: Any, given: Any) -> str:
    """The one message for a value that differs from the store's (tests assert its text)."""
    return (
        f"{where}: {key} is {recorded!r} in this store but {given!r} was given; "
        f"use a new store for a different {key}, or drop the option to use the store's value"
    )


def teacher_contradiction(where: str, name: str, recorded: str, given: str) -> str:
    return (
        f"{where}: teacher {name!r} is {recorded!r} in this store but {given!r} was given; "
        f"use another --teacher-name for a different model"
    )


def plain(value: Any) -> Any:
    """A field value as JSON would hold it (records compare by content, whichever type they were given as)."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


# ---------------------------------------------------------------- reading and writing
class ManifestFiles:
    """run.json and the teacher records of one store (`store.manifest`): read, create, check, register."""

    def __init__(self, files: FileStore):
        self.files = files

    def exists(self) -> bool:
        """run.json exists: the first rollout worker (or `opd replay`) created the run."""
        return self.files.exists(RUN_JSON)

    def read(self) -> RunManifest | None:
        """run.json combined with the teacher records, or None before run.json exists."""
        data = self.files.read_json(RUN_JSON)
        if data is None:
            return None
        return RunManifest.from_json(data, self.files.path(RUN_JSON)).with_teachers(self.teachers())

    def require(self) -> RunManifest:
        if self.files.is_local and not Path(self.files.root).is_dir():
            raise StoreError(self.no_run_reason())  # before reading: "README.md/run.json: Not a directory"
        run = self.read()
        if run is None:
            raise StoreError(self.no_run_reason())
        return run

    def no_run_reason(self) -> str:
        """Why this store has no run: a mistyped path (no such folder) needs other advice than a store whose
        first rollout has not started, or a folder that is no store at all."""
        if not self.files.is_local:  # an object store has no folders: a missing prefix looks like an empty one
            return (
                f"{self.files.path(RUN_JSON)} does not exist: check the URI, or run `opd rollout` on this store first"
            )
        root = Path(self.files.root)
        if not root.exists():
            return f"store {root} does not exist (no such folder): check the path; `opd rollout` creates a new store"
        if not root.is_dir():
            return f"store {root} is a file, not a store folder"
        return f"{root} holds no run ({RUN_JSON} is missing): not a store, or one whose `opd rollout` has not started"

    def wait(self, poll_seconds: float, say=None) -> RunManifest:
        """run.json once the first rollout worker has created it; `say` (e.g. print) hears once that this waits.

        `opd run` starts every stage at once: annotate and train load their models, then wait here."""
        bell = self.files.bell(RUN_JSON)  # a local store: woken when it is written (storage/bells.py)
        while (run := self.read()) is None:
            if say is not None:
                say(f"waiting for {self.files.path(RUN_JSON)} (the first rollout worker creates it)")
                say = None
            bell.wait(min(poll_seconds, 1.0))  # at most a second late: the first step waits on it
        return run

    def ensure(self, **fields: Any) -> RunManifest:
        """Create run.json on first touch, else check `fields` against it and fill the missing ones.

        Only the writers of run.json's own fields call this (rollout workers, `opd replay`); teachers record
        themselves with `register_teacher`, so annotate workers never rewrite run.json.
        """
        files = self.files
        fields = {k: v for k, v in fields.items() if v is not None}
        run = self.read()
        if run is None:
            new = RunManifest.new(SCHEMA_VERSION, **fields)
            files.create_if_absent(RUN_JSON, new.to_json())
            run = self.read()
        self.check(run, **fields)
        missing = {key: plain(value) for key, value in fields.items() if run.get(key) is None}
        if missing:
            stored = files.read_json(RUN_JSON)  # as stored: without the teacher records, with unknown keys
            files.write_bytes(RUN_JSON, RunManifest.from_json({**stored, **missing}, files.path(RUN_JSON)).to_json())
            run = self.read()
        return run

    def check(self, run: RunManifest, **fields: Any) -> None:
        """A field recorded in `run` with a different value is a contradiction (the store belongs to another
        run / tokenizer / top-k): raise, naming both. Fields that are None or not recorded yet pass."""
        for key, value in fields.items():
            recorded = run.get(key)
            if value is not None and recorded is not None and recorded != plain(value):
                raise StoreError(contradiction(self.files.path(RUN_JSON), key, recorded, plain(value)))

    def teachers(self) -> list[TeacherRecord]:
        """The teachers registered in `run/teachers/` (one LIST, one GET each), by name."""
        files, records = self.files, []
        for info in sorted(files.list_files(TEACHERS_DIR), key=lambda i: i.base_name):
            rel = files.relative_path(info.path)
            data = files.read_json(rel) if info.base_name.endswith(".json") else None
            if data is None:  # not a record, or withdrawn since the listing
                continue
            record = TeacherRecord.from_json(data, files.path(rel))
            if teacher_path(record.name) != rel:
                raise ManifestError(f"{files.path(rel)} names teacher {record.name!r}, not its file name")
            records.append(record)
        return records

    def check_teacher(self, record: TeacherRecord) -> RunManifest:
        """Refuse a teacher that contradicts the run: run.json (tokenizer; in older stores also top_k, routing and
        the teachers), an earlier registration of the same name, or another teacher's top_k or routing.
        Returns the manifest as it is (with the registered teachers)."""
        files = self.files
        data = files.read_json(RUN_JSON)
        if data is None:
            self.require()  # raises, naming the missing run.json
        stored = RunManifest.from_json(data, files.path(RUN_JSON))
        self.check(
            stored,
            top_k=record.top_k,
            routing=record.routing,
            tokenizer_fingerprint=record.tokenizer_fingerprint,
            vocab_size=record.vocab_size,
        )
        legacy = (stored.teachers or {}).get(record.name)
        if legacy is not None and legacy != record.model:
            raise StoreError(teacher_contradiction(files.path(RUN_JSON), record.name, legacy, record.model))
        records = self.teachers()
        for other in records:
            where = files.path(teacher_path(other.name))
            if other.name == record.name and other.model != record.model:
                raise StoreError(teacher_contradiction(where, record.name, other.model, record.model))
            for key in TeacherRecord.CHECKED[1:] if other.name == record.name else ("top_k", "routing"):
                recorded, given = plain(getattr(other, key)), plain(getattr(record, key))
                if recorded is not None and given is not None and recorded != given:
                    raise StoreError(contradiction(where, key, recorded, given))
        return stored.with_teachers(records)

    def register_teacher(self, record: TeacherRecord) -> RunManifest:
        """Record a teacher in its own create-if-absent object; returns the manifest with it.

        Its first worker writes the record, its other workers and restarts find it and must agree. Checked before
        (a contradiction leaves the store untouched) and after the write: two teachers registering contradicting
        top_k or routing at once both wrote their record, and a writer that finds the other's withdraws its own.
        """
        self.check_teacher(record)
        rel = teacher_path(record.name)
        created = self.files.create_if_absent(rel, record.to_json())
        try:
            return self.check_teacher(record)
        except StoreError:
            if created:
                self.files.delete(rel)
            raise
