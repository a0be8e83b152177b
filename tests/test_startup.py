"""Start-up of `opd run` (issue #14, item 5): every stage starts at once, and annotate and train load their
models before run.json exists, then wait for it and check it as when started on an existing store.

The supervisor is checked with stand-in stages (which of them saw run.json when they started); the annotator
and the trainer with their real models on a store that is empty when they start: they load, wait, and then
either proceed (run.json and shards appear) or refuse a run.json that is not theirs, writing nothing.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from opd_cache.annotate import Annotator
from opd_cache.config import AnnotateConfig, Config
from opd_cache.storage.store import Store, make_shard_id
from opd_cache.tokenizer import tokenizer_fingerprint
from tests.conftest import write_random_rollout_shard
from tests.test_run import tiny_config
from tests.test_trainer import config as train_config
from tests.test_trainer import make_store, teacher  # noqa: F401 (teacher: a fixture)


class InThread:
    """Run `fn` in a thread; `.join()` returns its result or raises its exception."""

    def __init__(self, fn):
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except Exception as e:
            self.error = e

    def join(self, timeout: float = 120):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        if self.error is not None:
            raise self.error
        return self.result


def record_calls(monkeypatch, module, name: str, store: Store) -> threading.Event:
    """Wrap `module.name`; the event is set once it first returned, `.saw_run` lists whether run.json existed
    at each call."""
    real = getattr(module, name)
    done = threading.Event()
    done.saw_run = []

    def wrapper(*args, **kwargs):
        done.saw_run.append(store.manifest.exists())
        out = real(*args, **kwargs)
        done.set()
        return out

    monkeypatch.setattr(module, name, wrapper)
    return done


def wait_until_sleeping_on_run_json(thread: InThread, loaded: threading.Event) -> None:
    assert loaded.wait(120), "the model never loaded"
    time.sleep(0.5)
    assert thread.thread.is_alive(), "returned without run.json"


# ---------------------------------------------------------------- the supervisor
def test_supervisor_starts_every_stage_before_run_json_exists(tmp_path, monkeypatch):
    from opd_cache.config import load_config
    from opd_cache.launch import run as run_module
    from opd_cache.launch.run import StageProcess

    store_dir = tmp_path / "store"
    run_json = store_dir / "run.json"
    seen = tmp_path / "seen"
    seen.mkdir()

    def stage(name: str, *then: str) -> StageProcess:
        # each stand-in writes whether run.json existed when it started, then runs the lines `then`
        code = [
            "import os, pathlib, time",
            f"pathlib.Path({str(seen / name)!r}).write_text(str(os.path.exists({str(run_json)!r})))",
            *then,
        ]
        return StageProcess(name, [sys.executable, "-c", "\n".join(code)], tmp_path / f"{name}.log")

    wait_for_run = f"while not os.path.exists({str(run_json)!r}): time.sleep(0.1)"
    stages = [
        stage("rollout-w00", "time.sleep(2)", f"pathlib.Path({str(run_json)!r}).write_text('{{}}')", "time.sleep(2)"),
        stage("annotate-teacher-0", wait_for_run),
        stage("train", wait_for_run, "time.sleep(1)"),
        stage("eval", wait_for_run),
    ]
    cfg = load_config(tiny_config(tmp_path), overrides={"run.max_restarts": 0, "run.drain_seconds": 30})
    monkeypatch.setattr(run_module, "stage_commands", lambda cfg, config_path, logs: stages)
    assert run_module.supervise(cfg, tmp_path / "config.yaml", tmp_path / "logs", quiet=True) == 0
    saw_run = {p.name: p.read_text() for p in seen.iterdir()}
    # annotate, train and the evaluator started while rollout was still loading
    assert saw_run == {"rollout-w00": "False", "annotate-teacher-0": "False", "train": "False", "eval": "False"}


# ---------------------------------------------------------------- the annotator
def annotate_config(teacher_path, **kwargs) -> Config:
    """A configuration whose annotate section follows the store with `teacher_path` (`kwargs`: more annotate keys)."""
    keys = {"top_k": 4, "follow": True, "poll_seconds": 0.1, **kwargs}
    return Config(annotate=AnnotateConfig(teacher=str(teacher_path), **keys))


def test_annotator_on_an_empty_store_loads_its_teacher_then_waits_for_run_json_and_annotates(
    local_store, tokenizer, tiny_model_factory, monkeypatch, capsys
):
    from opd_cache.annotate import worker

    store, student = local_store, tiny_model_factory("student", seed=0)
    loaded = record_calls(monkeypatch, worker, "make_scorer", store)
    starting = InThread(
        lambda: Annotator(annotate_config(tiny_model_factory("teacher", seed=1)), store, progress=False)
    )
    wait_until_sleeping_on_run_json(starting, loaded)
    assert loaded.saw_run[0] is False  # the teacher loaded before run.json existed
    assert not store.exists("run/teachers/teacher.json")

    run = store.manifest.ensure(
        student=str(student), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=99
    )
    annotator = starting.join()
    assert f"waiting for {store.path('run.json')} (the first rollout worker creates it)" in capsys.readouterr().err
    assert annotator.run_info.run_id == run.run_id and store.manifest.require().required_teachers() == ["teacher"]
    shard_id = make_shard_id(0, "w00", 0)
    write_random_rollout_shard(
        store, shard_id=shard_id, vocab_size=99, seed=0, run=store.manifest.require(), num_rows=4
    )
    (info,) = store.shards.rollouts()
    assert annotator.annotate_shard(info)
    assert store.shards.annotated_parts() == {shard_id: {"teacher"}}


def test_annotator_waiting_on_an_empty_store_refuses_a_run_json_with_another_tokenizer(local_store, tiny_model_factory):
    store = local_store
    starting = InThread(
        lambda: Annotator(annotate_config(tiny_model_factory("teacher", seed=1)), store, progress=False)
    )
    time.sleep(1.0)
    store.manifest.ensure(student=str(tiny_model_factory("student", seed=0)), tokenizer_fingerprint="0123456789abcdef")
    with pytest.raises(ValueError, match=r"tokenizers differ: the teacher's fingerprint is \w+, the run's "):
        starting.join()
    assert not store.exists("run/teachers/teacher.json")  # nothing recorded


def test_annotator_without_follow_still_refuses_a_store_without_run_json(local_store, tiny_model_factory):
    cfg = annotate_config(tiny_model_factory("teacher", seed=1), follow=False)
    with pytest.raises(Exception, match=r"store .* does not exist \(no such folder\): check the path"):
        Annotator(cfg, local_store, progress=False)


# ---------------------------------------------------------------- the trainer
def test_trainer_on_an_empty_store_loads_the_student_then_waits_for_run_json_and_trains(
    tmp_path, tokenizer, teacher, tiny_model_factory, monkeypatch
):
    from opd_cache import models
    from opd_cache.train import run_train

    store, student = Store(tmp_path / "store"), tiny_model_factory("student", seed=0)
    cfg = train_config(store, student=str(student), follow=True, poll_seconds=0.1, max_steps=2)
    loaded = record_calls(monkeypatch, models, "load_causal_lm", store)
    training = InThread(lambda: run_train(cfg, store))
    wait_until_sleeping_on_run_json(training, loaded)
    assert loaded.saw_run[0] is False  # the student loaded before run.json existed

    make_store(store, student, tokenizer, teacher, shards=2, rows=8)  # run.json, then two annotated shards
    result = training.join()
    assert (result.step, result.trained_samples) == (2, 16)
    assert store.read_progress()["step"] == 2


def test_trainer_waiting_on_an_empty_store_refuses_a_run_json_with_another_tokenizer(
    tmp_path, tiny_model_factory, monkeypatch
):
    from opd_cache import models
    from opd_cache.train import run_train

    store, student = Store(tmp_path / "store"), tiny_model_factory("student", seed=0)
    cfg = train_config(store, student=str(student), follow=True, poll_seconds=0.1, max_steps=2)
    loaded = record_calls(monkeypatch, models, "load_causal_lm", store)
    training = InThread(lambda: run_train(cfg, store))
    wait_until_sleeping_on_run_json(training, loaded)
    store.manifest.ensure(student=str(student), tokenizer_fingerprint="0123456789abcdef", teachers={"teacher": "t"})
    with pytest.raises(ValueError, match=r"its tokenizer \(fingerprint \w+\) is not the run's \(0123456789abcdef"):
        training.join()
    assert store.read_progress() == {} and not store.is_done()  # nothing trained, nothing written


# ---------------------------------------------------------------- the supervisor's own start
def test_the_supervisor_reads_its_config_and_builds_the_stage_commands_without_importing_torch(tmp_path):
    # `opd run` starts the stages only after its own imports: torch (seconds) stays in the stages
    code = (
        "import sys; from pathlib import Path\n"
        "import opd_cache.cli, opd_cache.launch.ray_launcher\n"
        "from opd_cache.config import load_config\n"
        "from opd_cache.flow.demand import announce_demand\n"
        "from opd_cache.launch.run import stage_commands, write_resolved_config\n"
        "from opd_cache.storage.store import Store\n"
        f"cfg = load_config({str(tiny_config(tmp_path))!r})\n"
        f"path = write_resolved_config(cfg, Path({str(tmp_path / 'logs' / 'config.yaml')!r}))\n"
        f"assert len(stage_commands(cfg, path, Path({str(tmp_path / 'logs')!r}))) == 4\n"
        "announce_demand(Store(cfg.store.uri), cfg.train)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
