"""`RolloutWriter`: rollouts from any producer, as the shards `opd rollout` writes (rollout/writer.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import opd_cache
from opd_cache.rollout import run_rollout
from opd_cache.rollout.conversation import ChatRenderer
from opd_cache.rollout.environment import CalculatorEnvironment, ConversationLimits, run_conversation
from opd_cache.rollout.writer import RolloutWriter, RowError
from opd_cache.storage import layout
from opd_cache.storage.integrity import verify_store
from opd_cache.storage.schema import ROLLOUT, ShardError, read_shard
from opd_cache.storage.store import COMPLETE_MARKER, Store, StoreError
from opd_cache.tokenizer import tokenizer_fingerprint

from .conftest import DATA, TOKENIZER_DIR
from .test_environment import ScriptedStudent
from .test_rollout import config, questions, wait_for, write_prompts


def shards(store: Store, worker: str):
    return [
        (info, *read_shard(store, info.path, kind=ROLLOUT)) for info in store.shards.rollouts() if info.worker == worker
    ]


def random_rows(count: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, 6))
        yield rng.integers(1, vocab, size=3), rng.integers(1, vocab, size=n), -rng.random(n).astype(np.float32)


def test_writer_shards_are_rollout_shards(tiny_model_factory, tokenizer, local_store, tmp_path):
    """A rollout worker's shard, rewritten row by row through the writer: the same schema, columns, metadata and
    checksum trailer; both pass `opd verify`'s check."""
    student = tiny_model_factory("student")
    prompts = write_prompts(tmp_path / "p.jsonl", questions(3))
    run_rollout(config(student, prompts, n=2, flush_rows=6, max_samples=6), local_store)
    [(info, table, meta)] = shards(local_store, "w00")

    assert opd_cache.RolloutWriter is RolloutWriter  # the public name
    engine = dict(engine=meta.engine, engine_version=meta.engine_version, model_dtype=meta.model_dtype)
    with RolloutWriter(local_store, TOKENIZER_DIR, worker_id="agent0", **engine) as writer:
        for row in table.to_pylist():
            writer.append(
                row["prompt_ids"],
                row["response_ids"],
                row["behavior_logprobs"],
                finish_reason=row["finish_reason"],
                prompt_index=row["prompt_index"],
                sample_index=row["sample_index"],
                data_source=row["data_source"],
                ground_truth=row["ground_truth"],
                extra=row["extra"],
            )
    [(winfo, written, wmeta)] = shards(local_store, "agent0")
    assert winfo.shard_id == "v000000-agent0-000000" and writer.shards == [winfo.shard_id]
    assert written.schema.remove_metadata() == table.schema.remove_metadata()
    for name in table.schema.names:
        if name != "sample_id":
            assert written[name].equals(table[name]), name
    assert written["sample_id"].to_pylist() == [f"{winfo.shard_id}-{i}" for i in range(table.num_rows)]
    # every metadata key but the worker's place in its prompt stream (cursor, seed, prompt count)
    stream = {b"opd.rollout.cursor", b"opd.rollout.seed", b"opd.rollout.num_prompts"}
    keys = set(table.schema.metadata) - stream
    assert keys == set(written.schema.metadata) - {b"opd.writer.producer"}
    for key in keys - {b"opd.shard_id"}:
        assert written.schema.metadata[key] == table.schema.metadata[key], key
    assert (wmeta.kind, wmeta.policy_version, wmeta.engine, wmeta.schema_version) == ("rollout", 0, "hf", 2)
    assert written.schema.metadata[b"opd.rollout.samples"] == b"6"
    report = verify_store(local_store)
    assert not report.damaged and report.ok == 2


def test_writer_creates_run_json_like_a_rollout_worker_and_refuses_another_tokenizer(
    tiny_model_factory, tokenizer, local_store
):
    student = tiny_model_factory("student")
    with pytest.raises(ValueError, match="student= is required"):
        RolloutWriter(local_store, tokenizer)
    RolloutWriter(local_store, tokenizer, student=str(student)).close()
    run = local_store.manifest.require()
    assert run["student"] == str(student.resolve()) and run["vocab_size"] == len(tokenizer)
    assert run["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    bigger = type(tokenizer).from_pretrained(TOKENIZER_DIR)
    bigger.add_tokens(["<tool>"], special_tokens=True)
    with pytest.raises(StoreError, match="tokenizer_fingerprint is .* in this store but .* was given"):
        RolloutWriter(local_store, bigger)


def test_conversations_are_written_with_their_mask_and_single_turn_rows_without(tokenizer, student_store):
    renderer = ChatRenderer.from_file(tokenizer, DATA / "chat_templates" / "arithmetic_tools.jinja")
    scripts = {"What is 37 + 48?": ["[calc(37+48)]<eos>", " #### 85<eos>"], "What is 1 + 2?": [" #### 3<eos>"]}
    student = ScriptedStudent(renderer, scripts)
    with RolloutWriter(student_store, tokenizer, worker_id="agent0", policy_version=2, flush_rows=10) as writer:
        for question in scripts:
            row = run_conversation(student, CalculatorEnvironment(), question, renderer, ConversationLimits())
            writer.append_conversation(row, ground_truth=question)
        writer.append([5, 6], [7, 8], [-1.0, -2.0], loss_mask=[1, 1])  # all trained: a single-turn row
    [(info, table, meta)] = shards(student_store, "agent0")
    assert info.shard_id == "v000002-agent0-000000" and meta.policy_version == 2
    assert table["loss_mask"].to_pylist()[1:] == [None, None]
    mask, turns = table["loss_mask"][0].as_py(), table["turn_index"][0].as_py()
    assert mask == [1] * 14 + [0] * 5 + [1] * 9 and turns == [1] * 14 + [2] * 5 + [3] * 9
    lp = table["behavior_logprobs"][0].as_py()
    assert lp == [-0.5 if m else 0.0 for m in mask]

    # a shard of single-turn rows only has no multi-turn columns at all (a version-1 rollout's columns)
    with RolloutWriter(student_store, tokenizer, worker_id="plain") as writer:
        writer.append([5, 6], [7, 8], [-1.0, -2.0], loss_mask=[1, 1], turn_index=[1, 1])
    [(_, plain, _)] = shards(student_store, "plain")
    assert "loss_mask" not in plain.schema.names


@pytest.mark.parametrize(
    "row, message",
    [
        (dict(prompt_ids=[], response_ids=[1], behavior_logprobs=[-1.0]), "prompt_ids is empty"),
        (
            dict(prompt_ids=[1], response_ids=[1, 500], behavior_logprobs=[-1.0, -1.0]),
            r"response_ids\[1\] = 500 is outside",
        ),
        (dict(prompt_ids=[-1], response_ids=[1], behavior_logprobs=[-1.0]), r"prompt_ids\[0\] = -1 is outside"),
        (
            dict(prompt_ids=[1], response_ids=[1, 2], behavior_logprobs=[-1.0]),
            "behavior_logprobs has 1 entries, the response has 2",
        ),
        (dict(prompt_ids=[1], response_ids=[1], behavior_logprobs=[0.5]), "finite log-probabilities"),
        (
            dict(prompt_ids=[1], response_ids=[1, 2], behavior_logprobs=[-1.0, -1.0], loss_mask=[1]),
            "loss_mask has 1 entries",
        ),
        (dict(prompt_ids=[1], response_ids=[1, 2], behavior_logprobs=[-1.0, -1.0], loss_mask=[0, 0]), "all 0"),
        (dict(prompt_ids=[1], response_ids=[1, 2], behavior_logprobs=[-1.0, -1.0], loss_mask=[1, 3]), "0 or 1, got 3"),
        (
            dict(
                prompt_ids=[1], response_ids=[1, 2], behavior_logprobs=[-1.0, -1.0], loss_mask=[1, 0], turn_index=[2, 1]
            ),
            "turn_index must count up",
        ),
        (
            dict(prompt_ids=[1], response_ids=[1], behavior_logprobs=[-1.0], finish_reason="done"),
            "finish_reason 'done'",
        ),
        (
            dict(prompt_ids=[1] * 10, response_ids=[1] * 10, behavior_logprobs=[-1.0] * 10),
            "20 tokens .* more than the limit of 16",
        ),
    ],
)
def test_bad_rows_are_refused_with_the_field_named(tokenizer, student_store, row, message):
    with RolloutWriter(student_store, tokenizer, max_tokens=16) as writer:
        with pytest.raises(RowError, match=message):
            writer.append(**row)
    assert not student_store.shards.rollouts()


def test_versions_only_go_forward_and_staleness_applies(tokenizer, student_store):
    writer = RolloutWriter(student_store, tokenizer, worker_id="agent0", policy_version=1)
    writer.append([1], [2], [-1.0])
    writer.set_policy_version(3)  # publishes the version-1 rows first: a shard holds one version
    writer.append([1], [2], [-1.0])
    writer.close()
    assert writer.shards == ["v000001-agent0-000000", "v000003-agent0-000001"]
    with pytest.raises(ValueError, match="versions never go back"):
        writer.set_policy_version(2)
    with pytest.raises(ValueError, match="already published policy version 3"):
        RolloutWriter(student_store, tokenizer, worker_id="agent0", policy_version=2)
    student_store.write_bytes(f"{layout.policy_dir(6)}/{COMPLETE_MARKER}", b"")  # as if the trainer published v6
    student_store.write_bytes(layout.LATEST, b"6\n")
    assert writer.too_stale(max_staleness=2) and not writer.too_stale(max_staleness=3)
    # a restarted writer continues after its last sequence number and count
    again = RolloutWriter(student_store, tokenizer, worker_id="agent0", policy_version=3)
    again.append([1], [2], [-1.0])
    assert again.flush() == "v000003-agent0-000002"
    [(_, table, _)] = [s for s in shards(student_store, "agent0") if s[0].seq == 2]
    assert table.schema.metadata[b"opd.rollout.samples"] == b"3"


def test_concurrent_writers_with_distinct_ids_and_a_shared_id_fails_loudly(tokenizer, student_store):
    def produce(worker: str, seed: int) -> None:
        with RolloutWriter(student_store, tokenizer, worker_id=worker, flush_rows=5) as writer:
            for prompt, response, logprobs in random_rows(20, len(tokenizer), seed):
                writer.append(prompt, response, logprobs)

    threads = [threading.Thread(target=produce, args=(f"agent{i}", i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    infos = student_store.shards.rollouts()
    assert sorted(i.shard_id for i in infos) == [f"v000000-agent{w}-{s:06d}" for w in range(3) for s in range(4)]
    assert sum(read_shard(student_store, i.path)[0].num_rows for i in infos) == 60

    # two writers given the same id: the second to publish sequence 0 is refused, nothing is overwritten
    first = RolloutWriter(student_store, tokenizer, worker_id="shared")
    second = RolloutWriter(student_store, tokenizer, worker_id="shared")
    first.append([1], [2], [-1.0])
    second.append([1], [3], [-1.0])
    first.flush()
    with pytest.raises(ShardError, match="already exists.*give each concurrent writer its own worker_id"):
        second.flush()
    [(_, table, _)] = shards(student_store, "shared")
    assert table["response_ids"].to_pylist() == [[2]]


KILLED_WRITER = """
import os, sys, time
from opd_cache.rollout.writer import RolloutWriter

store, tokenizer, marker = sys.argv[1:4]
writer = RolloutWriter(store, tokenizer, worker_id="agent0", flush_rows=4)
for i in range(4):  # the first shard is published normally
    writer.append([1, 2], [3, 4, i + 5], [-1.0, -1.0, -1.0])

def stuck_link(src, dst):  # the second shard's bytes are complete in their temporary file: hang before publishing
    open(marker, "w").close()
    time.sleep(600)

os.link = stuck_link
for i in range(4):
    writer.append([1, 2], [3, 4, i + 9], [-1.0, -1.0, -1.0])
"""


def test_a_killed_writer_leaves_no_partial_shard(tokenizer, student_store, tmp_path):
    marker = tmp_path / "flushing"
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(KILLED_WRITER))
    child = subprocess.Popen(
        [sys.executable, str(script), student_store.path(""), str(TOKENIZER_DIR), str(marker)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        wait_for(lambda: marker.exists() or child.poll() is not None, what="the second flush")
        assert child.poll() is None, "the writer exited before its second flush"
        temporary = [p for p in (student_store.local_path("rollouts")).rglob("*") if ".tmp-" in p.name]
        assert temporary, "the second shard's temporary file should exist while the writer hangs"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # only the first shard is visible, intact; the temporary file is ignored by listings and by verify
    assert [i.shard_id for i in student_store.shards.rollouts()] == ["v000000-agent0-000000"]
    report = verify_store(student_store)
    assert not report.damaged and report.ok == 1
    # the writer restarted with the same id continues after the published shard
    writer = RolloutWriter(student_store, tokenizer, worker_id="agent0")
    assert (writer.seq, writer.total_samples) == (1, 4)
