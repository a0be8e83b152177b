"""`opd ingest`: JSONL rollouts of other producers into rollout shards, with and without token ids, and every
bad input a one-line error naming the file and line (rollout/ingest.py, ingest_formats.py, cli/ingest.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from opd_cache.cli import app
from opd_cache.models import build_tiny_model, load_causal_lm, save_causal_lm
from opd_cache.rollout.ingest import IngestOptions, ingest
from opd_cache.rollout.ingest_formats import IngestError
from opd_cache.storage.integrity import verify_store
from opd_cache.storage.schema import ROLLOUT, read_shard

from .conftest import DATA
from .test_rollout import teacher_forced_logprobs

TEMPLATE = DATA / "chat_templates" / "arithmetic_tools.jinja"
CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
runner = CliRunner()


def opd(*args):
    return runner.invoke(app, [str(a) for a in args])


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def tool_conversation(a: int, b: int, **fields) -> dict:
    """An agent trace in the OpenAI format: a calc call, its result, the answer."""
    return {
        "messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": f"{a}+{b}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": str(a + b)},
            {"role": "assistant", "content": f" #### {a + b}"},
        ],
        "tools": [CALC],
        "ground_truth": str(a + b),
        "data_source": "arithmetic",
        **fields,
    }


def rows_of(store):
    out = []
    for info in store.shards.rollouts():
        table, meta = read_shard(store, info.path, kind=ROLLOUT, run=store.manifest.read())
        out.append((info, table, meta))
    return out


@pytest.fixture
def student(tiny_model_factory):
    return tiny_model_factory("student", seed=0)


def test_ingest_with_token_ids_keeps_them_and_their_log_probs(student, local_store, tmp_path, tokenizer):
    rows = [
        {
            "prompt_ids": [10, 11, 12],
            "response_ids": [20, 21, 22, 23],
            "loss_mask": [1, 1, 0, 1],
            "behavior_logprobs": [-0.5, -0.25, 0.0, -1.0],
            "finish_reason": "stop",
            "prompt_index": 7,
            "sample_index": 1,
        },
        {"prompt_ids": [10], "response_ids": [30, 31], "behavior_logprobs": [-2.0, -3.0], "extra_info": {"k": 1}},
    ]
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    result = opd("ingest", path, "--store", local_store.path(""), "--student", student, "--policy-version", 0)
    assert result.exit_code == 0, result.output
    assert "ingested 2 rows into 1 shards (0 with computed behavior log-probs), skipped 0 bad rows" in result.stdout
    [(info, table, meta)] = rows_of(local_store)
    assert info.shard_id == "v000000-ingest-000000" and meta.policy_version == 0
    assert table["response_ids"].to_pylist() == [[20, 21, 22, 23], [30, 31]]
    assert table["loss_mask"].to_pylist() == [[1, 1, 0, 1], None]
    assert table["turn_index"].to_pylist() == [[0, 0, 1, 2], None]  # segments of the mask, without messages
    assert table["behavior_logprobs"].to_pylist() == [[-0.5, -0.25, 0.0, -1.0], [-2.0, -3.0]]
    assert (table["prompt_index"][0].as_py(), table["sample_index"][0].as_py()) == (7, 1)
    assert table["extra"][1].as_py() == '{"k": 1}'
    run = local_store.manifest.require()
    assert run["student"] == str(student.resolve()) and run["vocab_size"] == len(tokenizer)
    assert not verify_store(local_store).damaged


def test_ingest_without_token_ids_renders_and_computes_behavior_log_probs(student, local_store, tmp_path, tokenizer):
    rows = [
        tool_conversation(37, 48),
        {  # TRL conversational prompt-completion
            "prompt": [{"role": "user", "content": "What is 1 + 2?"}],
            "completion": [{"role": "assistant", "content": " #### 3"}],
        },
        {"prompt": "What is 5 + 5?\n", "completion": " #### 10"},  # TRL standard: text
        {"input": "What is 2 + 2?\n", "output": " #### 4", "gts": "4", "step": 1, "score": 1.0},  # verl dump
    ]
    path = write_jsonl(tmp_path / "text.jsonl", rows)
    result = ingest(
        [str(path)], local_store, IngestOptions(policy_version=0, chat_template=str(TEMPLATE)), student=str(student)
    )
    assert (result.rows, result.computed, result.skipped) == (4, 4, 0)
    [(_, table, _)] = rows_of(local_store)
    texts = [
        tokenizer.decode(p + r) for p, r in zip(table["prompt_ids"].to_pylist(), table["response_ids"].to_pylist())
    ]
    assert texts == [
        "What is 37 + 48?\n[calc(37+48)]<eos>= 85\n #### 85<eos>",
        "What is 1 + 2?\n #### 3<eos>",
        "What is 5 + 5?\n #### 10<eos>",
        "What is 2 + 2?\n #### 4<eos>",
    ]
    assert table["loss_mask"][0].as_py() == [1] * 14 + [0] * 5 + [1] * 9
    assert table["loss_mask"].to_pylist()[1:] == [None, None, None]  # single-turn rows
    assert table["ground_truth"].to_pylist() == ["85", None, None, "4"]
    # the computed log-probs are the student's own, teacher-forced over the whole conversation
    model = load_causal_lm(student)
    for row in table.to_pylist():
        expected = teacher_forced_logprobs(model, row["prompt_ids"], row["response_ids"])
        mask = np.array(row["loss_mask"] or [1] * len(expected), dtype=bool)
        np.testing.assert_allclose(np.array(row["behavior_logprobs"])[mask], expected[mask], atol=1e-4)
        assert not np.array(row["behavior_logprobs"])[~mask].any()


def test_rows_are_written_per_policy_version_with_that_version_s_log_probs(student, local_store, tmp_path, tokenizer):
    newer = tmp_path / "v1"
    save_causal_lm(build_tiny_model(vocab_size=len(tokenizer), seed=5), tokenizer, newer)
    local_store.manifest.ensure(student=str(student), tokenizer_fingerprint=None)
    local_store.publish_policy(1, newer)
    rows = [
        tool_conversation(11, 22, policy_version=1),
        tool_conversation(30, 40),
        tool_conversation(1, 2, policy_version=1),
    ]
    path = write_jsonl(tmp_path / "versions.jsonl", rows)
    result = ingest(
        [str(path)], local_store, IngestOptions(policy_version=0, chat_template=str(TEMPLATE)), student=str(student)
    )
    assert result.shards == ["v000000-ingest-000000", "v000001-ingest-000001"]  # versions in increasing order
    by_version = {meta.policy_version: table for _, table, meta in rows_of(local_store)}
    assert by_version[0]["ground_truth"].to_pylist() == ["70"] and by_version[1]["ground_truth"].to_pylist() == [
        "33",
        "3",
    ]
    model = load_causal_lm(newer)
    row = by_version[1].to_pylist()[0]
    expected = teacher_forced_logprobs(model, row["prompt_ids"], row["response_ids"])
    mask = np.array(row["loss_mask"], dtype=bool)
    np.testing.assert_allclose(np.array(row["behavior_logprobs"])[mask], expected[mask], atol=1e-4)


BAD_ROWS = [
    ('{"messages": [', r"not valid JSON \(Expecting value at column 15\)"),
    ('["not", "an", "object"]', "expected a JSON object, got list"),
    ({"text": "hello"}, "no row found: expected 'prompt_ids'\\+'response_ids', 'messages'"),
    (
        {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
        r"message 0: unknown role 'robot' \(expected one of system, user, assistant, tool\)",
    ),
    (
        tool_conversation(1, 2, tools=[{"type": "function", "function": {"name": "search"}}]),
        r"message 1 calls unknown tool 'calc' \(known tools: search\)",
    ),
    ({**tool_conversation(1, 2), "tools": None}, "calls tool 'calc' but declares no tools"),
    (tool_conversation(10**30, 1), r"\d+ tokens \(prompt \d+ \+ response \d+\), more than the limit of 64"),
    (
        {"prompt_ids": [1, 2], "response_ids": [3, 100], "behavior_logprobs": [-1, -1]},
        r"response_ids\[1\] = 100 is outside the vocabulary \(ids 0..98\)",
    ),
    (
        {"prompt_ids": [1, 2], "response_ids": [3, 4], "loss_mask": [1, 0, 1], "behavior_logprobs": [-1, 0]},
        "loss_mask has 3 entries, the response has 2 tokens",
    ),
    (
        {"prompt_ids": [1], "response_ids": [3], "behavior_logprobs": [-1], "policy_version": -1},
        "policy_version must be an integer >= 0",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}, {"role": "assistant"}]},
        "message 1 is a tool result that follows no tool call",
    ),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS, ids=[m.split(" ")[0] for _, m in BAD_ROWS])
def test_a_bad_row_stops_the_ingest_with_one_line_naming_file_and_line_and_nothing_is_written(
    student, local_store, tmp_path, bad, message
):
    path = write_jsonl(tmp_path / "rows.jsonl", [tool_conversation(1, 2), bad, tool_conversation(3, 4)])
    result = opd(
        "ingest", path, "--store", local_store.path(""), "--student", student, "--policy-version", 0,
        "--chat-template", TEMPLATE, "--max-tokens", 64,
    )  # fmt: skip
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: {path}:2: "), result.stderr
    assert re.search(message, result.stderr), result.stderr
    assert not local_store.exists("run.json") and not local_store.shards.rollouts()


def test_skip_bad_writes_the_good_rows_and_counts_the_bad(student, local_store, tmp_path):
    rows = [tool_conversation(1, 2)] + [bad for bad, _ in BAD_ROWS] + [tool_conversation(3, 4)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    result = opd(
        "ingest", path, "--store", local_store.path(""), "--student", student, "--policy-version", 0,
        "--chat-template", TEMPLATE, "--max-tokens", 64, "--skip-bad",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"ingested 2 rows into 1 shards (2 with computed behavior log-probs), skipped {len(BAD_ROWS)} bad rows" in (
        result.stdout
    )
    assert result.stderr.count(f"skipped {path}:") == len(BAD_ROWS)
    [(_, table, _)] = rows_of(local_store)
    assert table["ground_truth"].to_pylist() == ["3", "7"]


def test_missing_policy_version_and_missing_files_are_refused(student, local_store, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [tool_conversation(1, 2)])
    with pytest.raises(IngestError, match=rf"{path}:1: no policy version: give --policy-version"):
        ingest([str(path)], local_store, IngestOptions(chat_template=str(TEMPLATE)), student=str(student))
    with pytest.raises(IngestError, match="nowhere.jsonl: no such file"):
        ingest([str(tmp_path / "nowhere.jsonl")], local_store, IngestOptions(), student=str(student))
    with pytest.raises(ValueError, match="--student is required"):
        ingest([str(path)], local_store, IngestOptions(policy_version=0))
