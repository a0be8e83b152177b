"""`opd annotate` end to end on a local store with tiny teachers.

Every annotated value is checked against a direct computation in the test
(log_softmax of the teacher's full logits for one unpadded sequence, then
top-k); the worker properties (hash split, idempotency, SIGKILL + restart,
staleness, routing, quarantine, --follow) are checked on real shards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

from opd_cache.annotate import Annotator, run_annotate, shard_owner
from opd_cache.config import AnnotateConfig, Config, load_config
from opd_cache.models import build_tiny_model, load_causal_lm, save_causal_lm
from opd_cache.storage import layout
from opd_cache.storage.schema import (
    ANNOTATED,
    ROLLOUT,
    flat_values,
    list_lengths,
    read_shard,
    rollout_table,
    write_shard,
)
from opd_cache.storage.store import StoreError, make_shard_id
from opd_cache.testing import write_rollout_shard
from opd_cache.tokenizer import load_tokenizer
from tests.conftest import REPO, write_random_rollout_shard
from tests.helpers import InThread

VOCAB = 99  # the shipped tokenizer


@pytest.fixture
def teacher_path(tiny_model_factory) -> Path:
    return tiny_model_factory("teacher", seed=1)


@pytest.fixture
def store(student_store):
    return student_store


def annotate_args(store, teacher_path, *flags: str) -> list[str]:
    """The command line of `opd annotate` on `store` with the teacher at `teacher_path`, then `flags`."""
    return ["annotate", "--store", store.uri, "--teacher", str(teacher_path), *flags]


def write_shards(store, count: int, version: int = 0, worker: str = "w00", **kwargs) -> list[str]:
    ids = []
    for seq in range(count):
        shard_id = make_shard_id(version, worker, seq)
        kwargs.setdefault("num_rows", 6)
        kwargs.setdefault("max_response", 8)
        write_random_rollout_shard(
            store,
            shard_id=shard_id,
            vocab_size=VOCAB,
            seed=version * 1000 + seq,
            run=store.manifest.require(),
            **kwargs,
        )
        ids.append(shard_id)
    return ids


def config(teacher, max_staleness: int | None = None, **kwargs) -> Config:
    """A configuration whose annotate section scores with `teacher` (`kwargs`: more annotate keys)."""
    top_level = {} if max_staleness is None else {"max_staleness": max_staleness}
    return Config(annotate=AnnotateConfig(teacher=str(teacher), **kwargs), **top_level)


def read_part(store, shard_id: str, teacher: str = "teacher"):
    return read_shard(store, layout.annotated_path(shard_id, teacher), kind=ANNOTATED, run=store.manifest.require())


def rows_of(table, column):
    return np.split(flat_values(table[column]), np.cumsum(list_lengths(table[column]))[:-1]) if table.num_rows else []


@torch.inference_mode()
def direct(model, prompt, response):
    ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
    return torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[
        len(prompt) - 1 : len(prompt) - 1 + len(response)
    ]


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_annotations_equal_direct_computation(store, teacher_path, dtype):
    k = 6
    (shard_id,) = write_shards(store, 1, num_rows=8, max_response=12, student_topk=3)
    stats = run_annotate(config(teacher_path, top_k=k, dtype=dtype, max_tokens_per_batch=40), store)
    assert stats.annotated == [shard_id] and stats.tokens > 0

    rollout, _ = read_shard(store, layout.rollout_path(shard_id), kind=ROLLOUT)
    part, meta = read_part(store, shard_id)
    assert (meta.kind, meta.top_k, meta.teacher, meta.policy_version, meta.shard_id) == (
        ANNOTATED,
        k,
        "teacher",
        0,
        shard_id,
    )
    assert part.schema.metadata[b"opd.teacher_temperature"] == b"1.0"
    assert part["sample_id"].equals(rollout["sample_id"])
    assert str(part.schema.field("teacher_topk_logprobs").type.value_type.value_type) == (
        "halffloat" if dtype == "float16" else "float"
    )

    model = load_causal_lm(teacher_path)
    # float32: to 1e-6; float16 storage: to float16 rounding (half an ulp, 2**-11 relative)
    tol = dict(rtol=0, atol=1e-6) if dtype == "float32" else dict(rtol=2**-11, atol=1e-6)
    outside = 0
    for prompt, response, student_topk, ids, lps, tok, support in zip(
        rows_of(rollout, "prompt_ids"),
        rows_of(rollout, "response_ids"),
        rows_of(rollout, "student_topk_ids"),
        rows_of(part, "teacher_topk_ids"),
        rows_of(part, "teacher_topk_logprobs"),
        rows_of(part, "teacher_token_logprob"),
        rows_of(part, "teacher_support_logprobs"),
    ):
        assert len(ids) == len(response)
        if not len(response):
            continue
        ref = direct(model, prompt, response)
        top = torch.topk(ref, k)
        np.testing.assert_array_equal(ids, top.indices.numpy())
        np.testing.assert_allclose(lps.astype(np.float32), top.values.numpy(), **tol)
        # the sampled token's and the support log-probs are float32 in every storage dtype
        np.testing.assert_allclose(
            tok, ref.gather(1, torch.from_numpy(response.astype(np.int64))[:, None])[:, 0], rtol=0, atol=1e-6
        )
        np.testing.assert_allclose(
            support, ref.gather(1, torch.from_numpy(student_topk.astype(np.int64))), rtol=0, atol=1e-6
        )
        outside += int((~(ids == response[:, None]).any(axis=1)).sum())
    assert outside > 0  # some sampled tokens were outside the top-k, and their log-probs were exact


def test_token_budget_does_not_change_outputs_and_rerun_is_bitwise_identical(store, teacher_path):
    shard_ids = write_shards(store, 2, num_rows=10, max_response=12)
    run_annotate(config(teacher_path, top_k=5, max_tokens_per_batch=10_000), store)
    first = {s: store.read_bytes(layout.annotated_path(s, "teacher")) for s in shard_ids}
    tables = {s: read_part(store, s)[0] for s in shard_ids}

    # nothing pending: a rerun writes nothing
    assert run_annotate(config(teacher_path, top_k=5), store).annotated == []

    for budget in (7, 10_000):
        store.delete_dir("annotated")
        run_annotate(config(teacher_path, top_k=5, max_tokens_per_batch=budget), store)
        for s in shard_ids:
            again, _ = read_part(store, s)
            assert again["sample_id"].equals(tables[s]["sample_id"])
            assert again["teacher_topk_ids"].equals(tables[s]["teacher_topk_ids"])
            # CPU matmul kernels are not bitwise invariant to the batch shape: float32 rounding only
            for col in ("teacher_topk_logprobs", "teacher_token_logprob"):
                np.testing.assert_allclose(flat_values(again[col]), flat_values(tables[s][col]), rtol=0, atol=1e-6)
            if budget == 10_000:  # same batches: the same bytes
                assert store.read_bytes(layout.annotated_path(s, "teacher")) == first[s]


# ---------------------------------------------------------------- workers
def test_two_workers_annotate_every_shard_exactly_once(store, teacher_path):
    shard_ids = write_shards(store, 10, num_rows=3)
    assert {shard_owner(s, 2) for s in shard_ids} == {0, 1}  # both workers have work
    stats = [run_annotate(config(teacher_path, top_k=4, worker_index=i, num_workers=2), store) for i in (0, 1)]
    assert set(stats[0].annotated).isdisjoint(stats[1].annotated)
    assert sorted(stats[0].annotated + stats[1].annotated) == shard_ids
    assert all(shard_owner(s, 2) == i for i in (0, 1) for s in stats[i].annotated)
    assert store.shards.annotated_parts() == {s: {"teacher"} for s in shard_ids}
    assert [
        run_annotate(config(teacher_path, top_k=4, worker_index=i, num_workers=2), store).annotated for i in (0, 1)
    ] == [[], []]
    assert shard_owner("v000001-w03-000042", 7) == 1  # crc32 (not the salted hash()): the same on every machine


def test_sigkilled_worker_restarted_leaves_no_partial_or_duplicate_part(store, teacher_path):
    shard_ids = write_shards(store, 24, num_rows=8, max_response=12)
    flags = ["--top-k", "4", "--max-tokens-per-batch", "32"]
    cmd = [sys.executable, "-m", "opd_cache.cli", *annotate_args(store, teacher_path, *flags)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the one_thread fixture (conftest.py), for the subprocess
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not store.shards.annotated_parts() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: while scoring or writing the next shard
    finally:
        proc.wait(timeout=10)
    done_at_kill = store.shards.annotated_parts()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert 0 < len(done_at_kill) < len(shard_ids)

    # restart with the same settings: finishes the rest, rewrites nothing
    stats = run_annotate(config(teacher_path, top_k=4, max_tokens_per_batch=32), store)
    assert sorted(stats.annotated) == sorted(set(shard_ids) - set(done_at_kill))
    assert store.shards.annotated_parts() == {s: {"teacher"} for s in shard_ids}
    annotated_dir = Path(store.uri) / "annotated"
    for shard_id in shard_ids:  # exactly one complete, valid part per shard; at most ignored *.tmp-* leftovers
        names = [p.name for p in (annotated_dir / shard_id[:7] / shard_id).iterdir() if ".tmp-" not in p.name]
        assert names == ["teacher.arrow"]
        part, _ = read_part(store, shard_id)
        rollout, _ = read_shard(store, layout.rollout_path(shard_id))
        assert part["sample_id"].equals(rollout["sample_id"])
        assert (list_lengths(part["teacher_token_logprob"]) == list_lengths(rollout["response_ids"])).all()
    # what the killed process wrote equals what this process computes
    killed_part = sorted(done_at_kill)[0]
    before, _ = read_part(store, killed_part)
    store.delete(layout.annotated_path(killed_part, "teacher"))
    run_annotate(config(teacher_path, top_k=4, max_tokens_per_batch=32), store)
    after, _ = read_part(store, killed_part)
    assert after["teacher_topk_ids"].equals(before["teacher_topk_ids"])
    np.testing.assert_allclose(
        flat_values(after["teacher_token_logprob"]), flat_values(before["teacher_token_logprob"]), rtol=0, atol=1e-6
    )


def test_stale_shards_are_skipped_and_counted(store, teacher_path, tmp_path):
    for version in range(4):
        write_shards(store, 1, version=version, num_rows=2)
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text("{}")
    store.publish_policy(3, tmp_path / "policy")
    stats = run_annotate(config(teacher_path, top_k=4, max_staleness=1), store)
    assert sorted(stats.skipped_stale) == ["v000000-w00-000000", "v000001-w00-000000"]
    assert sorted(stats.annotated) == ["v000002-w00-000000", "v000003-w00-000000"]
    # the bound is the configuration's one max_staleness (the top-level key, default 2); a trainer's value that
    # an earlier version left in run.json is not read back
    store.delete_dir("annotated")
    store.write_json("run.json", {**store.read_json("run.json"), "max_staleness": 0})
    cfg = load_config(overrides={"annotate.teacher": str(teacher_path)}, sets=["max_staleness=1"])
    stats = run_annotate(cfg, store)
    assert sorted(stats.annotated) == ["v000002-w00-000000", "v000003-w00-000000"]
    store.delete_dir("annotated")
    stats = run_annotate(config(teacher_path, top_k=4), store)
    assert stats.skipped_stale == ["v000000-w00-000000"] and len(stats.annotated) == 3


def test_follow_annotates_new_shards_until_done(store, teacher_path):
    write_shards(store, 1, num_rows=2)
    annotator = Annotator(config(teacher_path, top_k=4, follow=True, poll_seconds=0.05), store, progress=False)
    thread = threading.Thread(target=annotator.run, daemon=True)
    thread.start()
    late = make_shard_id(0, "w01", 0)  # polls list versions up to LATEST (0 here): a run writes no newer shard
    write_random_rollout_shard(store, shard_id=late, vocab_size=VOCAB, run=store.manifest.require())
    deadline = time.time() + 60
    while not store.exists(layout.annotated_path(late, "teacher")) and time.time() < deadline:
        time.sleep(0.05)
    assert thread.is_alive()  # still following
    store.mark_done()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert sorted(annotator.stats.annotated) == ["v000000-w00-000000", late]


def test_a_following_annotator_scores_nothing_when_done_appears_as_it_reads_the_schedule(
    store, teacher_path, monkeypatch
):
    """The trainer writes train/DONE just as annotate reads its schedule, between two pending shards (a race at the
    end of a run, #25): DONE drops the schedule, and the second shard must not then be scored for no step."""
    first, _second = write_shards(store, 2, num_rows=2)
    annotator = Annotator(config(teacher_path, top_k=4, follow=True, poll_seconds=30), store, progress=False)
    read_schedule = annotator.selection.read_schedule

    def read_schedule_as_the_trainer_finishes():
        if store.shards.annotated_parts():  # the first part is out: the last step trains it and DONE is written
            store.mark_done()
        return read_schedule()

    monkeypatch.setattr(annotator.selection, "read_schedule", read_schedule_as_the_trainer_finishes)
    stats = annotator.run()
    assert stats.annotated == [first]


def test_stop_ends_a_following_annotator(store, teacher_path):
    """`run_annotate(..., stop=event)`: a following worker returns when the event is set, without train/DONE."""
    write_shards(store, 1, num_rows=2)
    stop = threading.Event()
    worker = InThread(
        lambda: run_annotate(config(teacher_path, top_k=4, follow=True, poll_seconds=0.05), store, stop=stop)
    )
    worker.wait_until(lambda: store.shards.annotated_parts(), "the first part")
    time.sleep(0.2)  # following: polling for more shards
    stop.set()
    stats = worker.join()
    assert stats.annotated == ["v000000-w00-000000"] and not store.is_done()


def test_an_engine_is_a_registry_entry_and_an_unknown_one_is_one_line(tokenizer, monkeypatch):
    from opd_cache.annotate import engines as annotate_engines
    from opd_cache.config import RolloutConfig
    from opd_cache.rollout import engines as rollout_engines

    with pytest.raises(ValueError, match=r"^--engine 'tgi': no such rollout engine; use one of hf, vllm$"):
        rollout_engines.make_engine(RolloutConfig().model_copy(update={"engine": "tgi"}), "m", tokenizer)
    with pytest.raises(ValueError, match=r"^--engine 'tgi': no such annotate engine; use one of hf, vllm$"):
        annotate_engines.make_scorer(AnnotateConfig(teacher="t").model_copy(update={"engine": "tgi"}), 4, 10)
    # a new back-end is one more entry: its builder gets the section, and what it returns is the engine
    built = {}
    monkeypatch.setitem(rollout_engines.GENERATORS, "tgi", lambda cfg, path, tok: built.setdefault("g", (cfg, path)))
    monkeypatch.setitem(annotate_engines.SCORERS, "tgi", lambda cfg, k, vocab: built.setdefault("s", (k, vocab)))
    cfg = RolloutConfig().model_copy(update={"engine": "tgi"})
    assert rollout_engines.make_engine(cfg, "m", tokenizer) == (cfg, "m")
    assert annotate_engines.make_scorer(AnnotateConfig(teacher="t").model_copy(update={"engine": "tgi"}), 4, 10) == (
        4,
        10,
    )


# ---------------------------------------------------------------- routing
def write_routed_shard(store, shard_id: str, sources: list[str | None]) -> None:
    rng = np.random.default_rng(len(sources))
    n = len(sources)
    lengths = rng.integers(1, 6, size=n)
    table = rollout_table(
        sample_ids=[f"{shard_id}-{i}" for i in range(n)],
        prompt_index=np.arange(n),
        sample_index=np.zeros(n),
        prompt_ids=[rng.integers(1, VOCAB, size=4) for _ in range(n)],
        response_ids=[rng.integers(1, VOCAB, size=m) for m in lengths],
        behavior_logprobs=[-rng.random(m) for m in lengths],
        policy_version=0,
        finish_reason=["stop"] * n,
        data_source=sources,
    )
    write_rollout_shard(store, store.manifest.require(), shard_id, table)


def test_routing_sends_each_row_to_its_teacher(store, tiny_model_factory):
    mixed, only_math = make_shard_id(0, "w00", 0), make_shard_id(0, "w00", 1)
    write_routed_shard(store, mixed, ["math", "code", "math", None, "poetry", "code"])
    write_routed_shard(store, only_math, ["math", "math"])
    routing = {"math": "tA", "code": "tB"}
    a = run_annotate(
        config(
            tiny_model_factory("teacher", seed=1), top_k=4, teacher_name="tA", routing=routing, default_teacher="tB"
        ),
        store,
    )
    # the second teacher's job adopts the routing recorded in run.json
    b = run_annotate(config(tiny_model_factory("teacher", seed=2), top_k=4, teacher_name="tB"), store)
    assert sorted(a.annotated) == sorted(b.annotated) == [mixed, only_math]

    run = store.manifest.require()
    assert run["routing"] == {"key": "data_source", "map": routing, "default": "tB"}
    assert set(run["teachers"]) == {"tA", "tB"} and run["top_k"] == 4
    assert read_part(store, mixed, "tA")[0]["sample_id"].to_pylist() == [f"{mixed}-0", f"{mixed}-2"]
    # unlisted keys (None, "poetry") go to the default teacher; rollout order is kept
    assert read_part(store, mixed, "tB")[0]["sample_id"].to_pylist() == [f"{mixed}-{i}" for i in (1, 3, 4, 5)]
    assert read_part(store, only_math, "tB")[0].num_rows == 0  # still written: completeness is decidable

    with pytest.raises(StoreError, match="routing is .* in this store but"):
        Annotator(
            config(tiny_model_factory("teacher", seed=1), teacher_name="tA", routing={"math": "tB"}),
            store,
            progress=False,
        )
    with pytest.raises(ValueError, match="the routing in run.json sends no rows to it"):
        Annotator(config(tiny_model_factory("teacher", seed=1), teacher_name="tC"), store, progress=False)


def test_run_json_contradictions_fail_before_any_work(store, teacher_path, tiny_model_factory):
    write_shards(store, 1)
    run_json = store.read_bytes("run.json")
    run_annotate(config(teacher_path, top_k=4), store)
    # the teacher is recorded in its own create-if-absent object; run.json is not rewritten
    assert store.read_bytes("run.json") == run_json
    record = json.loads(store.read_bytes("run/teachers/teacher.json"))
    assert record["model"] == str(teacher_path) and record["top_k"] == 4 and record["codec"] == "none"
    with pytest.raises(StoreError, match="top_k is 4 in this store but 8 was given"):
        Annotator(config(teacher_path, top_k=8), store, progress=False)
    with pytest.raises(StoreError, match="teacher 'teacher' is .* use another --teacher-name"):
        Annotator(config(tiny_model_factory("teacher", seed=2)), store, progress=False)
    assert Annotator(config(teacher_path), store, progress=False).top_k == 4  # no --top-k: the store's value


def test_a_store_with_its_teachers_in_run_json_is_annotated_as_before(store, teacher_path, tiny_model_factory):
    """Stores written before the teacher records hold teachers and top_k in run.json: they still bind."""
    shard_id = write_shards(store, 1)[0]
    store.write_json(
        "run.json", {**store.read_json("run.json"), "teachers": {"teacher": str(teacher_path)}, "top_k": 4}
    )
    with pytest.raises(StoreError, match=r"run\.json: teacher 'teacher' is .* use another --teacher-name"):
        Annotator(config(tiny_model_factory("teacher", seed=2)), store, progress=False)
    stats = run_annotate(config(teacher_path), store)  # no --top-k: run.json's
    assert stats.annotated == [shard_id] and read_part(store, shard_id)[1].top_k == 4
    assert store.manifest.require().required_teachers() == ["teacher"]


# ---------------------------------------------------------------- bad input
def test_tokenizer_mismatch_names_both_models_and_the_first_differing_token(store, tokenizer_path, tmp_path):
    spec = json.loads((tokenizer_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two ids swapped
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tokenizer_path, other)
    (other / "tokenizer.json").write_text(json.dumps(spec))
    other_tok = load_tokenizer(other)
    teacher = tmp_path / "odd-teacher"
    save_causal_lm(build_tiny_model(vocab_size=len(other_tok)), other_tok, teacher)
    write_shards(store, 1)

    low = min(vocab["a"], vocab["b"])
    student = store.manifest.require()["student"]
    with pytest.raises(ValueError) as err:
        Annotator(config(teacher), store, progress=False)
    message = str(err.value)
    assert str(teacher) in message and student in message
    assert f"id {low} is" in message and "'a'" in message and "'b'" in message
    assert store.shards.annotated_parts() == {} and "teachers" not in store.manifest.require()  # nothing done


def test_top_k_larger_than_the_vocabulary_is_refused(store, teacher_path):
    with pytest.raises(
        ValueError, match=rf"--top-k 100 is larger than the vocabulary of teacher .* \({VOCAB} tokens\)"
    ):
        Annotator(config(teacher_path, top_k=100), store, progress=False)
    assert "top_k" not in store.manifest.require()


def test_corrupt_rollout_shard_is_quarantined_and_the_worker_goes_on(store, teacher_path):
    shard_ids = write_shards(store, 3, num_rows=3)
    bad = layout.rollout_path(shard_ids[1])
    data = store.read_bytes(bad)
    store.write_bytes(bad, data[: len(data) // 2])  # truncated
    stats = run_annotate(config(teacher_path, top_k=4), store)
    assert stats.quarantined == [shard_ids[1]]
    assert stats.annotated == [shard_ids[0], shard_ids[2]]
    assert not store.exists(bad)
    reasons = store.list_quarantine()
    assert (
        list(reasons) == [bad.replace("/", "__")]
        and "truncated or not an Arrow IPC stream" in reasons[bad.replace("/", "__")]
    )


def test_token_ids_outside_the_vocabulary_are_quarantined(store, teacher_path):
    (shard_id,) = write_shards(store, 1)
    rollout, meta = read_shard(store, layout.rollout_path(shard_id))
    huge = pa.array([[5, 200]] + [[1]] * (rollout.num_rows - 1), pa.list_(pa.int32()))  # a valid shard, bad ids
    column = rollout.schema.get_field_index("prompt_ids")
    write_shard(store, layout.rollout_path(shard_id), rollout.set_column(column, "prompt_ids", huge), meta)
    stats = run_annotate(config(teacher_path, top_k=4), store)
    assert stats.quarantined == [shard_id]
    assert "column 'prompt_ids' holds token id 200, outside the vocabulary 0..98" in next(
        iter(store.list_quarantine().values())
    )


# ---------------------------------------------------------------- CLI
def test_cli_annotates_and_reports_errors_in_one_line(store, teacher_path):
    from opd_cache.cli import app

    write_shards(store, 2, num_rows=2)
    runner = CliRunner()
    result = runner.invoke(
        app, annotate_args(store, teacher_path, "--top-k", "3", "--dtype", "float16", "--max-shards", "1")
    )
    assert result.exit_code == 0, result.output
    assert "annotated 1 shards" in result.output
    assert len(store.shards.annotated_parts()) == 1

    result = runner.invoke(
        app,
        annotate_args(store, teacher_path, "--top-k", "500", "--teacher-name", "big"),
    )
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "--top-k 500 is larger than the vocabulary" in result.output

    result = runner.invoke(
        app,
        ["annotate", "--store", store.uri, "--teacher", str(teacher_path), "--worker-index", "2", "--num-workers", "2"],
    )
    assert result.exit_code == 2 and "worker_index 2 must be < num_workers 2" in result.output


def test_progress_display_shows_shards_tokens_per_second_and_backlog(store, teacher_path):
    import io

    from rich.console import Console

    write_shards(store, 2, num_rows=2)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=120)
    stats = Annotator(config(teacher_path, top_k=4), store, console=console, progress=True).run()
    assert len(stats.annotated) == 2
    text = out.getvalue()
    assert "annotate teacher" in text and "2/2 shards" in text and "tok/s" in text and "backlog 0" in text
    plain = io.StringIO()  # not a terminal (the log file of `opd run`): a plain line every ~10 s, no bar
    run_annotate(config(teacher_path, top_k=4, teacher_name="second"), store, console=Console(file=plain))
    assert plain.getvalue() == "annotate second: 0 shards, 0 rows, 0 tok/s, 2 pending\n"
    silent = io.StringIO()  # progress=False (library use): nothing
    Annotator(
        config(teacher_path, top_k=4, teacher_name="third"), store, console=Console(file=silent), progress=False
    ).run()
    assert silent.getvalue() == ""
